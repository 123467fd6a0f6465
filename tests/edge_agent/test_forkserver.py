"""The agent's forkserver: the decision child, the CUDA probe, starting early, what the idle server leaves out,
and an agent process without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edge_agent import forkserver, mappings
from edge_agent.config import AgentConfig, AgentDataConfig, TaskLimits
from edge_agent.daemon import EdgeAgent
from edge_agent.decision import decide_in_workdir
from edge_agent.forkserver import DecisionFailed, Exit, run_decision
from edge_agent.runner import LocalData
from edge_agent.workdir import DECISION_FILE, TASK_FILE, DataShape, Decision, DecisionRequest
from models import SubmodelSpec
from protocol import Adaptation, Task, decode, encode

ROOT = Path(__file__).resolve().parents[2]
DATA = DataShape(16, tuple(range(10)), 1, (8, 8))


def write_request(workdir: Path, task: Task, available: int = 2**30, **kwargs) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / TASK_FILE).write_bytes(encode(task))
    DecisionRequest("cpu", "compact", available, 1.10, DATA, **kwargs).write(workdir)
    return workdir


def test_the_entries_the_agent_runs_name_functions_of_a_path():
    from edge_agent import child, decision

    assert forkserver.TRAIN.resolve() is child.train_in_workdir
    assert forkserver.DECIDE.resolve() is decision.decide_in_workdir
    assert forkserver.PROBE_CUDA.resolve() is child.probe_cuda
    with pytest.raises(TypeError, match="edge_agent.forkserver:PRELOAD is not callable"):
        forkserver.ChildEntry("edge_agent.forkserver", "PRELOAD").resolve()
    with pytest.raises(AttributeError):
        forkserver.ChildEntry("edge_agent.child", "no_such_function").resolve()


def test_a_decision_child_decides_and_writes_the_adapted_task(tmp_path, make_task, family, decider_for,
                                                              make_runner):
    task = make_task(SubmodelSpec.uniform(1.0), adaptation=Adaptation("width-levels", rates=[1.0, 0.5, 0.25]))
    runner = make_runner(budget=10**12)
    full = decider_for(runner).raw_estimate(task.model, SubmodelSpec.uniform(1.0), task.plan)
    workdir = write_request(tmp_path / "work", task, available=full.total)  # the calibrated estimate does not fit
    pids: list[int] = []
    decision = run_decision(workdir, 60, on_start=pids.append)
    assert decision.status == "adapted" and decision.spec == {"width": 0.5}, decision
    assert decision.reason.startswith("adapted width=1 -> width=0.5 to fit ")
    assert decision.raw_total > 0 and decision.estimate <= full.total
    assert len(decision.estimates) == 3  # every level the task allows was estimated, and handed back
    written = decode((workdir / TASK_FILE).read_bytes(), expected=Task)
    assert written.spec == {"width": 0.5} and written.adaptation is None
    assert set(written.weights) == set(family.state_keys(SubmodelSpec.uniform(0.5)))
    assert pids and not Path(f"/proc/{pids[0]}").exists()  # the child is gone


def test_a_decision_that_trains_what_was_sent_leaves_the_task_alone(tmp_path, make_task):
    task = make_task()
    workdir = write_request(tmp_path / "work", task)
    decision = run_decision(workdir, 60)
    assert (decision.status, decision.reason, decision.spec) == ("ok", None, task.spec)
    assert (workdir / TASK_FILE).read_bytes() == encode(task)


def test_a_decision_declines_over_the_limits_and_fails_an_unknown_family(tmp_path, make_task):
    over = run_decision(write_request(tmp_path / "a", make_task(epochs=5), limits=TaskLimits(max_epochs=2)), 60)
    assert over == Decision("declined", "task refused: it trains 5 epochs, more than limits.max_epochs 2")
    task = make_task()
    unknown = Task(**{**task.__dict__, "model": type(task.model)("transformer", 10, 1, {})})
    failed = decide_in_workdir(write_request(tmp_path / "b", unknown))
    assert failed.status == "failed" and failed.reason.startswith("ValueError: ")
    garbage = tmp_path / "c"
    write_request(garbage, task)
    (garbage / TASK_FILE).write_bytes(b"\x00 not msgpack")
    assert decide_in_workdir(garbage).reason.startswith("invalid task: ")


def test_an_estimate_that_fails_reaches_the_decision_as_itself(tmp_path, make_task, monkeypatch):
    """Whatever stops the estimator's traced pass is the reason, with its type, never relabelled as an input that
    does not fit (as torch's refusal of autograd in a forked child once was)."""
    import models.memory

    refusal = "Unable to handle autograd's threading in combination with fork-based multiprocessing."

    def refuse(*_args, **_kwargs):
        raise RuntimeError(refusal)

    monkeypatch.setattr(models.memory, "backward_step", refuse)
    monkeypatch.setattr(models.memory, "_cache", {})  # the estimator's cache cannot answer without the pass
    answer = decide_in_workdir(write_request(tmp_path / "work", make_task(batch_size=7)))
    assert (answer.status, answer.reason) == ("failed", f"RuntimeError: {refusal}")


@pytest.mark.slow
@pytest.mark.parametrize("gpu", [False, True])
def test_the_warm_up_leaves_autograd_cold_where_a_gpu_is_wanted(gpu):
    """Where a GPU is wanted the server runs no backward pass (autograd's first would start CUDA there and, with a
    GPU, make torch refuse autograd in every child) and hides nothing; where none is, it hides the GPUs from CUDA
    and warms autograd up as before. Run in a process of its own, told a GPU is (not) present."""
    script = textwrap.dedent(f"""
        import json, os
        import torch
        from edge_agent import child_warmup, gpu_stack
        gpu_stack.gpu_present = lambda: {gpu}
        passes = []
        backward = torch.autograd.backward
        def counted(*args, **kwargs):
            passes.append(1)
            return backward(*args, **kwargs)
        torch.autograd.backward = counted
        child_warmup.prepare(light=False)
        print(json.dumps({{"passes": len(passes), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}}))
    """)
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK", "FEDFIT_TRAIN_ON_CPU_ONLY")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if gpu:
        assert seen == {"passes": 0, "visible": None, "nvml": "1"}
    else:
        assert seen == {"passes": 1, "visible": "", "nvml": None}


def test_a_decision_child_that_fails_is_one_sentence(tmp_path, make_task):
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / TASK_FILE).write_bytes(encode(make_task()))  # no request: the child cannot decide
    with pytest.raises(DecisionFailed, match=r"^the deciding process failed \(exit code 1\): FileNotFoundError"):
        run_decision(workdir, 60)


def test_a_cancelled_decision_child_is_killed_and_said_so(tmp_path, make_task):
    cancel = threading.Event()
    cancel.set()  # the agent is stopping: the child is killed at the first look
    with pytest.raises(DecisionFailed, match="^deciding what to train was cancelled$"):
        run_decision(write_request(tmp_path, make_task()), 60, cancel=cancel)


def test_a_decision_child_answering_garbage_is_refused(tmp_path, make_task, monkeypatch):
    workdir = write_request(tmp_path / "work", make_task())

    def child_writes_garbage(entry, workdir, timeout, on_start=None, cancel=None, **_settings):
        (workdir / DECISION_FILE).write_text('{"status": "perhaps"}')
        return Exit(0)

    monkeypatch.setattr(forkserver, "run_child", child_writes_garbage)
    with pytest.raises(DecisionFailed, match="answered garbage: a decision's status is one of"):
        run_decision(workdir, 60)
    monkeypatch.setattr(forkserver, "run_child", lambda *args, **kwargs: Exit(None, timed_out=True))
    with pytest.raises(DecisionFailed, match="did not finish within 60 s"):
        run_decision(workdir, 60)
    monkeypatch.setattr(forkserver, "run_child", lambda *args, **kwargs: Exit(-9))
    with pytest.raises(DecisionFailed, match=r"failed \(killed by SIGKILL\)"):
        run_decision(workdir, 60)


def test_a_failed_decision_child_fails_the_task(make_task, make_runner, monkeypatch):
    monkeypatch.setattr(forkserver, "run_child", lambda *args, **kwargs: Exit(-9))
    update = make_runner().run(make_task())
    assert update.status == "failed"
    assert update.reason == "the deciding process failed (killed by SIGKILL)"


def test_cuda_is_asked_in_a_child():
    import torch

    assert forkserver.cuda_available() is torch.cuda.is_available()


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_agent_process_imports_no_torch():
    """Everything the ``fedfit agent`` process imports, and the command itself, leave torch to the forkserver."""
    out = run_python("""
        import sys
        import edge_agent.daemon, edge_agent.runner, edge_agent.data_source, edge_agent.forkserver
        from fedfit.cli import main
        code = main(["agent", "--config", "/nonexistent/agent.yaml"])
        print(code, sorted(name for name in ("torch", "torchvision", "models", "coordinator") if name in sys.modules))
    """)
    assert out.strip() == "2 []"


@pytest.mark.slow
def test_start_brings_the_forkserver_up_with_torch_while_the_caller_has_none():
    out = run_python("""
        import json, sys, time
        import psutil
        from edge_agent import forkserver

        if __name__ == "__main__":
            forkserver.start()

            def servers():  # a child between fork and exec still shows the caller's command line: wait for it
                return [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]

            def has_torch():
                return bool(servers()) and "libtorch" in open(f"/proc/{servers()[0].pid}/maps").read()

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not has_torch():
                time.sleep(0.2)
            print(json.dumps([len(servers()), has_torch(), "torch" in sys.modules]))
    """)
    assert json.loads(out) == [1, True, False]


def test_the_idle_forkserver_leaves_out_what_it_does_not_run():
    """Where no GPU is present the server never loads triton or cuda.bindings, and it gives back the library pages
    its imports and warm-up read (a child maps what it runs itself): it holds fewer of torch's library pages than
    this process, which has imported and run torch."""
    import torch

    torch.nn.Linear(4, 4)(torch.ones(2, 4)).sum().backward()
    out = run_python("""
        import json, tempfile
        from pathlib import Path
        import psutil
        from edge_agent import forkserver, gpu_stack, mappings

        if __name__ == "__main__":
            nothing = forkserver.ChildEntry("pathlib", "Path")  # a child doing nothing
            end = forkserver.run_child(nothing, Path(tempfile.mkdtemp()), 120)
            server = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())][0]
            paths = [m.path for m in mappings.read(server.pid)]
            torch_pages = sum(m.rss - m.anonymous for m in mappings.read(server.pid) if "/torch/" in m.path)
            print(json.dumps([end.exitcode, gpu_stack.gpu_present(), any("/triton/" in p for p in paths),
                              any("/cuda/bindings/" in p for p in paths), torch_pages]))
    """)
    exitcode, gpu, triton, bindings, server_pages = json.loads(out)
    own_pages = sum(m.rss - m.anonymous for m in mappings.read() if "/torch/" in m.path)
    assert exitcode == 0
    if not gpu:
        assert (triton, bindings) == (False, False)
    assert server_pages < own_pages / 2, (server_pages, own_pages)


def test_an_agent_configured_to_start_its_forkserver_early_does(monkeypatch):
    started: list[float] = []
    monkeypatch.setattr(forkserver, "start", lambda: started.append(time.monotonic()))
    for when, expected in (("first-task", 0), ("start-up", 1)):
        agent = EdgeAgent(AgentConfig(agent_id="a", data=AgentDataConfig(dataset="digits"), forkserver=when),
                          LocalData(np.zeros((2, 1, 8, 8), np.float32), np.array([0, 1])))
        monkeypatch.setattr(agent, "_refuse_if_online", lambda timeout: None)
        monkeypatch.setattr(agent.link, "start", lambda timeout: None)
        monkeypatch.setattr(agent.uplink, "start", lambda: None)
        monkeypatch.setattr(agent, "_timer", type("T", (), {"start": lambda self: None,
                                                            "is_alive": lambda self: False})())
        agent.start()
        assert len(started) == expected
        agent.runner.close()


def test_the_forkserver_preloads_no_mqtt_client_or_logging():
    """Every object the server holds is a page a child may copy: its preloads leave the agent's plumbing out."""
    out = run_python("""
        import sys
        from edge_agent.forkserver import PRELOAD
        for name in PRELOAD:
            __import__(name)
        print(sorted(name for name in ("paho", "structlog", "yaml", "edge_agent.config", "edge_agent.daemon")
                     if name in sys.modules))
    """)
    assert out.strip() == "[]"


def test_a_cuda_probe_that_cannot_answer_is_one_sentence(monkeypatch):
    def child_fails(entry, workdir, timeout, on_start=None):
        (workdir / "error.txt").write_text("ModuleNotFoundError: No module named 'torch'\nTraceback ...")
        return Exit(1)

    monkeypatch.setattr(forkserver, "run_child", child_fails)
    with pytest.raises(forkserver.TorchUnavailable, match=r"^device: auto could not ask torch whether CUDA is "
                                                          r"available: ModuleNotFoundError: No module named 'torch'$"):
        forkserver.cuda_available()


@pytest.mark.slow
def test_a_forkserver_that_cannot_start_is_one_sentence(tmp_path):
    """A preload that fails other than by ImportError (a broken libtorch, say) kills the server as it starts."""
    (tmp_path / "broken_torch.py").write_text('raise OSError("libtorch_cpu.so: cannot open shared object file")\n')
    out = run_python(f"""
        import os, tempfile
        from pathlib import Path
        os.environ["PYTHONPATH"] = {str(tmp_path)!r}  # the forkserver's own interpreter finds it there
        from edge_agent import forkserver
        forkserver.PRELOAD = [*forkserver.PRELOAD, "broken_torch"]

        if __name__ == "__main__":
            for ask in (lambda: forkserver.run_child(forkserver.PROBE_CUDA, Path(tempfile.mkdtemp()), 60),
                        forkserver.cuda_available):
                try:
                    ask()
                except forkserver.TorchUnavailable as exc:
                    print(exc)
    """)
    said = "the training forkserver could not start; it imports torch and the trainer, and its error is on this " \
           "process's stderr"
    assert out.splitlines() == [said, f"device: auto could not ask torch whether CUDA is available: {said}"]


def test_a_forkserver_that_cannot_be_started_says_why(tmp_path):
    """Its socket goes in a new directory under TMPDIR: one too long for an AF_UNIX path (107 bytes) is named in
    the one sentence, with the cause, not left to a stderr that says nothing."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    out = run_python(f"""
        import os, tempfile
        from pathlib import Path
        os.environ["TMPDIR"] = {str(deep)!r}
        tempfile.tempdir = None  # read TMPDIR again
        from edge_agent import forkserver

        if __name__ == "__main__":
            try:
                forkserver.run_child(forkserver.PROBE_CUDA, Path({str(tmp_path)!r}), 60)
            except forkserver.TorchUnavailable as exc:
                print(exc)
    """)
    assert out.startswith("the training forkserver could not be started: ") and str(deep) in out, out


def test_children_run_from_several_threads_all_report_their_own_exit(tmp_path):
    # Two training processes at once in a simulation share this process's forkserver; a child's exit status
    # read by two threads at once was lost (255) for one of them. Every child here succeeds and must say so.
    def run_many(thread: int) -> list[int | None]:
        codes = []
        for index in range(20):
            workdir = tmp_path / f"{thread}-{index}"
            workdir.mkdir()
            nothing = forkserver.ChildEntry("pathlib", "Path")  # a child doing nothing
            codes.append(forkserver.run_child(nothing, workdir, 120).exitcode)
        return codes

    with ThreadPoolExecutor(max_workers=8) as pool:  # the old code lost a status in about half the runs
        codes = [code for result in pool.map(run_many, range(8)) for code in result]
    assert codes == [0] * 160


def server_start_environment(monkeypatch, name: str) -> str | None:
    """The value of ``name`` in the environment the forkserver is started with (no pool preloaded; nothing is
    really started)."""
    seen: list[str | None] = []
    monkeypatch.setattr(forkserver, "_page_pool", None)
    monkeypatch.setattr(forkserver.multiprocessing.forkserver, "ensure_running",
                        lambda: seen.append(os.environ.get(name)))
    if forkserver.process_context().get_start_method() != "forkserver":
        pytest.skip("no forkserver on this platform")
    forkserver.start()
    (value,) = seen
    return value


@pytest.mark.parametrize(("devices", "cpu_only"), [({"cpu"}, "1"), ({"cpu", "cuda"}, None), ({"auto"}, None)])
def test_the_forkserver_starts_told_to_train_on_the_cpu_only_when_every_agent_does(monkeypatch, devices, cpu_only):
    from edge_agent import gpu_stack

    monkeypatch.setattr(forkserver, "_devices", set(devices))
    monkeypatch.delenv(gpu_stack.CPU_ONLY_ENV, raising=False)
    assert server_start_environment(monkeypatch, gpu_stack.CPU_ONLY_ENV) == cpu_only
    assert gpu_stack.CPU_ONLY_ENV not in os.environ  # set only while the server starts


@pytest.mark.parametrize(("declared", "given", "expected"), [
    (set(), None, None),  # nobody declared: OpenMP's own default (the cores)
    ({1, 3}, None, "3"),  # the most any agent trains with: the pools its children start have that many threads
    ({1, 3}, "2", "2"),  # the operator's setting is kept
])
def test_the_forkserver_starts_with_the_declared_threads_as_its_openmp_default(monkeypatch, declared, given,
                                                                               expected):
    monkeypatch.setattr(forkserver, "_threads", set(declared))
    if given is None:
        monkeypatch.delenv(forkserver.OMP_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(forkserver.OMP_THREADS_ENV, given)
    assert server_start_environment(monkeypatch, forkserver.OMP_THREADS_ENV) == expected
    assert os.environ.get(forkserver.OMP_THREADS_ENV) == given  # set only while the server starts
    with pytest.raises(ValueError, match="at least one thread"):
        forkserver.declare_threads(0)


def test_an_agent_declares_its_training_device_and_threads_before_its_forkserver_starts(monkeypatch):
    declared: set[str] = set()
    threads: set[int] = set()
    monkeypatch.setattr(forkserver, "_devices", declared)
    monkeypatch.setattr(forkserver, "_threads", threads)
    agent = EdgeAgent(AgentConfig(agent_id="a", data=AgentDataConfig(dataset="digits"), device="cpu",
                                  torch_threads=3),
                      LocalData(np.zeros((2, 1, 8, 8), np.float32), np.array([0, 1])))
    try:
        assert declared == {"cpu"} and threads == {3}
    finally:
        agent.executor.shutdown(wait=True)
        agent.runner.close()


@pytest.mark.parametrize("machine", ["aarch64", "x86_64"])
def test_the_warm_up_keeps_the_arm_compute_librarys_pool_out_of_the_forkserver(monkeypatch, machine):
    # On aarch64 oneDNN hands convolutions to the Arm Compute Library, whose OpenMP team, started in the server,
    # would hang a forked child's first parallel convolution: the warm-up's convolution runs without oneDNN there,
    # and oneDNN is on again for the children. Elsewhere nothing changes.
    import torch

    from edge_agent import child_warmup

    monkeypatch.setattr(child_warmup.platform, "machine", lambda: machine)
    seen = []
    convolve = torch.nn.Conv2d._conv_forward

    def spy(self, *args):
        seen.append(torch.backends.mkldnn.enabled)
        return convolve(self, *args)

    monkeypatch.setattr(torch.nn.Conv2d, "_conv_forward", spy)
    threads = torch.get_num_threads()
    enabled = torch.backends.mkldnn.enabled
    try:
        child_warmup.warm_up()
    finally:
        torch.set_num_threads(threads)
    assert seen == [machine != "aarch64" and enabled]
    assert torch.backends.mkldnn.enabled == enabled

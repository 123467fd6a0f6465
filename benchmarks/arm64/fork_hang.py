"""Does a child forked after torch's first op still train? The arm64 fork hang of issue 31, without FedFit.

The parent does what the training forkserver does (``edge_agent.child_warmup``): ``torch.set_num_threads(1)``,
then one op (``--warmup conv``: a Conv2d forward; ``train``: the forkserver's forward, backward and SGD step),
and lists its threads (``/proc/self/task/*/comm``) before torch, after the import and after the op. Then it
forks; the child trains a small CNN (forward, backward, SGD) with each of ``--threads`` torch threads and prints
the mean step time. A child that has not finished within ``--timeout`` s is reported as hung: its threads with
their state and kernel wait channel, a Python traceback (faulthandler) and, where ``benchmarks/arm64/btdump.so``
is preloaded (``LD_PRELOAD``), a native backtrace of each thread, and it is killed. ``--backtrace`` also dumps
the parent's threads after the op (where the thread torch started is parked says who started it).

``--setup CODE`` runs Python code after ``import torch`` and before anything else (``torch`` is in scope), e.g.
``--setup 'torch.backends.mkldnn.enabled = False'``; environment variables (``OMP_NUM_THREADS=1``...) are given
by the caller. One JSON line at the end (``"result"``) sums it up. Runs anywhere; under qemu-user it takes
minutes.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path


def threads(pid: int | str = "self") -> dict[str, str]:
    """Thread id -> name of process ``pid``."""
    out = {}
    for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            out[task] = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            pass
    return out


def thread_states(pid: int) -> list[str]:
    """One line per thread: id, name, state, kernel wait channel."""
    lines = []
    for task, name in threads(pid).items():
        base = f"/proc/{pid}/task/{task}"
        try:
            state = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"{base}/wchan").read_text().strip() or "-"
        except OSError:
            state, wchan = "?", "?"
        try:
            syscall = Path(f"{base}/syscall").read_text().split()
            syscall = " ".join(syscall[:3])
        except OSError:
            syscall = "?"
        lines.append(f"{task} {name!r} state={state} wchan={wchan} syscall={syscall}")
    return lines


def signal_threads(pid: int, sig: int = signal.SIGUSR2, pause: float = 1.0) -> None:
    """Send ``sig`` to every thread of ``pid``, one at a time (btdump's handler writes a backtrace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = {"x86_64": 234, "aarch64": 131}[os.uname().machine]  # the syscall number
    for task in threads(pid):
        libc.syscall(tgkill, pid, int(task), sig)
        time.sleep(pause)


def small_cnn(torch):
    from torch import nn
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 7 * 7, 10))


def mark(text: str) -> None:
    """A progress line, written at once (no buffering, no lock a dead thread could hold)."""
    os.write(1, f"child {os.getpid()}: {text}\n".encode())


def child(args: argparse.Namespace, torch) -> None:
    mark(f"forked; threads {threads()}")
    if args.child_setup:
        exec(args.child_setup, {"torch": torch})  # noqa: S102 - the experimenter's own code
    if args.faulthandler:
        faulthandler.dump_traceback_later(max(5.0, args.timeout - 10), exit=False)
        mark(f"faulthandler armed; threads {threads()}")
    times = {}
    for n in args.threads:
        torch.set_num_threads(n)
        mark(f"set_num_threads({n})")
        torch.manual_seed(0)
        model = small_cnn(torch)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
        spent = []
        for step in range(args.steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if step:  # the first step warms up
                spent.append(time.perf_counter() - start)
            else:
                mark(f"first step with {n} threads done")
        times[n] = sum(spent) / len(spent)
        print(json.dumps({"child_threads": n, "step_s": round(times[n], 4), "loss": round(loss.item(), 3),
                          "threads_now": threads()}), flush=True)
    if args.faulthandler:
        faulthandler.cancel_dump_traceback_later()
    Path(args.result).write_text(json.dumps(times))
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", choices=("conv", "train", "none"), default="conv")
    parser.add_argument("--setup", default="", help="Python run after import torch, before the first op")
    parser.add_argument("--child-setup", default="", help="Python the child runs first")
    parser.add_argument("--threads", default="1,2", help="the child's torch threads, one run each")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds before the child counts as hung")
    parser.add_argument("--backtrace", action="store_true", help="dump the parent's threads after the op")
    parser.add_argument("--config", action="store_true", help="print torch's build and parallel settings")
    parser.add_argument("--faulthandler", action="store_true",
                        help="the child dumps its Python stack before the timeout (starts a watchdog thread)")
    args = parser.parse_args()
    args.threads = [int(n) for n in args.threads.split(",")]
    args.result = f"/tmp/fork_hang.{os.getpid()}.json"
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                                                                 "DNNL_", "ONEDNN_", "ACL_", "TORCH_", "ATEN_"))}
    print(json.dumps({"env": env, "setup": args.setup, "threads_before_torch": threads()}), flush=True)
    start = time.perf_counter()
    import torch
    import_s = time.perf_counter() - start
    if args.setup:
        exec(args.setup, {"torch": torch})  # noqa: S102 - the experimenter's own code
    torch.set_num_threads(1)  # as the forkserver does
    after_import = threads()
    print(json.dumps({"import_s": round(import_s, 1), "threads_after_import": after_import}), flush=True)
    if args.config:
        print(torch.__config__.show(), torch.__config__.parallel_info(), flush=True)
    if args.warmup == "conv":
        torch.nn.Conv2d(1, 4, 3, padding=1)(torch.randn(4, 1, 8, 8))
    elif args.warmup == "train":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from edge_agent.child_warmup import warm_up
        warm_up()
    after_op = threads()
    new = {tid: name for tid, name in after_op.items() if tid not in after_import}
    print(json.dumps({"threads_after_op": after_op, "new_threads": new}), flush=True)
    if args.backtrace:
        signal_threads(os.getpid())
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(args, torch)
    deadline = time.monotonic() + args.timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.5)
    else:
        status = None
        print("child hung; its threads:\n  " + "\n  ".join(thread_states(pid)), flush=True)
        signal_threads(pid)
        time.sleep(2)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    ok = status == 0 and os.path.exists(args.result)
    times = json.loads(Path(args.result).read_text()) if ok else {}
    if ok:
        os.unlink(args.result)
    print(json.dumps({"result": "trained" if ok else "hung" if status is None else f"failed ({status})",
                      "new_threads_in_parent": new, "step_s": times, "env": env, "setup": args.setup,
                      "child_setup": args.child_setup}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

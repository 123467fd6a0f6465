"""Do training children forked from FedFit's own forkserver train, and on the threads they ask for?

For each count of ``--threads`` in turn (``--rounds`` times), a process of its own starts the agent's training
forkserver as an agent training with that many threads does (``edge_agent.forkserver.declare_threads``; its
preload imports torch and warms up, ``edge_agent.child_warmup``) and forks children from it one after another,
``--forks`` in all. Each child sets its count, trains FedFit's CNN (at ``--width``, Fashion-MNIST's 28x28 input,
``--batch`` images; forward, backward, SGD) for one warm-up step and ``--steps`` timed ones, and writes its mean
step time and the most OS threads it had while training. A child that has not finished within ``--timeout`` s
counts as hung and is killed.

Prints one JSON line per child, then one (``"result"``) with, per thread count, the median step time and the most
OS threads a child had, and the ratio of the first count's median to each other's (above 1: faster with more
threads). Exit 0 only when every child trained. Runs anywhere; under qemu-user (``benchmarks/arm64_check.sh --parts threads``) a
step takes about a second, and timings there say only whether a second thread helps, not how fast a Pi is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edge_agent import forkserver  # (after the repository is on the path)

#: The child's entry: this module's :func:`train_steps`, resolved by name in the forked child.
ENTRY = forkserver.ChildEntry("benchmarks.arm64.forkserver_threads", "train_steps")
REQUEST_FILE = "threads_request.json"
RESULT_FILE = "threads_result.json"


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def train_steps(workdir: Path) -> None:
    """The child's work: train FedFit's CNN on random data with the request's thread count; write the mean step
    time, torch's own count and the most OS threads this process had after a step."""
    import torch

    from models import SubmodelSpec, get_family

    request = json.loads((workdir / REQUEST_FILE).read_text())
    torch.set_num_threads(request["threads"])
    torch.manual_seed(request["seed"])
    model = get_family("cnn", 10, 1).build(SubmodelSpec.uniform(request["width"])).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(request["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (request["batch"],))
    spent, most_threads = [], _thread_count()
    for step in range(request["steps"] + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step:  # the first step is the warm-up
            spent.append(time.perf_counter() - start)
        most_threads = max(most_threads, _thread_count())
    (workdir / RESULT_FILE).write_text(json.dumps({
        "step_s": sum(spent) / len(spent), "torch_threads": torch.get_num_threads(),
        "os_threads": most_threads, "loss": loss.item()}))


def run_one(threads: int, args: argparse.Namespace, index: int) -> dict[str, object]:
    """Fork one child from the forkserver and wait for it; its result, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="fedfit-threads-") as directory:
        workdir = Path(directory)
        (workdir / REQUEST_FILE).write_text(json.dumps(
            {"threads": threads, "steps": args.steps, "batch": args.batch, "width": args.width, "seed": index}))
        started = time.perf_counter()
        exit_ = forkserver.run_child(ENTRY, workdir, timeout=args.timeout)
        row: dict[str, object] = {"child": index, "threads": threads,
                                  "wall_s": round(time.perf_counter() - started, 2)}
        result = workdir / RESULT_FILE
        if exit_.timed_out:
            row["outcome"] = "hung"
        elif exit_.exitcode != 0 or not result.exists():
            row["outcome"] = f"failed (exit {exit_.exitcode}): {forkserver.error_text(workdir) or 'no result'}"
        else:
            row.update(outcome="trained", **json.loads(result.read_text()))
        return row


def summarise(rows: list[dict[str, Any]], counts: list[int]) -> dict[str, object]:
    """Per thread count: the median step time and the most OS threads a child had; the ratios to the first."""
    per: dict[str, dict[str, float]] = {}
    for count in counts:
        trained = [row for row in rows if row["threads"] == count and row["outcome"] == "trained"]
        if trained:
            per[str(count)] = {"median_step_s": round(statistics.median(float(r["step_s"]) for r in trained), 4),
                               "os_threads": max(int(r["os_threads"]) for r in trained),
                               "children": len(trained)}
    base = per.get(str(counts[0]), {}).get("median_step_s")
    ratios = {f"{counts[0]}/{count}": round(base / per[str(count)]["median_step_s"], 3)
              for count in counts[1:] if base and str(count) in per}
    bad = [row for row in rows if row["outcome"] != "trained"]
    return {"result": "trained" if not bad else f"{len(bad)} of {len(rows)} children did not train",
            "children": len(rows), "hung": sum(row["outcome"] == "hung" for row in rows),
            "per_threads": per, "speedup": ratios,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "OPENBLAS_", "DNNL_"))}}


def serve(count: int, forks: int, first: int, args: argparse.Namespace) -> None:
    """One forkserver started for ``count`` threads; ``forks`` children from it, one JSON line each."""
    forkserver.declare_threads(count)
    forkserver.start()
    for index in range(first, first + forks):
        print(json.dumps(run_one(count, args, index)), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forks", type=int, default=50, help="children to fork in all, one after another")
    parser.add_argument("--threads", default="1,2", help="the children's torch thread counts, taken in turn")
    parser.add_argument("--rounds", type=int, default=2, help="forkservers per count, alternating between counts")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per child, after one warm-up step")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=float, default=0.25, help="the CNN's width (1: 1.56 M parameters)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a child counts as hung")
    parser.add_argument("--serve", type=int, nargs=2, metavar=("FORKS", "FIRST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    if (args.forks < 1 or not counts or min(counts) < 1 or args.steps < 1 or args.rounds < 1
            or not 0 < args.width <= 1):
        parser.error("--forks, --rounds, --steps and every --threads count must be at least 1, --width in (0, 1]")
    if args.serve:  # one forkserver's share: a process of its own, so that its server starts for its count
        serve(counts[0], args.serve[0], args.serve[1], args)
        return 0
    shares = [(count, turn) for turn in range(args.rounds) for count in counts]
    rows: list[dict[str, Any]] = []
    for number, (count, _turn) in enumerate(shares):
        forks = args.forks // len(shares) + (number < args.forks % len(shares))
        if forks == 0:
            continue
        command = [sys.executable, __file__, "--threads", str(count), "--steps", str(args.steps), "--batch",
                   str(args.batch), "--width", str(args.width), "--timeout", str(args.timeout),
                   "--serve", str(forks), str(len(rows))]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
        share = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        for row in share:
            print(json.dumps(row), flush=True)
        if len(share) < forks:  # its forkserver did not start, or a child took its parent down
            share += [{"child": len(rows) + len(share) + k, "threads": count,
                       "outcome": f"failed (its forkserver's process exited {done.returncode})"}
                      for k in range(forks - len(share))]
        rows += share
    summary = summarise(rows, counts)
    print(json.dumps(summary), flush=True)
    return 0 if summary["result"] == "trained" else 1


if __name__ == "__main__":
    sys.exit(main())

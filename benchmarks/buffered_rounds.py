"""Synchronous against buffered rounds on one fleet: the wall time each takes to the synchronous run's final accuracy.

Runs ``fedfit sim`` twice on the same fleet, data, seed and method, once with ``round_mode: sync`` for ``--rounds``
rounds and once with ``round_mode: buffered`` for ``--buffered-rounds`` (its rounds aggregate fewer updates each,
so it needs more of them), then reads both reports and prints, per run: rounds, updates aggregated and how late,
final and best accuracy, wall time (the rounds' own seconds summed: start-up left out of both), and the time to the
synchronous run's final accuracy (the first round at or above it), and to within one point of it. Accuracy is one
test-set evaluation a round, so a curve crosses a level by chance too: read the times with the curves
(``accuracy.png`` in each run's directory, and the table this prints every ``--every`` rounds).

Run: ``.venv/bin/python benchmarks/buffered_rounds.py --out runs/buffered`` (FeDepth's ``fair`` fleet of the learning
goal, about 20 minutes on 2 cores); ``--read`` prints the figures of runs made before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def sim_command(args: argparse.Namespace, mode: str, rounds: int, run_dir: Path) -> list[str]:
    command = [str(Path(sys.executable).with_name("fedfit")), "sim", "--algorithm", args.algorithm, "--agents", str(args.agents),
               "--partition", args.partition, "--budgets", args.budgets, "--dataset", args.dataset, "--model",
               args.model, "--rounds", str(rounds), "--seed", str(args.seed), "--run-dir", str(run_dir),
               "--set", f"recipe.epochs={args.epochs}", "--set", f"round_mode={mode}"]
    if mode == "buffered":
        command += ["--set", f"buffered.size={args.size}", "--set", f"buffered.max_staleness={args.max_staleness}"]
    return command


def cumulative(rounds: list[dict[str, Any]]) -> list[float]:
    total, times = 0.0, []
    for entry in rounds:
        total += float(entry["seconds"])
        times.append(total)
    return times


def time_to(rounds: list[dict[str, Any]], level: float) -> tuple[int, float] | None:
    """The first round at or above ``level`` and the wall time to its end, or None."""
    for entry, elapsed in zip(rounds, cumulative(rounds)):
        if entry["global_accuracy"] >= level:
            return int(entry["round"]), elapsed
    return None


def describe(name: str, report: dict[str, Any], target: float) -> list[str]:
    rounds = report["rounds"]
    summary = report["summary"]
    stale = summary.get("staleness", {})
    reached, near = time_to(rounds, target), time_to(rounds, target - 0.01)

    def when(hit: tuple[int, float] | None) -> str:
        return "never" if hit is None else f"{hit[1]:.0f} s (round {hit[0]})"

    return [(f"{name}: {len(rounds)} rounds in {cumulative(rounds)[-1]:.0f} s, "
            f"{sum(entry['participants'] for entry in rounds)} updates aggregated (by rounds late: {stale}); "
            f"final {summary['final_global_accuracy']:.4f}, best {summary['best_global_accuracy']:.4f}; "
            f"to {target:.4f}: {when(reached)}; to within a point of it: {when(near)}")]


def curves(sync: dict[str, Any], buffered: dict[str, Any], every: float) -> list[str]:
    """Accuracy against wall time, one row per ``every`` seconds: each run's last evaluated round by then."""
    lines = [f"{'seconds':>8}  {'sync':>14}  {'buffered':>14}"]
    end = max(cumulative(sync["rounds"])[-1], cumulative(buffered["rounds"])[-1])
    moment = every
    while moment <= end + every:
        cells = []
        for report in (sync, buffered):
            done = [(entry, elapsed) for entry, elapsed in zip(report["rounds"], cumulative(report["rounds"]))
                    if elapsed <= moment]
            cells.append(f"{done[-1][0]['global_accuracy']:.4f} (r{done[-1][0]['round']:>3})" if done else "-")
        lines.append(f"{moment:>8.0f}  {cells[0]:>14}  {cells[1]:>14}")
        moment += every
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory of the two runs (sync/, buffered/)")
    parser.add_argument("--read", action="store_true", help="only read the runs in --out")
    parser.add_argument("--algorithm", default="fedepth")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--budgets", default="fair")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=30, help="the synchronous run's rounds")
    parser.add_argument("--buffered-rounds", type=int, default=None, help="the buffered run's (default: twice)")
    parser.add_argument("--size", type=int, default=0, help="buffered.size (0: half of what may train)")
    parser.add_argument("--max-staleness", type=int, default=16, help="buffered.max_staleness")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between the rows of the curves' table")
    args = parser.parse_args()
    out = Path(args.out)
    runs = {"sync": (out / "sync", args.rounds), "buffered": (out / "buffered", args.buffered_rounds or 2 * args.rounds)}
    if not args.read:
        out.mkdir(parents=True, exist_ok=True)
        for mode, (run_dir, rounds) in runs.items():
            print(f"running {mode}: {' '.join(sim_command(args, mode, rounds, run_dir)[1:])}", flush=True)
            with (out / f"{mode}.log").open("w") as log:
                done = subprocess.run(sim_command(args, mode, rounds, run_dir), check=False, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=log)
            if done.returncode:
                parser.error(f"the {mode} run failed (exit {done.returncode}): see {out / f'{mode}.log'}")
    try:
        reports = {mode: json.loads((run_dir / "report.json").read_text()) for mode, (run_dir, _) in runs.items()}
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read a run's report in {out} ({exc}): run without --read first")
    target = reports["sync"]["summary"]["final_global_accuracy"]
    for mode, report in reports.items():
        for line in describe(mode, report, target):
            print(line)
    sync_hit, buffered_hit = (time_to(reports[mode]["rounds"], target) for mode in ("sync", "buffered"))
    if sync_hit is not None and buffered_hit is not None:
        print(f"time to the synchronous final accuracy: buffered {buffered_hit[1]:.0f} s, synchronous "
              f"{sync_hit[1]:.0f} s (ratio {buffered_hit[1] / sync_hit[1]:.2f})")
    print()
    print("\n".join(curves(reports["sync"], reports["buffered"], args.every)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

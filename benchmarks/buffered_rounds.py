"""Synchronous against buffered rounds on one fleet: the wall time each takes to the synchronous run's final accuracy,
and where each stands at the same wall time, on a fleet whose devices train at different speeds.

For each seed, runs ``fedfit sim`` twice on the same fleet, data, seed and method, once with ``round_mode: sync`` for
``--rounds`` rounds and once with ``round_mode: buffered`` for ``--buffered-rounds`` (its rounds aggregate fewer
updates each, so it needs more of them), with the devices' training speeds of ``--speeds`` (``fedfit sim --speeds``:
a device of factor f takes f times this machine's time for a task; default ``10,4,2,1``, one factor per budget tier
of ``fair``, the weakest the slowest, a 10x spread as between a Pi 4 and a Jetson). Then it reads both reports and
prints, per run: rounds, updates aggregated and how late, final and best accuracy, wall time (the rounds' own
seconds summed: start-up left out of both), the time to the synchronous run's final accuracy (the first round at or
above it) and to within one point of it, the accuracy each run stood at when the shorter of the two ended (equal
wall time), and the account of every update: acked by its agent (``update_acked`` in ``daemons.log``) against
aggregated (each round's records: agent and staleness), refused with a reason (``update_refused``), and left
(``run.left`` of the report). Accuracy is one test-set evaluation a round, so a curve crosses a level by chance too:
read the times with the curves (``accuracy.png`` in each run's directory, and the table this prints every
``--every`` seconds).

Run: ``.venv/bin/python benchmarks/buffered_rounds.py --out runs/buffered --seeds 0,1`` (FeDepth's ``fair`` fleet of
the learning goal, 16 devices; about an hour on 2 cores); ``--read`` prints the figures of runs made before, and a
run whose directory holds its report already is not run again (a variant of the buffered run beside the same
synchronous one: copy ``seed<N>/sync`` into a new ``--out``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def sim_command(args: argparse.Namespace, mode: str, rounds: int, seed: int, run_dir: Path) -> list[str]:
    command = [str(Path(sys.executable).with_name("fedfit")), "sim", "--algorithm", args.algorithm, "--agents",
               str(args.agents), "--partition", args.partition, "--budgets", args.budgets, "--dataset", args.dataset,
               "--model", args.model, "--rounds", str(rounds), "--seed", str(seed), "--run-dir", str(run_dir),
               "--set", f"recipe.epochs={args.epochs}", "--set", f"round_mode={mode}"]
    if args.speeds:
        command += ["--speeds", args.speeds]
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


def accuracy_at(rounds: list[dict[str, Any]], moment: float) -> tuple[float, int] | None:
    """The accuracy of the last round evaluated by ``moment`` seconds, and that round; None before the first."""
    done = [entry for entry, elapsed in zip(rounds, cumulative(rounds)) if elapsed <= moment + 1e-9]
    return (float(done[-1]["global_accuracy"]), int(done[-1]["round"])) if done else None


def account(run_dir: Path, report: dict[str, Any]) -> dict[str, int]:
    """Every update of a run: acked by its agent, aggregated (and how often), refused with a reason, left."""
    acked, refused = Counter[tuple[str, int]](), 0
    for line in (run_dir / "daemons.log").read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "update_acked":  # task "r<round>-<agent>-<8 hex>"
            task = str(event.get("task", ""))
            acked[(task.split("-", 1)[1].rsplit("-", 1)[0], int(task.split("-")[0][1:]))] += 1
        elif event.get("event") == "update_refused":
            refused += 1
    def answers(*statuses: str) -> Counter[tuple[str, int]]:
        return Counter((task["agent"], int(task["round"]) - int(task.get("staleness") or 0))
                       for task in report["tasks"] if task["status"] in statuses)

    aggregated = answers("ok", "adapted")
    settled = answers("declined", "failed", "rejected")  # acked, and rightly never aggregated (rejected: a reason)
    return {"acked": sum(acked.values()), "aggregated": sum(aggregated.values()),
            "untrained": sum(settled.values()),
            "acked_not_aggregated": sum((acked - aggregated - settled).values()),
            "aggregated_twice": sum(count - 1 for count in aggregated.values() if count > 1),
            "refused": refused, "left": len(report["run"].get("left", []))}


def describe(name: str, report: dict[str, Any], target: float, moment: float, ledger: dict[str, int]) -> str:
    rounds = report["rounds"]
    summary = report["summary"]
    reached, near = time_to(rounds, target), time_to(rounds, target - 0.01)
    then = accuracy_at(rounds, moment)

    def when(hit: tuple[int, float] | None) -> str:
        return "never" if hit is None else f"{hit[1]:.0f} s (round {hit[0]})"

    return (f"{name}: {len(rounds)} rounds in {cumulative(rounds)[-1]:.0f} s, "
            f"{sum(entry['participants'] for entry in rounds)} updates aggregated (by rounds late: "
            f"{summary.get('staleness', {})}); final {summary['final_global_accuracy']:.4f}, best "
            f"{summary['best_global_accuracy']:.4f}; at {moment:.0f} s: "
            f"{'-' if then is None else f'{then[0]:.4f} (round {then[1]})'}; to {target:.4f}: {when(reached)}; to "
            f"within a point of it: {when(near)}; updates: {ledger['acked']} acked, {ledger['aggregated']} "
            f"aggregated, {ledger['untrained']} declined, failed or rejected with a reason, "
            f"{ledger['acked_not_aggregated']} acked and never aggregated, {ledger['aggregated_twice']} "
            f"aggregated twice, {ledger['refused']} refused with a reason, {ledger['left']} left")


def curves(sync: dict[str, Any], buffered: dict[str, Any], every: float) -> list[str]:
    """Accuracy against wall time, one row per ``every`` seconds: each run's last evaluated round by then."""
    lines = [f"{'seconds':>8}  {'sync':>14}  {'buffered':>14}"]
    end = max(cumulative(sync["rounds"])[-1], cumulative(buffered["rounds"])[-1])
    moment = every
    while moment <= end + every:
        cells = []
        for report in (sync, buffered):
            then = accuracy_at(report["rounds"], moment)
            cells.append("-" if then is None else f"{then[0]:.4f} (r{then[1]:>3})")
        lines.append(f"{moment:>8.0f}  {cells[0]:>14}  {cells[1]:>14}")
        moment += every
    return lines


def compare_seed(out: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """Read (and print) one seed's two runs; their figures, or None when a report is missing."""
    runs = {"sync": out / "sync", "buffered": out / "buffered"}
    try:
        reports = {mode: json.loads((run_dir / "report.json").read_text()) for mode, run_dir in runs.items()}
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{out}: cannot read a run's report ({exc}): run it without --read first")
        return None
    target = reports["sync"]["summary"]["final_global_accuracy"]
    moment = min(cumulative(report["rounds"])[-1] for report in reports.values())  # equal wall time
    ledgers = {mode: account(runs[mode], report) for mode, report in reports.items()}
    for mode, report in reports.items():
        print(describe(mode, report, target, moment, ledgers[mode]))
    hits = {mode: time_to(reports[mode]["rounds"], target) for mode in runs}
    if hits["sync"] is not None and hits["buffered"] is not None:
        print(f"time to the synchronous final accuracy: buffered {hits['buffered'][1]:.0f} s, synchronous "
              f"{hits['sync'][1]:.0f} s (ratio {hits['buffered'][1] / hits['sync'][1]:.2f})")
    print("\n".join(curves(reports["sync"], reports["buffered"], args.every)))
    return {"target": target, "moment": moment, "hits": hits, "ledgers": ledgers,
            "at": {mode: accuracy_at(report["rounds"], moment) for mode, report in reports.items()},
            "final": {mode: report["summary"]["final_global_accuracy"] for mode, report in reports.items()},
            "wall": {mode: cumulative(report["rounds"])[-1] for mode, report in reports.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory of the runs (seed<N>/sync/, seed<N>/buffered/)")
    parser.add_argument("--read", action="store_true", help="only read the runs in --out")
    parser.add_argument("--algorithm", default="fedepth")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--budgets", default="fair")
    parser.add_argument("--speeds", default="10,4,2,1", help="fedfit sim --speeds ('' for this machine's speed)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one pair of runs each")
    parser.add_argument("--rounds", type=int, default=30, help="the synchronous run's rounds")
    parser.add_argument("--buffered-rounds", type=int, default=None, help="the buffered run's (default: twice)")
    parser.add_argument("--size", type=int, default=0, help="buffered.size (0: half of what may train)")
    parser.add_argument("--max-staleness", type=int, default=16, help="buffered.max_staleness")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between the rows of the curves' table")
    args = parser.parse_args()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    out = Path(args.out)
    rows = []
    for seed in seeds:
        runs = {"sync": args.rounds, "buffered": args.buffered_rounds or 2 * args.rounds}
        seed_dir = out / f"seed{seed}"
        if not args.read:
            seed_dir.mkdir(parents=True, exist_ok=True)
            for mode, rounds in runs.items():
                if (seed_dir / mode / "report.json").exists():
                    print(f"{seed_dir / mode} holds its run already: not run again", flush=True)
                    continue
                command = sim_command(args, mode, rounds, seed, seed_dir / mode)
                print(f"running {mode}: {' '.join(command[1:])}", flush=True)
                with (seed_dir / f"{mode}.log").open("w") as log:
                    done = subprocess.run(command, check=False, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
                if done.returncode:
                    parser.error(f"the {mode} run failed (exit {done.returncode}): see {seed_dir / f'{mode}.log'}")
        print(f"\nseed {seed}")
        figures = compare_seed(seed_dir, args)
        if figures is not None:
            rows.append((seed, figures))
    if rows:
        print("\n| seed | mode | rounds' wall time | final | at equal wall time | to the sync final | acked / "
              "aggregated / untrained / never / twice / refused / left |\n|---|---|---|---|---|---|---|")
        for seed, figures in rows:
            for mode in ("sync", "buffered"):
                at, hit, ledger = figures["at"][mode], figures["hits"][mode], figures["ledgers"][mode]
                print(f"| {seed} | {mode} | {figures['wall'][mode]:.0f} s | {figures['final'][mode]:.4f} | "
                      f"{'-' if at is None else f'{at[0]:.4f} (round {at[1]})'} at {figures['moment']:.0f} s | "
                      f"{'never' if hit is None else f'{hit[1]:.0f} s (round {hit[0]})'} | {ledger['acked']} / "
                      f"{ledger['aggregated']} / {ledger['untrained']} / {ledger['acked_not_aggregated']} / "
                      f"{ledger['aggregated_twice']} / "
                      f"{ledger['refused']} / {ledger['left']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

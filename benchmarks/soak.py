"""An hour of faults: ``faults.py --soak SECONDS`` keeps federations going that long, kills agents, the coordinator and
the broker at random moments, and keeps the ledger of every update (``_ledger``): 0 acknowledged updates lost, 0
counted twice.

The federations are the ones ``faults.setup`` makes (a secured mosquitto, the coordinator and every agent as their
own ``fedfit`` processes, the coordinator with ``resume: true``), small so that many rounds fit: the digits, the
small CNN, ``--agents`` agents (6), one local epoch. One after another, each of ``--rounds`` rounds (40), in
``--round-mode`` (``sync`` or ``buffered``), while a fault may still come within ``--soak`` seconds; the last one
then finishes its rounds with no more faults. Every ``--fault-every`` seconds (20-60, drawn), from the moment a
federation's first round is in flight, one fault drawn from ``--kinds`` (the kinds, gaps and victims seeded by
``--seed``; where in a round each lands is not):

- ``agents``: kill -9 of ``--agent-share`` (30%) of the agents, each restarted ``--restart-after`` (2) s later;
- ``coordinator``: kill -9 of the coordinator, restarted ``--restart-after`` s later (it resumes its journal);
- ``broker``: mosquitto stopped and started again on its port after 1-4 s (its sessions and retained messages
  gone: persistence is off).

As systemd's ``KillMode=control-group`` would, what a killed daemon had started (the training forkserver and its
children) is killed too before the restart: the count of such processes still alive then is kept (``strays``). A
daemon that exits on its own is restarted 5 s later (``Restart=on-failure``, ``RestartSec=5``) and reported. A
federation stops once its coordinator exits 0, after ``--drain`` seconds in which the agents may take their last
acks; a federation with no new round for ``--stall`` seconds is stopped and reported as stuck.

The figures: per fault kind, the faults, the rounds they touched (from the round in flight at the fault to the first
one completed after its restart), and among the tasks planned or aggregated in those rounds: acked, lost, counted
twice, left (in an agent's outbox at the end); then the same over every task of the soak, with the anomalies the
logs and records show. A task touched by faults of two kinds counts under both; the totals count it once.
``--json OUT`` writes them all, with every lost, doubly counted and left update by agent and task.

Run: ``nice .venv/bin/python benchmarks/faults.py --soak 3600 --round-mode buffered --seed 0 --workdir
/tmp/soak-buffered --json /tmp/soak-buffered.json`` (and ``--round-mode sync``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _ledger import Ledger, TaskEntry, figures, read_ledger, read_metrics
from _shared import ROOT
from faults import Run, setup

from fedfit.sim.broker import BrokerStartError

KINDS = ("agents", "coordinator", "broker")
#: What systemd's unit does for a daemon that exits on its own (``Restart=on-failure``, ``RestartSec=5``).
RESTART_SEC = 5.0
#: Exits on its own after which the coordinator of a federation is not restarted again.
MAX_COORDINATOR_EXITS = 5
#: Seconds what a daemon started may take to end after the daemon's own clean stop (then it is a stray).
STOP_GRACE_S = 10.0


@dataclass
class Injected:
    """One fault: its kind, when it struck and when its daemon was back (seconds since the soak started), what it
    did, the round in flight then, and the rounds it touched."""

    kind: str
    federation: int
    at: float
    back: float
    detail: str
    in_flight: int | None
    strays: int = 0
    rounds: tuple[int, int] | None = None


@dataclass
class Federation:
    """One federation of the soak: its processes and files, when each round appeared in its metrics, and what went
    wrong on its own."""

    index: int
    run: Run
    rounds: int
    done_at: dict[int, float] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    coordinator_exits: int = 0
    strays_at_stop: list[str] = field(default_factory=list)  # still running after their daemon's clean stop
    outcome: str = "running"
    ledger: Ledger | None = None

    def poll_rounds(self, now: float) -> None:
        rows, _ = read_metrics(self.run.state_dir / "metrics.jsonl")
        for row in rows:
            self.done_at.setdefault(row["round"], now)

    def complete(self) -> bool:
        return all(number in self.done_at for number in range(1, self.rounds + 1))

    def started(self) -> bool:
        return bool(self.done_at) or self.run.round_in_flight() is not None

    def touched(self, at: float, recovered: float) -> tuple[int, int]:
        """The rounds a fault at ``at`` whose daemon was back at ``recovered`` touched: from the first round not
        done at ``at`` to the first one done after ``recovered`` (the last round there is when none is)."""
        last_known = max([*self.done_at, 0])
        first = min([number for number, done in self.done_at.items() if done > at], default=last_known + 1)
        last = min([number for number, done in self.done_at.items() if done > recovered], default=last_known)
        return min(first, self.rounds), min(max(first, last), self.rounds)


def descendants(process: subprocess.Popen[bytes] | None) -> list[psutil.Process]:
    """What ``process`` started and is still running (its training forkserver and children, for an agent)."""
    if process is None or process.poll() is not None:
        return []
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_strays(children: list[psutil.Process], grace: float = 0.0) -> list[str]:
    """kill -9 of those of ``children`` still running after ``grace`` seconds, as systemd does to a unit's cgroup
    before it restarts it; what they were (their command lines, cut short)."""
    _, alive = psutil.wait_procs(children, timeout=grace) if grace else ([], children)
    strays = []
    for child in alive:
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                what = " ".join(child.cmdline())[:100]
                child.kill()
                strays.append(what)
        except psutil.Error:
            continue
    return strays


def kill_hard(process: subprocess.Popen[bytes] | None) -> list[psutil.Process]:
    """kill -9 of a daemon; what it had started (for :func:`kill_strays`)."""
    children = descendants(process)
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    return children


class Soak:
    """The federations one after another, the faults, and the figures (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = workdir
        self.started = time.time()
        self.end = time.monotonic() + args.soak
        self.kinds = [kind.strip() for kind in args.kinds.split(",")]
        if not set(self.kinds) <= set(KINDS) or not self.kinds:
            raise ValueError(f"--kinds takes some of {', '.join(KINDS)}, got {args.kinds!r}")
        self.low, self.high = (float(value) for value in args.fault_every.split(","))
        self.next_fault = time.monotonic() + self.rng.uniform(self.low, self.high)
        self.federations: list[Federation] = []
        self.faults: list[Injected] = []

    def since(self) -> float:
        return time.time() - self.started

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        """Federations one after another while a fault may still come (the last one ends with no more faults)."""
        while not self.federations or time.monotonic() < self.end - self.low:
            self.federation(len(self.federations))

    def federation(self, index: int) -> None:
        args = self.args
        directory = self.workdir / f"fed-{index:02d}"
        directory.mkdir(parents=True, exist_ok=True)
        overrides = {"round_mode": args.round_mode, "recipe": {"epochs": args.epochs, "batch_size": 16, "lr": 0.05},
                     "round_timeout_s": args.round_timeout}
        run = setup(directory, f"soak-{index:02d}", args.agents, args.rounds, args.algorithm, args.seed + index,
                    overrides)
        fed = Federation(index, run, args.rounds)
        self.federations.append(fed)
        print(f"[{self.since():6.0f} s] federation {index}: {args.rounds} rounds, {args.round_mode}, in {directory}",
              flush=True)
        try:
            run.start_coordinator()
            for name in run.agents:
                run.start_agent(name)
            self.watch(fed)
            self.drain(fed)
        finally:
            children = [child for process in [run.coordinator, *run.agent_processes.values()]
                        for child in descendants(process)]
            run.stop()
            fed.strays_at_stop = kill_strays(children, grace=STOP_GRACE_S)
            run.broker.stop()
            fed.ledger = read_ledger(directory, run.agents, args.rounds)
        counts = figures(fed.ledger.tasks.values())
        print(f"[{self.since():6.0f} s] federation {index} {fed.outcome}: rounds recorded {len(fed.ledger.rounds)} of "
              f"{args.rounds}, acked {counts['acked']}, lost {counts['lost']}, counted twice "
              f"{counts['counted_twice']}, left {counts['left']}", flush=True)

    def watch(self, fed: Federation) -> None:
        """Until the coordinator ends the federation: rounds noted, daemons that exit on their own restarted,
        faults injected when due."""
        run, last_round, progress = fed.run, 0, time.monotonic()
        while True:
            now = time.monotonic()
            fed.poll_rounds(time.time())
            if len(fed.done_at) > last_round:
                last_round, progress = len(fed.done_at), now
            assert run.coordinator is not None
            code = run.coordinator.poll()
            if code == 0:  # the federation is over (systemd's Restart=on-failure would not restart it either)
                fed.poll_rounds(time.time())  # (its last round may have come since)
                fed.outcome = "completed" if fed.complete() else "ended with rounds missing from metrics.jsonl"
                return
            if code is not None:
                fed.coordinator_exits += 1
                fed.anomalies.append(f"{self.since():.0f} s: the coordinator exited {code} on its own: "
                                     + tail(run.workdir / "coordinator.log"))
                if fed.coordinator_exits >= MAX_COORDINATOR_EXITS:
                    fed.outcome = f"given up after {fed.coordinator_exits} exits of the coordinator"
                    return
                time.sleep(RESTART_SEC)
                run.start_coordinator()
            for name, process in list(run.agent_processes.items()):
                if process.poll() is not None:
                    fed.anomalies.append(f"{self.since():.0f} s: agent {name} exited {process.returncode} on its "
                                         f"own: " + tail(run.workdir / f"{name}.log"))
                    time.sleep(RESTART_SEC)
                    run.start_agent(name)
            if now - progress > self.args.stall:
                fed.outcome = f"stuck: no round for {self.args.stall:.0f} s after round {last_round}"
                fed.anomalies.append(f"{self.since():.0f} s: {fed.outcome}")
                return
            if now >= self.next_fault:
                if now < self.end and fed.started():
                    self.inject(fed)
                    self.next_fault = time.monotonic() + self.rng.uniform(self.low, self.high)
                else:
                    self.next_fault = now + 5.0
            time.sleep(0.5)

    def inject(self, fed: Federation) -> None:
        run, at, kind = fed.run, time.time(), self.rng.choice(self.kinds)
        assert run.coordinator is not None
        if run.coordinator.poll() is not None:
            return  # the federation just ended: the next one takes the fault
        in_flight = run.round_in_flight()
        strays = 0
        if kind == "agents":
            victims = sorted(self.rng.sample(run.agents, max(1, round(self.args.agent_share * len(run.agents)))))
            children = [child for name in victims for child in kill_hard(run.agent_processes[name])]
            time.sleep(self.args.restart_after)
            strays = len(kill_strays(children))
            for name in victims:
                run.start_agent(name)
            detail = f"kill -9 of {', '.join(victims)}"
        elif kind == "coordinator":
            children = kill_hard(run.coordinator)
            time.sleep(self.args.restart_after)
            strays = len(kill_strays(children))
            run.start_coordinator()
            detail = "kill -9 of the coordinator"
        else:
            down = self.rng.uniform(1.0, 4.0)
            try:
                run.broker.restart(down)
                detail = f"broker down {down:.1f} s"
            except BrokerStartError as exc:
                fed.anomalies.append(f"{self.since():.0f} s: the broker did not start again: {exc}")
                time.sleep(RESTART_SEC)
                run.broker.restart(0.0)
                detail = f"broker down {down:.1f} s, started at the second try"
        fault = Injected(kind, fed.index, round(at - self.started, 1), round(self.since(), 1), detail, in_flight,
                         strays)
        self.faults.append(fault)
        print(f"[{fault.at:6.0f} s] federation {fed.index}, round {in_flight or '-'}: {detail}"
              + (f" ({strays} of its processes killed after it)" if strays else ""), flush=True)

    def drain(self, fed: Federation) -> None:
        """Let the agents take their last acks (their outboxes empty) for at most ``--drain`` seconds."""
        deadline = time.monotonic() + self.args.drain
        while time.monotonic() < deadline and next((fed.run.workdir / "agents").rglob("outbox/*.update"), None):
            time.sleep(0.5)

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict[str, Any]:
        every: list[TaskEntry] = []
        by_kind: dict[str, dict[str, Any]] = {kind: {"count": 0, "rounds_touched": 0, "tasks": {}} for kind in KINDS}
        for fed in self.federations:
            if fed.ledger is None:
                continue
            every += fed.ledger.tasks.values()
            touched: dict[str, set[int]] = {kind: set() for kind in KINDS}
            for fault in (fault for fault in self.faults if fault.federation == fed.index):
                fault.rounds = fed.touched(self.started + fault.at, self.started + fault.back)
                touched[fault.kind].update(range(fault.rounds[0], fault.rounds[1] + 1))
                by_kind[fault.kind]["count"] += 1
            for kind, rounds in touched.items():
                by_kind[kind]["rounds_touched"] += len(rounds)
                by_kind[kind]["tasks"].update({(fed.index, e.task): e for e in fed.ledger.of_rounds(rounds)})
        table = {kind: {"count": row["count"], "rounds_touched": row["rounds_touched"],
                        **figures(row["tasks"].values())} for kind, row in by_kind.items()}
        ledgers = [(fed, fed.ledger) for fed in self.federations if fed.ledger is not None]

        def listed(which: str) -> list[dict[str, Any]]:
            return [{"federation": fed.index, **entry.row()} for fed, ledger in ledgers
                    for entry in sorted(ledger.tasks.values(), key=lambda e: (e.round, e.agent))
                    if getattr(entry, which)]

        staleness: Counter[int] = Counter()
        for _, ledger in ledgers:
            staleness.update(ledger.staleness())
        totals = {"faults": len(self.faults), "rounds": sum(len(set(ledger.rounds)) for _, ledger in ledgers),
                  **figures(every),
                  "rounds_recorded_twice": sum(len(ledger.rounds_twice) for _, ledger in ledgers),
                  "rounds_missing": sum(len(ledger.rounds_missing) for _, ledger in ledgers),
                  "strays_killed": sum(fault.strays for fault in self.faults),
                  "strays_at_stop": sum(len(fed.strays_at_stop) for fed in self.federations)}
        return {
            "command": self.args.command, "commit": commit(), "round_mode": self.args.round_mode,
            "seed": self.args.seed, "soak_s": self.args.soak, "wall_s": round(self.since(), 1),
            "by_kind": table, "totals": totals,
            "aggregated_by_rounds_late": {str(late): count for late, count in sorted(staleness.items())},
            "federations": [{
                "index": fed.index, "workdir": str(fed.run.workdir), "outcome": fed.outcome,
                "rounds_recorded": len(ledger.rounds), "rounds_twice": ledger.rounds_twice,
                "rounds_missing": ledger.rounds_missing, "unreadable_metrics_lines": ledger.unreadable_lines,
                "participants_off": ledger.participants_off, "unmatched_records": ledger.unmatched,
                "final_accuracy": ledger.rows[-1]["global_accuracy"] if ledger.rows else None,
                "trouble_in_logs": dict(ledger.trouble), "anomalies": fed.anomalies,
                "strays_at_stop": fed.strays_at_stop} for fed, ledger in ledgers],
            "faults": [asdict(fault) for fault in self.faults],
            "lost": listed("lost"), "counted_twice": listed("twice"), "left": listed("left"),
            "left_by_agent": left_by_agent(listed("left")),
        }


def left_by_agent(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The tasks whose updates were left in outboxes, by federation and agent."""
    found: dict[str, list[str]] = {}
    for row in rows:
        found.setdefault(f"fed-{row['federation']:02d} {row['agent']}", []).append(row["task"])
    return found


def tail(log: Path, size: int = 600) -> str:
    """The end of a daemon's log, for a report."""
    try:
        return log.read_text(errors="replace")[-size:].replace("\n", " | ")
    except OSError:
        return "(no log)"


def commit() -> str:
    """The commit measured, with '+' when the tree has changes."""
    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def report(result: dict[str, Any]) -> list[str]:
    """The printout: a row per fault kind and the totals, then what is lost, counted twice, left, and anomalies."""
    columns = ("count", "rounds_touched", "acked", "lost", "counted_twice", "left")
    lines = [(f"soak of {result['soak_s']:.0f} s ({result['wall_s']:.0f} s with the last federation's end), "
              f"{result['round_mode']} rounds, seed {result['seed']}, commit {result['commit']}"),
             f"{'fault':<14}" + "".join(f"{name.replace('_', ' '):>16}" for name in columns)]
    for kind, row in result["by_kind"].items():
        lines.append(f"{kind:<14}" + "".join(f"{row[name]:>16}" for name in columns))
    totals = result["totals"]
    lines.append(f"{'all tasks':<14}" + "".join(f"{value:>16}" for value in (
        totals["faults"], totals["rounds"], totals["acked"], totals["lost"], totals["counted_twice"],
        totals["left"])))
    lines.append(f"tasks {totals['tasks']}: aggregated {totals['aggregated']} (by rounds late: "
                 f"{result['aggregated_by_rounds_late']}), lost where a round is missing from metrics.jsonl "
                 f"{totals['lost_where_a_round_is_unrecorded']}, rejected {totals['rejected']}, refused before an ack "
                 f"{totals['refused']}; left: {totals['left_acked']} of them acked too, {totals['left_carried_at_end']}"
                 f" carried out of a federation's last round; rounds recorded twice {totals['rounds_recorded_twice']}, "
                 f"missing {totals['rounds_missing']}; processes killed after their daemon {totals['strays_killed']} "
                 f"(and {totals['strays_at_stop']} still running {STOP_GRACE_S:.0f} s after a clean stop)")
    for fed in result["federations"]:
        lines.append(f"federation {fed['index']}: {fed['outcome']}, {fed['rounds_recorded']} rounds, final accuracy "
                     f"{fed['final_accuracy']}" + "".join(
                         f"; {name.replace('_', ' ')} {fed[name]}" for name in (
                             "rounds_twice", "rounds_missing", "unreadable_metrics_lines", "participants_off",
                             "unmatched_records", "trouble_in_logs") if fed[name]))
        lines += [f"  anomaly: {anomaly}" for anomaly in fed["anomalies"]]
    for which in ("lost", "counted_twice", "left"):
        if result[which]:
            lines.append(f"{which.replace('_', ' ')}:")
            lines += [f"  federation {row['federation']} {row['agent']} {row['task']} (round {row['round']}, "
                      f"{row['status']}, aggregated in {row['aggregated_in'] or 'none'}): {row['note']}"
                      for row in result[which]]
    return lines


def soak(args: argparse.Namespace, workdir: Path) -> int:
    """Run the soak ``args`` describe (``faults.py``'s flags) in ``workdir``, print its figures, write them to
    ``--json``; 1 when an acknowledged update was lost or counted twice."""
    runner = Soak(args, workdir)
    try:
        runner.run()
    finally:
        result = runner.figures()
        print("\n".join(report(result)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            print(f"figures written to {args.json}")
    return 0 if result["totals"]["lost"] == 0 and result["totals"]["counted_twice"] == 0 else 1

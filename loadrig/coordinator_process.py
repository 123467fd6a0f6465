"""The coordinator of a load run, in a process of its own (so that its memory and CPU are its own).

``python -m loadrig.coordinator_process --config FILE --events FILE [--log-file FILE] [--profile]`` runs the
coordinator daemon as ``fedfit coordinator --config FILE`` does, and writes to ``--events`` (JSON) what the load
run reads of it: when the fleet was online, each round's dispatch, its last update and its end (wall-clock times),
the process's RSS at each of those moments and its peak (``ru_maxrss``), its CPU seconds and, with ``--profile``,
where every thread spent its time during the rounds (:class:`loadrig.sampler.StackSampler`). A line per
finished round goes to standard output, after a line ``connected`` once it is subscribed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from common.config import from_mapping, load_yaml
from common.logs import configure_logging
from coordinator.config import CoordinatorConfig
from coordinator.daemon import Coordinator, Progress
from coordinator.metrics import RoundResult
from coordinator.strategies import check_algorithm
from loadrig.sampler import StackSampler

__all__ = ["main"]


class _Recorder:
    """Collects the moments the load run reads (called from the coordinator's threads: never blocks for long)."""

    def __init__(self, sampler: StackSampler | None) -> None:
        self.events: list[dict[str, Any]] = []
        self._process = psutil.Process()
        self._sampler = sampler
        self._lock = threading.Lock()
        self._fleet_online = False
        self._dispatched: set[int] = set()
        self._all_in: set[int] = set()

    def mark(self, event: str, **fields: Any) -> None:
        entry = {"event": event, "t": time.time(), "rss": self._process.memory_info().rss, **fields}
        with self._lock:
            self.events.append(entry)

    def on_progress(self, progress: Progress) -> None:
        if progress.phase == "fleet":
            if progress.done >= progress.expected and not self._fleet_online:
                self._fleet_online = True
                self.mark("fleet_online", agents=progress.done)
                if self._sampler is not None:
                    self._sampler.start()
            return
        # The round's own thread reports once its tasks are dispatched; updates are reported from the handler's.
        if threading.current_thread() is threading.main_thread() and progress.round not in self._dispatched:
            self._dispatched.add(progress.round)
            self.mark("dispatched", round=progress.round, tasks=progress.expected)
        if progress.expected and progress.done >= progress.expected and progress.round not in self._all_in:
            self._all_in.add(progress.round)
            self.mark("updates_in", round=progress.round, updates=progress.done)

    def on_round(self, result: RoundResult) -> None:
        timing = getattr(result, "timing", None)
        self.mark("round_done", round=result.round, seconds=result.seconds, participants=result.participants,
                  **({"timing": timing} if timing else {}))
        print(f"round {result.round} done in {result.seconds:.1f} s: {result.participants} of {result.selected} "
              f"updates aggregated", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the coordinator of a load run (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m loadrig.coordinator_process")
    parser.add_argument("--config", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--log-file", default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-interval", type=float, default=0.01)
    args = parser.parse_args(argv)
    log = open(args.log_file, "a", encoding="utf-8") if args.log_file else None  # noqa: SIM115 - the run's
    configure_logging("info", log)
    config = from_mapping(CoordinatorConfig, load_yaml(args.config))
    config.validate()
    check_algorithm(config.algorithm)
    sampler = StackSampler(args.profile_interval) if args.profile else None
    recorder = _Recorder(sampler)
    recorder.mark("started")
    coordinator = Coordinator(config, on_round=recorder.on_round, on_progress=recorder.on_progress)
    recorder.mark("ready")
    coordinator.start()
    recorder.mark("connected")
    print("connected", flush=True)  # the load run starts its agents now: their first statuses find it subscribed
    error = None
    try:
        coordinator.run()
    except Exception as exc:  # noqa: BLE001 - reported to the load run, which says it
        error = f"{type(exc).__name__}: {exc}"
        print(f"coordinator failed: {error}", flush=True)
    finally:
        coordinator.stop()
        if sampler is not None:
            sampler.stop()
    recorder.mark("finished")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(args.events).write_text(json.dumps({
        "events": recorder.events,
        "peak_rss": usage.ru_maxrss * 1024,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "error": error,
        "profile": sampler.summary() if sampler is not None else None,
        "uploads": None if coordinator.grants is None else {
            "window_bytes": coordinator.grants.window_bytes, "granted": coordinator.grants.granted_total,
            "expired": coordinator.grants.expired_total, "dropped": coordinator.grants.dropped_total,
            "peak_in_flight": coordinator.grants.peak_in_flight},
    }))
    if log is not None:
        log.close()
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a simulation shows while it runs: the fleet coming online, each round's updates as they arrive with the
time elapsed, one line per finished round, and from the second round an estimate of the time left."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import IO

from coordinator.daemon import Progress
from coordinator.metrics import RoundResult
from fedfit.sim.report import agents_cell

#: Seconds between two progress lines when the stream is not a terminal (a log file, CI).
LINE_INTERVAL_S = 10.0


def duration_text(seconds: float) -> str:
    """``42 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class ProgressPrinter:
    """Prints a run's progress to ``stream``: on a terminal one line rewritten in place, elsewhere a line at most
    every :data:`LINE_INTERVAL_S` seconds; a line per finished round either way (:meth:`on_round`)."""

    def __init__(self, stream: IO[str], rounds: int, label: str = "", *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.rounds = rounds
        self.label = f"{label}: " if label else ""
        self.clock = clock
        self.started = clock()
        self.round_started: float | None = None
        self.durations: list[float] = []
        self._live = bool(getattr(stream, "isatty", lambda: False)())
        self._last_line = -LINE_INTERVAL_S
        self._pending = ""
        self._lock = threading.Lock()

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left, from the mean duration of the rounds done (None before one is done)."""
        if not self.durations:
            return None
        now = self.clock() if now is None else now
        in_round = now - self.round_started if self.round_started is not None else 0.0
        mean = sum(self.durations) / len(self.durations)
        left = self.rounds - len(self.durations)
        return max(0.0, left * mean - in_round)

    def __call__(self, event: Progress) -> None:
        now = self.clock()
        if event.phase == "fleet":
            text = f"{self.label}fleet online {event.done}/{event.expected}"
            if event.done >= event.expected and self.round_started is None:
                self.round_started = now  # the first round (its planning and dispatch too) starts here
        else:
            if self.round_started is None:
                self.round_started = now
            text = (f"{self.label}round {event.round}/{self.rounds}: {event.done}/{event.expected} updates, "
                    f"{duration_text(now - self.round_started)} elapsed")
            eta = self.eta(now)
            if eta is not None:
                text += f", about {duration_text(eta)} left"
        # Always said: the whole fleet online, and a round's start.
        self._show(text, now, final=event.done >= event.expected if event.phase == "fleet" else event.done == 0)

    def on_round(self, result: RoundResult) -> None:
        """A line for a finished round: global accuracy, each level (``*``: no device trained it this round),
        exits, participation and time."""
        now = self.clock()
        self.durations.append(now - (self.round_started if self.round_started is not None else self.started))
        self.round_started = now  # the next round's planning starts now
        levels = " ".join(f"{name}={acc:.3f}" + ("" if name in result.trained_levels else "*")
                          for name, acc in sorted(result.level_accuracy.items()))
        exits = " ".join(f"{name}={acc:.3f}" + ("" if name in result.trained_exits else "*")
                         for name, acc in result.exit_accuracy.items())
        model = "" if result.deployed == "global" else f" ({result.deployed})"
        text = (f"{self.label}round {result.round}/{self.rounds}: global {result.headline:.4f}{model} [{levels}] "
                + (f"exits [{exits}] " if exits else "")
                + f"agents {agents_cell(vars(result))} {result.seconds:.1f}s"
                + (f", epsilon {result.privacy['epsilon']:.3g}" if result.privacy else ""))
        eta = self.eta(now)
        if eta is not None and len(self.durations) < self.rounds:
            text += f", about {duration_text(eta)} left"
        self._show(text, now, final=True, keep=True)

    def _show(self, text: str, now: float, *, final: bool = False, keep: bool = False) -> None:
        with self._lock:
            if self._live:
                self.stream.write("\r\x1b[2K" + text + ("\n" if keep else ""))
            elif keep or final or now - self._last_line >= LINE_INTERVAL_S:
                self.stream.write(text + "\n")
                self._last_line = now
            self.stream.flush()

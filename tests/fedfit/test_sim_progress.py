"""The live display of a simulation: fleet, updates with elapsed time, an estimate of the time left from the
second round, one line per round (levels nobody trained marked)."""

from __future__ import annotations

import io

from coordinator.daemon import Progress
from coordinator.metrics import RoundResult
from fedfit.sim.progress import LINE_INTERVAL_S, ProgressPrinter, duration_text


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def result(number: int) -> RoundResult:
    return RoundResult(round=number, global_accuracy=0.5, level_accuracy={"a": 0.5, "b": 0.4}, participants=2,
                       selected=2, bytes_down=1, bytes_up=1, seconds=10.0, trained_levels=["a"])


def test_durations() -> None:
    assert [duration_text(s) for s in (0, 42.4, 185, 3725)] == ["0 s", "42 s", "3 min 05 s", "1 h 02 min"]


def test_a_log_gets_a_line_at_most_every_interval_and_one_per_round() -> None:
    clock, stream = Clock(), io.StringIO()
    printer = ProgressPrinter(stream, rounds=3, label="heterofl", clock=clock)
    printer(Progress("fleet", 1, 1, 2))
    printer(Progress("fleet", 1, 2, 2))  # the whole fleet: always said; the first round's planning starts
    clock.now = 1.0
    printer(Progress("round", 1, 0, 2))  # the round's tasks sent: always said
    clock.now = 2.0
    printer(Progress("round", 1, 1, 2))  # within the interval of the last line: not printed
    clock.now = 3.0 + LINE_INTERVAL_S
    printer(Progress("round", 1, 2, 2))
    clock.now = 21.0
    printer.on_round(result(1))
    lines = stream.getvalue().splitlines()
    assert lines == ["heterofl: fleet online 1/2", "heterofl: fleet online 2/2",
                     "heterofl: round 1/3: 0/2 updates, 1 s elapsed",
                     "heterofl: round 1/3: 2/2 updates, 13 s elapsed",
                     "heterofl: round 1/3: global 0.5000 [a=0.500 b=0.400*] agents 2/2 10.0s, about 42 s left"]


def test_the_estimate_of_time_left_comes_from_the_rounds_done() -> None:
    clock, stream = Clock(), io.StringIO()
    printer = ProgressPrinter(stream, rounds=4, clock=clock)
    printer(Progress("round", 1, 0, 1))
    assert printer.eta() is None  # no round done yet
    clock.now = 10.0
    printer.on_round(result(1))
    clock.now = 12.0  # the second round started when the first ended: its planning counts
    printer(Progress("round", 2, 0, 1))
    assert stream.getvalue().splitlines()[-1] == "round 2/4: 0/1 updates, 2 s elapsed, about 28 s left"
    clock.now = 15.0
    assert printer.eta() == 3 * 10.0 - 5.0


def test_a_terminal_line_is_rewritten_in_place() -> None:
    stream = Terminal()
    printer = ProgressPrinter(stream, rounds=1, clock=Clock())
    printer(Progress("fleet", 1, 1, 3))
    printer(Progress("fleet", 1, 2, 3))
    printer.on_round(result(1))
    text = stream.getvalue()
    assert text.count("\r\x1b[2K") == 3 and text.endswith("10.0s\n") and "fleet online 2/3" in text

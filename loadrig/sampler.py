"""A sampling profiler of every Python thread of this process (py-spy is not at hand): where a daemon's time goes.

Every ``interval`` seconds it reads each thread's stack (``sys._current_frames``) and counts, per thread, the
innermost frame ("self") and every frame on the stack once ("inclusive"). A sample whose innermost line waits
(``select(``, ``.wait(``, ``acquire(``, ``sleep(``, ``.get(``) is counted as waiting, not as work; one entering a
``with lock:`` block (``threading``'s ``__enter__``) as waiting for that lock, by the function that takes it. The
sampler
needs the interpreter lock to look, so a thread that holds it through a long C call (a large ``msgpack``
unpack, a copy) is seen at the line of that call once it lets go: counts are a fair picture of where a thread
spends its time, not exact.
"""

from __future__ import annotations

import linecache
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

__all__ = ["StackSampler"]

_WAITING = ("select(", ".wait(", "acquire(", "sleep(", ".get(", "recv(", "poll(")
_ROOT = Path(__file__).resolve().parents[1]


_LABELS: dict[CodeType, str] = {}


def _where(frame: FrameType) -> str:
    """``package/module.py:function`` of a frame: its path from the repository or site-packages on."""
    code = frame.f_code
    label = _LABELS.get(code)
    if label is None:
        path = Path(code.co_filename)
        if path.is_relative_to(_ROOT) and ".venv" not in path.parts:
            parts = path.relative_to(_ROOT).parts
        elif "site-packages" in path.parts:
            parts = path.parts[path.parts.index("site-packages") + 1:]
        else:
            parts = path.parts[-2:]
        label = _LABELS[code] = f"{'/'.join(parts)}:{code.co_name}"
    return label


def _waiting(frame: FrameType) -> bool:
    if frame.f_lineno is None:  # (a frame between instructions has none)
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return any(marker in line for marker in _WAITING)


class StackSampler:
    """Samples all threads but its own every ``interval`` seconds between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval: float = 0.01, depth: int = 60) -> None:
        self.interval = interval
        self.depth = depth
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._self: dict[str, Counter[str]] = {}
        self._locks: dict[str, Counter[str]] = {}
        self._inclusive: dict[str, Counter[str]] = {}
        self.seconds = 0.0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        started = time.monotonic()
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            try:
                self._sample(own)
            except Exception:  # noqa: BLE001, S112 - a profiler must never end the process it watches
                continue
        self.seconds = time.monotonic() - started

    def _sample(self, own: int) -> None:
        """One look at every thread but ``own``."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == own:
                continue
            name = self._thread_kind(names.get(ident, str(ident)))
            self._samples[name] += 1
            if frame.f_code.co_name == "__enter__" and frame.f_code.co_filename.endswith("threading.py"):
                self._waiting[name] += 1
                taker = frame.f_back
                self._locks.setdefault(name, Counter())[_where(taker) if taker is not None else "?"] += 1
                continue
            if _waiting(frame):
                self._waiting[name] += 1
                continue
            self._self.setdefault(name, Counter())[_where(frame)] += 1
            seen: set[str] = set()
            walker: FrameType | None = frame
            for _ in range(self.depth):
                if walker is None:
                    break
                seen.add(_where(walker))
                walker = walker.f_back
            self._inclusive.setdefault(name, Counter()).update(seen)

    @staticmethod
    def _thread_kind(name: str) -> str:
        """Threads of one kind under one name (paho's network thread is named after its client)."""
        if name.startswith("paho-mqtt-client-"):
            return "paho network thread"
        if name.endswith("-dispatch"):
            return "mqtt dispatcher (message handler)"
        if name == "MainThread":
            return "main (round loop)"
        return name

    def summary(self, top: int = 40) -> dict[str, Any]:
        """Per thread: samples, how many found it busy, its ``top`` busiest frames (self and inclusive) and the
        functions it waited in for a lock (``lock_waits``)."""
        threads = {}
        for name, count in self._samples.most_common():
            busy = count - self._waiting[name]
            threads[name] = {
                "samples": count,
                "busy": busy,
                "self": self._self.get(name, Counter()).most_common(top),
                "inclusive": self._inclusive.get(name, Counter()).most_common(top),
                "lock_waits": self._locks.get(name, Counter()).most_common(top),
            }
        return {"interval_s": self.interval, "seconds": round(self.seconds, 3), "threads": threads}

"""Updates held back before they are sent: the agent's ``slowdown`` (simulated or test fleets).

A device ``f`` times slower than this machine would finish a task ``(f - 1) x`` the seconds it took here later.
The agent trains at this machine's speed, then holds the finished update back that long before it hands it to the
uplink. The wait is on a thread of its own, never in the training executor: a simulated fleet's agents share a few
training slots (``fedfit sim``), and a slow device does not stop the others training. :meth:`HoldBack.close` (the
agent's stop) cancels every wait at once; what was held stays where the caller put it (the uplink's spool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def hold_seconds(slowdown: float, training_seconds: float) -> float:
    """How long an update is held back: ``(slowdown - 1) x training_seconds`` (0 at slowdown 1, or without
    training)."""
    return max(0.0, (slowdown - 1.0) * max(0.0, training_seconds))


class HoldBack:
    """Calls held back until their time, each on a thread of its own, by key (an update's task id)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._held: dict[str, threading.Event] = {}  # key -> set to cancel its wait
        self._due: dict[str, float] = {}  # key -> when its call is due (monotonic)
        self._lock = threading.Lock()
        self._closed = False

    def hold(self, key: str, seconds: float, release: Callable[[], object]) -> bool:
        """Call ``release()`` once at least ``seconds`` have passed (measured on the monotonic clock), unless
        :meth:`close` comes first; False (nothing held, nothing called) once closed or while ``key`` is held."""
        cancelled = threading.Event()
        with self._lock:
            if self._closed or key in self._held:
                return False
            self._held[key] = cancelled
            due = self._due[key] = time.monotonic() + seconds
        threading.Thread(target=self._wait, args=(key, due, cancelled, release), name=f"{self._name}-holdback",
                         daemon=True).start()
        return True

    def _wait(self, key: str, due: float, cancelled: threading.Event, release: Callable[[], object]) -> None:
        while (left := due - time.monotonic()) > 0:
            if cancelled.wait(left):
                return
        with self._lock:
            if self._held.get(key) is not cancelled:  # closed meanwhile
                return
            del self._held[key]
            self._due.pop(key, None)
        release()

    def busy_for(self) -> float:
        """Seconds until the last call held back now is due (0 when none is): how long the device is still busy."""
        with self._lock:
            return max((due - time.monotonic() for due in self._due.values()), default=0.0)

    def held(self) -> list[str]:
        """The keys held back now."""
        with self._lock:
            return list(self._held)

    def close(self) -> list[str]:
        """Cancel every wait (none of their calls is made) and refuse new ones; returns the keys that were held."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, {}
            self._due.clear()
        for cancelled in held.values():
            cancelled.set()
        return list(held)

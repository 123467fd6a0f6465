"""common.heap: a daemon's heap gives large blocks back when they are freed."""

from __future__ import annotations

from common import heap


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return self.answer


def test_the_mmap_threshold_is_fixed_and_the_trim_threshold_set(monkeypatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(heap, "glibc", lambda: libc)
    assert heap.return_large_blocks(1 << 18)
    assert libc.calls == [(heap.M_MMAP_THRESHOLD, 1 << 18), (heap.M_TRIM_THRESHOLD, 1 << 20)]


def test_without_glibc_or_when_refused_it_says_so(monkeypatch) -> None:
    monkeypatch.setattr(heap, "glibc", lambda: None)
    assert heap.return_large_blocks() is False
    refusing = FakeLibc(answer=0)
    monkeypatch.setattr(heap, "glibc", lambda: refusing)
    assert heap.return_large_blocks() is False and len(refusing.calls) == 1


"""A process's memory mappings as the kernel counts them (``/proc/PID/smaps``), and giving back the pages of
read-only file mappings that a process only read once (Linux).

The training forkserver reads torch's and its libraries' code and constants while it imports and warms up:
hundreds of MB of file pages that stay in its RSS although it runs none of that code while it waits, and that a
child it forks does not inherit (``fork`` copies the page tables of mappings with private pages only; a child
maps the file pages it runs itself, from the page cache). :func:`release_file_pages` unmaps those pages from
the process (``madvise(MADV_DONTNEED)``); the page cache keeps them, and a read maps them again, unchanged.
Only read-only private mappings without a private (copied-on-write) page qualify, so nothing written is lost:
a relocated segment made read-only afterwards (RELRO) has private pages and is left alone. Call it where no
other thread maps or unmaps meanwhile (the forkserver runs one thread). Imports nothing outside the standard
library.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["MADV_DONTNEED", "Mapping", "read", "release_file_pages"]

#: ``madvise`` advice that unmaps a range's pages (the same number on every Linux architecture FedFit runs on).
MADV_DONTNEED = 4
_FIELDS = {"Rss": "rss", "Pss": "pss", "Anonymous": "anonymous", "Locked": "locked"}
_HEX = frozenset("0123456789abcdef")


@dataclass
class Mapping:
    """One mapping: its address range, permissions (``r-xp``), path (``""`` when anonymous, ``[heap]`` and the
    like for the kernel's named areas) and its pages in bytes: resident, proportional (each shared page divided
    among the processes mapping it), anonymous (pages that exist only in memory: an anonymous mapping's, or a
    file mapping's copied on write) and locked."""

    start: int
    end: int
    perms: str
    path: str
    rss: int = 0
    pss: int = 0
    anonymous: int = 0
    locked: int = 0

    @property
    def file_backed(self) -> bool:
        """Whether a file backs it (its path is one)."""
        return self.path.startswith("/")

    @property
    def releasable(self) -> bool:
        """Whether :func:`release_file_pages` gives its pages back: a read-only private file mapping with resident
        pages, none of them private, none locked."""
        return (self.file_backed and self.perms[1] == "-" and self.perms[3] == "p" and self.rss > 0
                and self.anonymous == 0 and self.locked == 0)


def read(pid: int | str = "self") -> list[Mapping]:
    """The mappings of process ``pid`` (this one by default), in address order."""
    mappings: list[Mapping] = []
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            if line[0] in _HEX:
                fields = line.split(maxsplit=5)
                start, _, end = fields[0].partition("-")
                path = fields[5].rstrip("\n") if len(fields) > 5 else ""
                mappings.append(Mapping(int(start, 16), int(end, 16), fields[1], path))
            else:
                name, _, rest = line.partition(":")
                attribute = _FIELDS.get(name)
                if attribute is not None and mappings:
                    setattr(mappings[-1], attribute, int(rest.split()[0]) * 1024)
    return mappings


def release_file_pages(select: str = "") -> int:
    """Unmap the resident pages of this process's releasable mappings (:attr:`Mapping.releasable`) whose path
    contains ``select`` (every one by default); returns the bytes they held. Without ``/proc/self/smaps`` (not
    Linux) nothing is done; a range the kernel refuses is left as it is."""
    try:
        listed = read()
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    released = 0
    for mapping in listed:
        if (mapping.releasable and select in mapping.path
                and madvise(mapping.start, mapping.end - mapping.start, MADV_DONTNEED) == 0):
            released += mapping.rss
    return released

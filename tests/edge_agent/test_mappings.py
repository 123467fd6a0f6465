"""A process's mappings as smaps counts them, and giving back the pages of read-only file mappings without
losing a byte of anything written."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from edge_agent import mappings
from edge_agent.mappings import Mapping

PAGE = mmap.PAGESIZE
PAGES = 16

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/PID/smaps")


def the_mapping(path: Path) -> Mapping:
    found = [mapping for mapping in mappings.read() if mapping.path == str(path)]
    assert len(found) == 1, found
    return found[0]


def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    content = bytes(range(256)) * (PAGES * PAGE // 256)
    path = tmp_path / "data.bin"
    with path.open("wb") as handle:
        handle.write(content)
        os.fsync(handle.fileno())
    return path, content


def mapped(path: Path, writable: bool) -> mmap.mmap:
    with path.open("r+b" if writable else "rb") as handle:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=prot)


def test_read_lists_this_process_s_mappings_with_their_pages(tmp_path):
    path, content = data_file(tmp_path)
    view = mapped(path, writable=False)
    try:
        assert view[:] == content  # every page read
        mapping = the_mapping(path)
        assert (mapping.perms, mapping.end - mapping.start, mapping.file_backed) == ("r--p", PAGES * PAGE, True)
        assert mapping.rss == PAGES * PAGE and mapping.anonymous == 0 and mapping.releasable
        every = mappings.read()
        assert any(not m.file_backed and m.anonymous > 0 for m in every)
        assert every == sorted(every, key=lambda m: m.start)
    finally:
        view.close()


def test_released_pages_leave_the_rss_and_read_back_unchanged(tmp_path):
    path, content = data_file(tmp_path)
    view = mapped(path, writable=False)
    try:
        assert view[:] == content
        assert mappings.release_file_pages(str(path)) == PAGES * PAGE
        assert the_mapping(path).rss == 0
        assert view[:] == content  # mapped again from the page cache
        assert the_mapping(path).rss == PAGES * PAGE
    finally:
        view.close()


def test_written_pages_are_never_released(tmp_path):
    """A writable private mapping, and a read-only one with a page written before it was made read-only (as the
    dynamic loader does with relocated data, RELRO), keep what was written."""
    path, content = data_file(tmp_path)
    writable, relro = mapped(path, writable=True), mapped(path, writable=True)
    writable[0:4] = relro[PAGE:PAGE + 4] = b"\xff\xfe\xfd\xfc"
    anchor = ctypes.c_char.from_buffer(relro)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    try:
        assert libc.mprotect(ctypes.addressof(anchor), PAGES * PAGE, mmap.PROT_READ) == 0, os.strerror(
            ctypes.get_errno())
        both = [mapping for mapping in mappings.read() if mapping.path == str(path)]
        assert sorted(mapping.perms for mapping in both) == ["r--p", "rw-p"]
        assert not any(mapping.releasable for mapping in both)
        assert mappings.release_file_pages(str(path)) == 0
        assert writable[0:4] == relro[PAGE:PAGE + 4] == b"\xff\xfe\xfd\xfc"
        assert relro[:PAGE] == content[:PAGE] and writable[4:] == content[4:]
    finally:
        del anchor
        writable.close()
        relro.close()


def test_only_resident_read_only_private_file_pages_without_private_ones_are_releasable():
    def mapping(perms: str = "r-xp", path: str = "/lib/x.so", **pages: int) -> Mapping:
        return Mapping(0, PAGE, perms, path, **{"rss": PAGE, **pages})

    assert mapping().releasable and mapping("r--p").releasable
    assert not mapping(rss=0).releasable
    assert not mapping("rw-p").releasable and not mapping("r--s").releasable
    assert not mapping(path="").releasable and not mapping(path="[heap]").releasable
    assert not mapping(anonymous=PAGE).releasable
    assert not mapping(locked=PAGE).releasable

"""The page pool (``edge_agent/native/page_pool.c``): built once, preloaded into the training forkserver, driven
by the training child.

The pool is a small C library that interposes ``malloc`` and friends. Preloaded, it passes everything to glibc
until a process calls :func:`enable`; from then on every block of at least the threshold is a mapping of its own
(as in the ``compact`` heap) whose pages, once freed, are kept and handed to the next request (same length, or
shrunk or grown in place with ``mremap``), but never more of them than the high-water mark of the live blocks
since the last :func:`release`. The resident peak is therefore the compact heap's (up to kept pages that a block
written only in part reuses), while the pages a step reuses are not faulted in again; fresh pages fault in as
written (see ``edge_agent.allocator`` for the measurements).

The library is compiled with the system's C compiler (``$CC``, else ``cc``) the first time it is needed, into
``edge_agent/native/`` when that is writable, else ``$FEDFIT_CACHE_DIR``, systemd's ``$CACHE_DIRECTORY`` or
``~/.cache/fedfit``; the file's name carries a digest of the source, flags and machine, so a changed source (or a
copy from another architecture) is never run. It is not used beside another preloaded allocator (jemalloc,
tcmalloc: its small blocks go straight to glibc, which would mix the two heaps) nor from a path ``LD_PRELOAD``
cannot name (one with a space or a colon). This module imports no torch:
the agent process uses it to decide, the forkserver's environment to load it, the training child to drive it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "SOURCE",
    "BuildFailed",
    "PoolStats",
    "build",
    "enable",
    "library_path",
    "loaded",
    "release",
    "stats",
    "usable",
]

SOURCE = Path(__file__).resolve().parent / "native" / "page_pool.c"
CFLAGS = ("-O2", "-shared", "-fPIC", "-Wall")
LIBS = ("-ldl", "-lpthread")
BUILD_TIMEOUT_S = 120.0
_ENABLE = "fedfit_pool_enable"


class BuildFailed(RuntimeError):
    """The pool could not be compiled here (no C compiler, no glibc headers, no writable directory)."""


def _digest() -> str:
    text = SOURCE.read_bytes() + " ".join(CFLAGS + LIBS + (platform.machine(), *platform.libc_ver())).encode()
    return hashlib.sha256(text).hexdigest()[:12]


def library_name() -> str:
    """The file name of the library built from the current source."""
    return f"libfedfit_page_pool-{_digest()}.so"


def _directories() -> list[Path]:
    found = [SOURCE.parent]
    for variable in ("FEDFIT_CACHE_DIR", "CACHE_DIRECTORY"):  # CACHE_DIRECTORY: systemd's CacheDirectory=
        if os.environ.get(variable):
            found.append(Path(os.environ[variable].split(":")[0]))
    found.append(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedfit")
    return found


def build(directory: Path) -> Path:
    """Compile the pool into ``directory`` (written under a temporary name, then renamed: a reader never sees a
    half-written library). Raises :class:`BuildFailed` with the compiler's last words."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise BuildFailed("no C compiler (cc, gcc or $CC) to build the page pool")
    target = directory / library_name()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".page_pool-", suffix=".so", dir=directory)
        os.close(handle)
    except OSError as exc:
        raise BuildFailed(f"cannot write the page pool into {directory}: {exc}") from None
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", temporary, str(SOURCE), *LIBS], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise BuildFailed(f"{compiler} could not build the page pool: {last}")
        os.chmod(temporary, 0o755)
        os.replace(temporary, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildFailed(f"building the page pool failed: {exc}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


@cache
def library_path() -> Path | None:
    """The pool's library for the current source, built on first use; None where it cannot be built or loaded
    (the training heap then falls back to ``compact``, whose peaks are the same)."""
    if not SOURCE.exists() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None  # (mremap is Linux's; __libc_malloc and friends are glibc's)
    directories = [directory for directory in _directories() if _nameable(directory)]
    for directory in directories:
        candidate = directory / library_name()
        if candidate.exists() and _loadable(candidate):
            return candidate
    for directory in directories:
        try:
            built = build(directory)
        except BuildFailed:
            continue
        if _loadable(built):
            return built
    return None


def _nameable(directory: Path) -> bool:
    """Whether ``LD_PRELOAD`` can name a file in ``directory`` (it splits on spaces and colons)."""
    return not any(character in str(directory) for character in " :\t\n")


def _loadable(path: Path) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(path)), _ENABLE)
    except OSError:
        return False


def _other_preloads() -> list[str]:
    """What this process's ``LD_PRELOAD`` (inherited by the processes it starts) loads besides the pool."""
    items = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return [item for item in items if not Path(item).name.startswith("libfedfit_page_pool")]


def usable() -> bool:
    """Whether the pool can be preloaded into the processes this one starts: built, and no other library
    preloaded in this environment."""
    return library_path() is not None and not _other_preloads()


def _process() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def loaded() -> bool:
    """Whether this process runs with the pool preloaded."""
    return hasattr(_process(), _ENABLE)


def enable(threshold: int) -> bool:
    """Pool every block of at least ``threshold`` bytes from now on; False (nothing changed) without the pool."""
    if not loaded():
        return False
    function = _process().fedfit_pool_enable
    function.argtypes = (ctypes.c_size_t,)
    function.restype = ctypes.c_int
    return bool(function(threshold))


def release() -> None:
    """Give every kept page back to the system and start a new high-water mark at the live blocks."""
    if loaded():
        _process().fedfit_pool_release()


@dataclass(frozen=True)
class PoolStats:
    """The pool's bytes live and kept, its high-water mark, the mappings it made (or grew) with their bytes, and the
    blocks it handed out (each a mapping of its own under the compact heap)."""

    live_bytes: int
    kept_bytes: int
    high_water_bytes: int
    maps: int
    mapped_bytes: int
    blocks: int


def stats() -> PoolStats | None:
    """The pool's figures (None without the pool)."""
    if not loaded():
        return None
    values = (ctypes.c_uint64 * 6)()
    _process().fedfit_pool_stats(values)
    return PoolStats(*(int(value) for value in values))

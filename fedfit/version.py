"""What version of FedFit is running: the package's version and, from a git checkout, the commit."""

from __future__ import annotations

import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def package_version() -> str:
    """The installed package's version (``unknown`` when it is not installed)."""
    try:
        return metadata.version("fedfit")
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def git_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout FedFit runs from, or None outside one."""
    if not (_ROOT / ".git").exists():
        return None
    try:
        result = subprocess.run(["git", "-C", str(_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                                capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def version_string() -> str:
    """E.g. ``fedfit 0.1.0 (git 1a2b3c4d5e6f-dirty)``."""
    revision = git_revision()
    return f"fedfit {package_version()}" + (f" (git {revision})" if revision else "")

"""Errors raised by the dataset and local-data loaders."""

from __future__ import annotations

__all__ = ["DatasetError"]


class DatasetError(RuntimeError):
    """A dataset is missing or malformed.

    The message is one sentence saying what is wrong and what to do about it.
    """

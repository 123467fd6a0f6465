"""Imported only by the training forkserver (its preload, ``edge_agent.forkserver.PRELOAD``): prepares the server
before it forks anything (``edge_agent.child_warmup.prepare``)."""

from __future__ import annotations

from edge_agent.child_warmup import prepare

prepare()

"""The single exception type of the wire contract."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A payload, topic or message field that breaks the FedFit wire contract.

    Every decode and validation failure raises this (and only this), with a message that says what is wrong,
    so a daemon can log the reason, drop the message and carry on.
    """

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from common import systemd_notify


def test_notify_sends_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert systemd_notify.notify("READY=1")
        assert server.recv(64) == b"READY=1"


def test_notify_without_systemd_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd_notify.notify("READY=1") is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd_notify.watchdog_interval() == 10.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert systemd_notify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert systemd_notify.watchdog_interval() is None

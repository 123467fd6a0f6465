"""The shipped systemd units (systemd/) load cleanly and stay sandboxed: ``systemd-analyze verify`` accepts each
(and the agent with its Jetson drop-in), ``systemd-analyze security --offline=true`` rates each at most MEDIUM,
and what the daemons rely on (notify, watchdog, OOM policy, their own credential files) is set.

The systemd-analyze checks run where systemd-analyze is installed and skip elsewhere; the checks of the units'
text run everywhere."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
AGENT = UNITS / "fedfit-agent.service"
COORDINATOR = UNITS / "fedfit-coordinator.service"
JETSON = UNITS / "fedfit-agent.service.d" / "jetson.conf"
EXEC = "/opt/fedfit/.venv/bin/fedfit"  # where docs/deployment.md installs the package; absent on a test machine

# systemd's own table (src/analyze/analyze-security.c, badness_table): an exposure of 7.5 or more is EXPOSED,
# 5.0 up to 7.4 MEDIUM, 1.0 up to 4.9 OK, 0.1 up to 0.9 SAFE, 0.0 PERFECT. The figure is printed in tenths.
EXPOSED_FROM = 7.5
ACCEPTABLE = ("PERFECT", "SAFE", "OK", "MEDIUM")
# Every directive these units use is known to systemd 247 (the newest: ProtectProc=, LoadCredential=); an older
# systemd-analyze warns "Unknown key" and ignores it, which is that systemd's limitation, not the unit's fault.
ALL_KEYS_KNOWN_SINCE = 247
OFFLINE_SECURITY_SINCE = 250  # systemd-analyze security --offline=

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed here")


def directives(*paths: Path) -> dict[str, list[str]]:
    """Every ``Key=value`` of the unit files in order (later files are drop-ins), each key's values in a list;
    comments and section headers left out, continuation lines joined."""
    found: dict[str, list[str]] = {}
    for path in paths:
        logical = re.sub(r"\\\n", " ", path.read_text())
        for line in logical.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";", "[")):
                continue
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def last(units: dict[str, list[str]], key: str) -> str | None:
    values = units.get(key)
    return values[-1] if values else None


@functools.cache
def systemd_version() -> int:
    assert ANALYZE is not None
    first = subprocess.run([ANALYZE, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    match = re.match(r"systemd (\d+)", first)
    assert match, first
    return int(match.group(1))


def stage(directory: Path, unit: Path, *dropins: Path) -> Path:
    """A copy of ``unit`` (with ``dropins`` in ``NAME.d/``) in ``directory``, alone there: given a path,
    systemd-analyze also applies the drop-ins beside it, so the repository's systemd/ would always add the Jetson
    one. ExecStart's binary is the test's Python in the copy, because verify rejects a command that is not there
    (``Command /opt/fedfit/.venv/bin/fedfit is not executable``) and the package is not installed in /opt here;
    the rest of the line, and the file, are unchanged."""
    text = unit.read_text()
    command = f"ExecStart={EXEC} "
    assert text.count(command) == 1, f"{unit.name} should start {EXEC}"
    python = sys.executable if not re.search(r"\s", sys.executable) else f'"{sys.executable}"'
    copy = directory / unit.name
    copy.write_text(text.replace(command, f"ExecStart={python} "))
    if dropins:
        (directory / f"{unit.name}.d").mkdir()
        for dropin in dropins:
            shutil.copy(dropin, directory / f"{unit.name}.d" / dropin.name)
    return copy


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "cat", "SYSTEMD_LOG_COLOR": "0"}
    env.pop("SYSTEMD_UNIT_PATH", None)
    return subprocess.run([ANALYZE, *args], check=False, capture_output=True, text=True, timeout=60, env=env)


CASES = {
    "agent": (AGENT,),
    "agent+jetson": (AGENT, JETSON),
    "coordinator": (COORDINATOR,),
}


@needs_analyze
@pytest.mark.parametrize("case", CASES)
def test_systemd_analyze_verify_accepts_the_unit(case: str, tmp_path: Path) -> None:
    unit, *dropins = CASES[case]
    copy = stage(tmp_path, unit, *dropins)
    done = analyze("verify", "--man=no", str(copy))
    # Only what is said about these files counts: verify also loads the host's targets, whose own warnings
    # (about other units) are no concern here.
    ours = [line for line in done.stderr.splitlines() if str(tmp_path) in line or unit.name in line]
    if systemd_version() < ALL_KEYS_KNOWN_SINCE:
        ours = [line for line in ours if "Unknown key" not in line and "Unknown lvalue" not in line]
    assert done.returncode == 0 and not ours, done.stderr


@needs_analyze
@pytest.mark.parametrize("case", CASES)
def test_systemd_analyze_security_rates_the_unit_at_most_medium(case: str, tmp_path: Path) -> None:
    if systemd_version() < OFFLINE_SECURITY_SINCE:
        pytest.skip(f"systemd-analyze security --offline= needs systemd {OFFLINE_SECURITY_SINCE}+")
    unit, *dropins = CASES[case]
    copy = stage(tmp_path, unit, *dropins)
    done = analyze("security", "--offline=true", "--no-pager", str(copy))
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", done.stdout)
    assert match, done.stdout + done.stderr
    exposure, label = float(match.group(1)), match.group(2)
    assert exposure < EXPOSED_FROM and label in ACCEPTABLE, done.stdout


def test_the_base_agent_unit_needs_no_gpu_groups() -> None:
    """A ``render`` group the host lacks fails the unit with 216/GROUP: GPU groups live in the Jetson drop-in."""
    for unit in (AGENT, COORDINATOR):
        settings = directives(unit)
        assert "SupplementaryGroups" not in settings, unit.name
        assert not any("render" in value for values in settings.values() for value in values), unit.name
    jetson = directives(JETSON)
    groups = " ".join(jetson["SupplementaryGroups"]).split()
    assert "video" in groups
    assert last(jetson, "PrivateDevices") == "no"
    assert "/etc/systemd/system/fedfit-agent.service.d/jetson.conf" in JETSON.read_text()


def test_each_daemon_loads_its_own_broker_password() -> None:
    sources = {}
    for unit, name in ((AGENT, "fedfit-agent"), (COORDINATOR, "fedfit-coordinator")):
        [credential] = directives(unit)["LoadCredential"]
        credential_name, _, source = credential.partition(":")
        assert credential_name == "broker-password"  # /run/credentials/NAME.service/broker-password
        assert f"/run/credentials/{name}.service/broker-password" in unit.read_text()
        sources[name] = source
    assert sources == {"fedfit-agent": "/etc/fedfit/agent.password",
                       "fedfit-coordinator": "/etc/fedfit/coordinator.password"}
    # What `fedfit broker add-device` tells to install is what the agent unit loads.
    assert sources["fedfit-agent"] in (ROOT / "fedfit" / "broker_command.py").read_text()


def test_the_agent_unit_keeps_what_the_agent_relies_on() -> None:
    agent = directives(AGENT)
    assert last(agent, "Type") == "notify" and last(agent, "NotifyAccess") == "main"
    assert last(agent, "WatchdogSec") not in (None, "", "0", "infinity")
    assert last(agent, "OOMPolicy") == "continue"  # a training child killed at MemoryMax leaves the agent up
    for key in ("MemoryHigh", "MemoryMax", "StateDirectory", "CacheDirectory"):
        assert last(agent, key), key
    coordinator = directives(COORDINATOR)
    assert last(coordinator, "Type") == "notify" and last(coordinator, "StateDirectory")


@pytest.mark.parametrize("unit", [AGENT, COORDINATOR], ids=lambda unit: unit.name)
def test_the_sandbox_leaves_the_daemons_what_they_use(unit: Path) -> None:
    """Measured with strace on real runs (agent with its forkserver, training children and the page pool's cc;
    coordinator evaluating and aggregating): torch calls sched_setaffinity and mbind and cc1 setrlimit (all in
    @resources), torch's JIT maps writable pages executable, the agent reads /proc/meminfo and /proc/vmstat."""
    settings = directives(unit)
    assert "@system-service" in settings["SystemCallFilter"]
    denied = " ".join(value.lstrip("~") for value in settings["SystemCallFilter"] if value.startswith("~"))
    assert "@resources" not in denied.split()
    assert last(settings, "MemoryDenyWriteExecute") in (None, "no", "false")
    assert last(settings, "ProcSubset") in (None, "all")
    assert set(last(settings, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert last(settings, "CapabilityBoundingSet") == "" and last(settings, "DynamicUser") == "yes"

"""scripts/install-agent.sh and scripts/install-coordinator.sh, staged into a temporary root (``--root``) without a
venv (``--skip-pip``): the files they write, that they call neither systemctl nor apt-get there, and their one-line
refusals. FEDFIT_PYTHON (this interpreter) validates the written configurations and runs ``fedfit broker``."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import from_mapping, load_yaml
from edge_agent.config import AgentConfig

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "scripts" / "install-agent.sh"
COORDINATOR = REPO / "scripts" / "install-coordinator.sh"
JETSON_DROPIN = REPO / "systemd" / "fedfit-agent.service.d" / "jetson.conf"
BASH = shutil.which("bash")
PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"

pytestmark = pytest.mark.skipif(BASH is None, reason="the install scripts need bash")


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """systemctl and apt-get that record being called (they must not be, with --root) and fail."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("systemctl", "apt-get"):
        tool = folder / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/called"\nexit 1\n')
        tool.chmod(0o755)
    return folder


def run(script: Path, *args: str, fake_bin: Path) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    env = {**os.environ, "FEDFIT_PYTHON": sys.executable, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([BASH, str(script), *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


@pytest.fixture
def secrets(tmp_path: Path) -> tuple[Path, Path]:
    ca, password = tmp_path / "ca.crt", tmp_path / "pi-01.password"
    ca.write_text(PEM)
    password.write_text("s3cret\n")
    return ca, password


def agent_args(root: Path, ca: Path, password: Path, *more: str) -> list[str]:
    return ["--root", str(root), "--skip-pip", "--agent-id", "pi-01", "--federation", "lab", "--broker-host",
            "broker.lan", "--ca", str(ca), "--password-file", str(password), "--data-dataset", "digits", "--shard",
            "1", "--num-shards", "4", *more]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_agent_install_writes_a_valid_config_the_secrets_and_the_enabled_unit(
        tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path]) -> None:
    root = tmp_path / "root"
    result = run(AGENT, *agent_args(root, *secrets, "--budget", "1500000000"), fake_bin=fake_bin)
    assert result.returncode == 0, result.stderr
    etc = root / "etc" / "fedfit"
    config = from_mapping(AgentConfig, load_yaml(etc / "agent.yaml"))
    config.validate()
    assert (config.agent_id, config.federation, config.device, config.budget_bytes) == ("pi-01", "lab", "cpu",
                                                                                          1500000000)
    assert (config.broker.host, config.broker.port, config.broker.tls, config.broker.username) == (
        "broker.lan", 8883, True, "pi-01")
    assert config.broker.ca_file == "/etc/fedfit/ca.crt"
    assert config.broker.password_file == "/run/credentials/fedfit-agent.service/broker-password"
    assert (config.data.dataset, config.data.shard, config.data.num_shards) == ("digits", 1, 4)
    assert config.state_dir is None  # systemd's StateDirectory
    assert (etc / "agent.password").read_text() == "s3cret\n" and mode(etc / "agent.password") == 0o600
    assert (etc / "ca.crt").read_text() == PEM and mode(etc / "ca.crt") == 0o644
    assert mode(etc / "agent.yaml") == 0o644  # the service's dynamic user reads it; it holds no secret
    if os.geteuid() == 0:
        assert (etc / "agent.password").stat().st_uid == 0 and (etc / "agent.password").stat().st_gid == 0
    units = root / "etc" / "systemd" / "system"
    assert (units / "fedfit-agent.service").read_text() == (REPO / "systemd" / "fedfit-agent.service").read_text()
    link = units / "multi-user.target.wants" / "fedfit-agent.service"
    assert link.is_symlink() and os.readlink(link) == "/etc/systemd/system/fedfit-agent.service"
    assert not (units / "fedfit-agent.service.d").exists()
    assert not (tmp_path / "called").exists()  # no systemctl, no apt-get under --root
    assert not (root / "opt").exists()  # --skip-pip: no venv


def test_a_rerun_keeps_the_password_unless_a_new_one_is_given_and_keeps_a_changed_config(
        tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path]) -> None:
    root, (ca, password) = tmp_path / "root", secrets
    assert run(AGENT, *agent_args(root, ca, password), fake_bin=fake_bin).returncode == 0
    etc = root / "etc" / "fedfit"
    again = ["--root", str(root), "--skip-pip", "--agent-id", "pi-01", "--federation", "lab", "--broker-host",
             "broker.lan", "--data-path", "/srv/data.npz"]  # no --ca, no --password-file: the installed ones stay
    (root / "srv").mkdir()
    (root / "srv" / "data.npz").write_bytes(b"x")
    (root / "srv" / "data.npz").chmod(0o644)
    result = run(AGENT, *again, fake_bin=fake_bin)
    assert result.returncode == 0, result.stderr
    assert (etc / "agent.password").read_text() == "s3cret\n" and mode(etc / "agent.password") == 0o600
    assert load_yaml(etc / "agent.yaml")["data"] == {"path": "/srv/data.npz"}
    assert load_yaml(etc / "agent.yaml.old")["data"]["dataset"] == "digits"
    new_password = tmp_path / "new.password"
    new_password.write_text("rotated\n")
    assert run(AGENT, *again, "--password-file", str(new_password), fake_bin=fake_bin).returncode == 0
    assert (etc / "agent.password").read_text() == "rotated\n" and mode(etc / "agent.password") == 0o600


@pytest.mark.skipif(not JETSON_DROPIN.exists(), reason="systemd/fedfit-agent.service.d/jetson.conf not in this tree")
def test_jetson_installs_the_drop_in_and_trains_on_cuda_and_a_rerun_without_it_removes_it(
        tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path]) -> None:
    root = tmp_path / "root"
    result = run(AGENT, *agent_args(root, *secrets, "--jetson"), fake_bin=fake_bin)
    assert result.returncode == 0, result.stderr
    dropin = root / "etc" / "systemd" / "system" / "fedfit-agent.service.d" / "jetson.conf"
    assert dropin.read_text() == JETSON_DROPIN.read_text() and mode(dropin) == 0o644
    assert load_yaml(root / "etc" / "fedfit" / "agent.yaml")["device"] == "cuda"
    assert run(AGENT, *agent_args(root, *secrets), fake_bin=fake_bin).returncode == 0
    assert not dropin.exists()


def test_another_prefix_moves_the_units_exec_start(tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path]) -> None:
    root = tmp_path / "root"
    assert run(AGENT, *agent_args(root, *secrets, "--prefix", "/srv/fedfit"), fake_bin=fake_bin).returncode == 0
    unit = (root / "etc" / "systemd" / "system" / "fedfit-agent.service").read_text()
    assert "ExecStart=/srv/fedfit/.venv/bin/fedfit agent --config /etc/fedfit/agent.yaml" in unit


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a[:a.index("--agent-id")] + a[a.index("--agent-id") + 2:], "--agent-id is required"),
    (lambda a: [*a, "--ca", "/nonexistent/ca.crt"], "--ca /nonexistent/ca.crt does not exist"),
    (lambda a: [*a, "--shard", "4"], "--shard must be in 0..3"),
    (lambda a: [x for x in a if x != "--skip-pip"] + ["--jetson"], "--jetson needs --torch-wheel"),
    (lambda a: [*a, "--agent-id", "pi/01"], "--agent-id must be 1 to 64 characters"),
    (lambda a: [*a, "--broker-port", "0"], "--broker-port must be a port"),
    (lambda a: [*a, "--device", "tpu"], "--device must be cpu, cuda or auto"),
    (lambda a: [*a, "--data-path", "/srv/data.npz"], "either --data-path or --data-dataset"),
    (lambda a: [*a, "--budget", "1G"], "--budget must be a positive number of bytes"),
    (lambda a: [*a, "--bogus"], "unknown option '--bogus'"),
    (lambda a: [*a, "--federation"], "--federation needs a value"),
])
def test_the_agent_install_refuses_bad_input_in_one_line_before_writing_anything(
        tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path], change, message: str) -> None:
    root = tmp_path / "root"
    result = run(AGENT, *change(agent_args(root, *secrets)), fake_bin=fake_bin)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("install-agent: error: ") and message in lines[0], result.stderr
    assert not root.exists()


def test_the_first_install_needs_a_password_file(tmp_path: Path, fake_bin: Path, secrets: tuple[Path, Path]) -> None:
    ca, password = secrets
    args = [a for a in agent_args(tmp_path / "root", ca, password) if a not in ("--password-file", str(password))]
    result = run(AGENT, *args, fake_bin=fake_bin)
    assert result.returncode != 0 and "--password-file is required on the first install" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="fedfit broker init needs openssl")
def test_the_coordinator_install_makes_the_broker_the_bundles_and_a_config_an_agent_install_accepts(
        tmp_path: Path, fake_bin: Path) -> None:
    from coordinator.config import CoordinatorConfig

    root = tmp_path / "root"
    args = ["--root", str(root), "--skip-pip", "--federation", "lab", "--broker-host", "broker.lan,10.0.0.2",
            "--dataset", "digits", "--rounds", "5"]
    result = run(COORDINATOR, *args, "--agents", "pi-01,pi-02", fake_bin=fake_bin)
    assert result.returncode == 0, result.stderr
    etc, units = root / "etc" / "fedfit", root / "etc" / "systemd" / "system"
    broker = etc / "broker"
    conf = (broker / "mosquitto.conf").read_text()
    assert str(root) not in conf and "password_file /etc/fedfit/broker/passwd" in conf
    config = from_mapping(CoordinatorConfig, load_yaml(etc / "coordinator.yaml"))
    config.validate()
    assert (config.federation, config.rounds, config.min_agents, config.state_dir) == (
        "lab", 5, 2, "/var/lib/fedfit-coordinator")
    assert (config.broker.host, config.broker.port, config.broker.username) == ("127.0.0.1", 8883, "coordinator")
    assert config.broker.password_file == "/run/credentials/fedfit-coordinator.service/broker-password"
    password = etc / "coordinator.password"
    assert password.read_text() == (broker / "clients" / "coordinator.password").read_text()
    assert mode(password) == 0o600 and (etc / "ca.crt").read_text() == (broker / "ca.crt").read_text()
    for agent in ("pi-01", "pi-02"):
        bundle = etc / "devices" / agent
        assert (bundle / f"{agent}.password").read_text() == (broker / "clients" / f"{agent}.password").read_text()
        assert mode(bundle / f"{agent}.password") == 0o600 and mode(bundle) == 0o700
        assert (f"install-agent.sh --agent-id {agent} --federation lab --broker-host broker.lan --broker-port 8883 "
                f"--ca fedfit-{agent}/ca.crt --password-file fedfit-{agent}/{agent}.password") in result.stdout
    dropin = (units / "mosquitto.service.d" / "fedfit.conf").read_text()
    assert "ExecStart=\nExecStart=/usr/sbin/mosquitto -c /etc/fedfit/broker/mosquitto.conf" in dropin
    assert (units / "fedfit-coordinator.service").read_text() == (
        REPO / "systemd" / "fedfit-coordinator.service").read_text()
    assert os.readlink(units / "multi-user.target.wants" / "fedfit-coordinator.service") == (
        "/etc/systemd/system/fedfit-coordinator.service")
    assert not (tmp_path / "called").exists()

    # Again, with one more device: the broker (its CA) and the existing logins are kept.
    ca, pi01 = (broker / "ca.crt").read_text(), (broker / "clients" / "pi-01.password").read_text()
    again = run(COORDINATOR, *args, "--agents", "pi-01", "--agents", "pi-03", fake_bin=fake_bin)
    assert again.returncode == 0, again.stderr
    assert "keeping the broker" in again.stdout and (broker / "ca.crt").read_text() == ca
    assert (broker / "clients" / "pi-01.password").read_text() == pi01
    assert (etc / "devices" / "pi-03" / "pi-03.password").exists()
    assert not (broker / "devices").exists() or not any((broker / "devices").iterdir())  # one bundle per device
    # Only the flags given change the configuration; pi-02 came from the first install, so no shard lines now.
    kept = from_mapping(CoordinatorConfig, load_yaml(etc / "coordinator.yaml"))
    assert (kept.data.dataset, kept.rounds, kept.min_agents) == ("digits", 5, 2)
    assert "--data-path FILE_OR_DIR" in again.stdout and "--shard" not in again.stdout
    quiet = [a for a in args if a not in ("--dataset", "digits", "--rounds", "5")]
    assert run(COORDINATOR, *quiet, "--rounds", "7", fake_bin=fake_bin).returncode == 0
    kept = from_mapping(CoordinatorConfig, load_yaml(etc / "coordinator.yaml"))
    assert (kept.data.dataset, kept.rounds, kept.min_agents) == ("digits", 7, 2)
    coordinator_login = run(COORDINATOR, *args, "--agents", "coordinator", fake_bin=fake_bin)
    assert coordinator_login.returncode != 0 and "the coordinator's own login" in coordinator_login.stderr
    assert not (etc / "devices" / "coordinator").exists()
    wrong = run(COORDINATOR, *[("other" if a == "lab" else a) for a in args], fake_bin=fake_bin)
    assert wrong.returncode != 0 and "holds the broker of federation lab, not other" in wrong.stderr

    # A device installs from its bundle.
    device = tmp_path / "device"
    bundle = etc / "devices" / "pi-02"
    result = run(AGENT, "--root", str(device), "--skip-pip", "--agent-id", "pi-02", "--federation", "lab",
                 "--broker-host", "broker.lan", "--ca", str(bundle / "ca.crt"), "--password-file",
                 str(bundle / "pi-02.password"), "--data-dataset", "digits", "--shard", "1", "--num-shards", "2",
                 fake_bin=fake_bin)
    assert result.returncode == 0, result.stderr
    assert (device / "etc" / "fedfit" / "agent.password").read_text() == (broker / "clients" / "pi-02.password").read_text()
    from_mapping(AgentConfig, load_yaml(device / "etc" / "fedfit" / "agent.yaml")).validate()


def test_the_coordinator_install_refuses_bad_input_in_one_line(tmp_path: Path, fake_bin: Path) -> None:
    root = tmp_path / "root"
    for args, message in [
        (["--broker-host", "b"], "--federation is required"),
        (["--federation", "lab"], "--broker-host is required"),
        (["--federation", "lab", "--broker-host", "b", "--agents", "a,a"], "--agents names a twice"),
        (["--federation", "lab", "--broker-host", "b", "--rounds", "0"], "--rounds must be a positive integer"),
    ]:
        result = run(COORDINATOR, "--root", str(root), "--skip-pip", *args, fake_bin=fake_bin)
        lines = result.stderr.splitlines()
        assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr
        assert lines[0].startswith("install-coordinator: error: ")
    assert not root.exists()


COMMON = REPO / "scripts" / "install-common.sh"


def torch_install(tmp_path: Path, machine: str, *, index_reachable: bool) -> subprocess.CompletedProcess[str]:
    """install-common.sh's torch_plan and install_torch on a machine ``uname -m`` calls ``machine``, with a pip
    that fails whatever names PyTorch's CPU index unless ``index_reachable``; every pip call is written to stdout."""
    assert BASH is not None
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    uname = folder / "uname"
    uname.write_text(f"#!/bin/sh\necho {machine}\n")
    uname.chmod(0o755)
    script = f"""
PROG=test
SRC={REPO}
source {COMMON}
vpip() {{
  echo "pip $*"
  case " $* " in *" --index-url "*) [ {int(index_reachable)} = 1 ] ;; *) true ;; esac
}}
TORCH_SPEC="" TORCH_WHEELS=() PIP_ARGS=()
torch_plan
install_torch
echo done
"""
    env = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([BASH, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_torch_comes_from_the_cpu_index_and_on_aarch64_from_pypis_last_cpu_build_where_the_index_fails(
        tmp_path: Path) -> None:
    reached = torch_install(tmp_path, "aarch64", index_reachable=True)
    assert reached.returncode == 0 and reached.stdout.splitlines()[-2:] == [
        "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu", "done"]
    assert "warning" not in reached.stderr
    fallen = torch_install(tmp_path, "aarch64", index_reachable=False)
    assert fallen.returncode == 0 and fallen.stdout.splitlines()[-3:] == [
        "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu",
        "pip install torch==2.9.1 torchvision==0.24.1", "done"]
    (warning,) = fallen.stderr.splitlines()  # one sentence says why
    assert "could not install torch from https://download.pytorch.org/whl/cpu" in warning and "2.9.1" in warning
    x86 = torch_install(tmp_path, "x86_64", index_reachable=False)  # no stand-in there: a clear error
    assert x86.returncode == 1 and "done" not in x86.stdout
    assert x86.stderr.strip().endswith("see pip's output above") and len(x86.stderr.splitlines()) == 1


def fake_python(folder: Path, import_torch: str) -> Path:
    """A python that answers torch's version and runs ``import_torch`` (shell) for anything else."""
    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "python"
    python.write_text(f"""#!/bin/sh
case "$2" in *metadata*) echo 2.10.0; exit 0 ;; esac
{import_torch}
""")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize(("import_torch", "expected"), [
    ("exit 0", None),
    ("kill -ILL $$", "torch 2.10.0 stops at import with an illegal instruction: it was built for a newer"),
    ("echo 'ImportError: libgomp.so.1: cannot open shared object file' >&2; exit 1",
     "torch 2.10.0 does not import (exit 1): ImportError: libgomp.so.1: cannot open shared object file"),
])
def test_a_torch_that_does_not_import_is_named_in_one_sentence(tmp_path: Path, import_torch: str,
                                                                 expected: str | None) -> None:
    assert BASH is not None
    python = fake_python(tmp_path / "bin", import_torch)
    script = f'. {REPO / "scripts" / "torch-import-check.sh"}; torch_import_problem {python}'
    checked = subprocess.run([BASH, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                             check=False)
    if expected is None:
        assert checked.returncode == 0 and checked.stdout == ""
    else:
        assert checked.returncode == 1 and len(checked.stdout.splitlines()) == 1
        assert checked.stdout.startswith(expected)


def test_the_install_stops_where_the_torch_it_installed_does_not_import(tmp_path: Path) -> None:
    assert BASH is not None
    venv = tmp_path / "venv"
    fake_python(venv / "bin", "kill -ILL $$")
    folder = tmp_path / "arm"  # an aarch64 machine: the hint names the torch that runs on a Pi 4
    folder.mkdir()
    (folder / "uname").write_text("#!/bin/sh\necho aarch64\n")
    (folder / "uname").chmod(0o755)
    env = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}

    def check(root: str) -> subprocess.CompletedProcess[str]:
        script = f"PROG=test\nSRC={REPO}\nsource {COMMON}\nROOT={root} VENV={venv}\ncheck_torch_imports\necho installed\n"
        return subprocess.run([BASH, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=60, check=False)

    stopped = check("")
    assert stopped.returncode != 0 and "installed" not in stopped.stdout
    (line,) = stopped.stderr.splitlines()
    assert "illegal instruction" in line and "Cortex-A72" in line and "--torch-spec" in line and "torch==2.9.1" in line
    # Staged into a root for another machine: this machine's core says nothing of the device's, so no import.
    staged = check(str(tmp_path / "image"))
    assert staged.returncode == 0 and staged.stdout.splitlines()[-1] == "installed"
    assert "not imported" in staged.stdout + staged.stderr

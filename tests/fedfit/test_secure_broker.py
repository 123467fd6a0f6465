"""The secured broker's files: Mosquitto's password hashes, the ACL, the TLS material, the directory and the
``fedfit broker`` command (without a running broker; tests/integration/test_secured_broker.py has that)."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from common.config import from_mapping
from coordinator.config import CoordinatorConfig
from edge_agent.config import AgentConfig
from fedfit.cli import main
from fedfit.secure_broker import BrokerDirectory, BrokerSettings, BrokerSetupError
from fedfit.secure_broker.acl import acl_text
from fedfit.secure_broker.passwords import (
    check_password,
    hash_password,
    new_password,
    read_password_file,
    write_password_file,
)
from fedfit.secure_broker.pki import subject_alt_names

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")

# A line `mosquitto_passwd -b passwd alice s3cret` (Mosquitto 2.0.11) wrote.
MOSQUITTO_LINE = ("alice:$7$101$BBymEDM0wP9a/Fxz$bluRcfbr44yOl7RhaFqDiXss9tc6d3EAb5k1W4YBCr/Bl4nINYk/eZhtzWju1F3UyLkru4FT"
                  "+3A0aWuboc9Jzg==")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_hashes_are_mosquitto_passwd_s() -> None:
    hashed = MOSQUITTO_LINE.split(":", 1)[1]
    salt = base64.b64decode(hashed.split("$")[3])
    assert hash_password("s3cret", salt=salt) == hashed
    assert check_password("s3cret", hashed) and not check_password("s3creT", hashed)
    assert not check_password("s3cret", "$6$abc$def") and not check_password("x", "garbage")


def test_new_hashes_and_passwords_differ_every_time() -> None:
    first, second = hash_password("same"), hash_password("same")
    assert first != second and first.startswith("$7$101$")
    assert check_password("same", first) and check_password("same", second)
    assert len(new_password()) == 32 and new_password() != new_password()


def test_password_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    assert read_password_file(path) == {}
    write_password_file(path, {"a": "$7$1$x$y", "b": "$7$1$z$w"})
    assert read_password_file(path) == {"a": "$7$1$x$y", "b": "$7$1$z$w"}
    assert mode(path) == 0o640
    path.write_text("ok:$7$1$x$y\nno separator\n")
    with pytest.raises(ValueError, match="passwd:2 is not a 'name:hash' line"):
        read_password_file(path)


def test_acl_pins_devices_to_their_own_topics() -> None:
    text = acl_text("lab", "boss")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [
        "user boss",
        "topic read fedfit/v1/lab/agents/+/status",
        "topic read fedfit/v1/lab/agents/+/update",
        "topic write fedfit/v1/lab/agents/+/task",
        "topic write fedfit/v1/lab/agents/+/ack",
        "topic readwrite fedfit/v1/lab/coordinator/status",
        "pattern readwrite fedfit/v1/lab/agents/%u/status",
        "pattern write fedfit/v1/lab/agents/%u/update",
        "pattern read fedfit/v1/lab/agents/%u/task",
        "pattern read fedfit/v1/lab/agents/%u/ack",
        "pattern read fedfit/v1/lab/coordinator/status",
    ]
    with pytest.raises(ValueError, match="federation"):
        acl_text("a/b", "boss")


def test_subject_alt_names() -> None:
    assert subject_alt_names(["broker.lan", "10.0.0.2", "::1"]) == "DNS:broker.lan,IP:10.0.0.2,IP:::1"
    with pytest.raises(ValueError, match="at least one"):
        subject_alt_names([])
    with pytest.raises(ValueError, match="not a host name"):
        subject_alt_names(["a b"])


@needs_openssl
def test_init_makes_every_file_with_tight_modes(tmp_path: Path) -> None:
    directory = BrokerDirectory.init(tmp_path / "b", BrokerSettings(federation="lab", hosts=["broker.lan", "10.1.2.3"],
                                                                    port=18883, persistence=False))
    root = directory.path
    for name in ("ca.crt", "ca.key", "server.crt", "server.key", "passwd", "acl", "mosquitto.conf", "broker.yaml"):
        assert (root / name).is_file(), name
    assert mode(root / "ca.key") == 0o600 and mode(root / "server.key") == 0o640
    assert mode(root / "clients") == 0o700 and mode(root / "clients" / "coordinator.password") == 0o600
    assert directory.logins() == ["coordinator"]
    password = (root / "clients" / "coordinator.password").read_text().strip()
    assert check_password(password, read_password_file(root / "passwd")["coordinator"])
    conf = (root / "mosquitto.conf").read_text()
    for line in ("allow_anonymous false", f"password_file {root / 'passwd'}", f"acl_file {root / 'acl'}",
                 "listener 18883", f"cafile {root / 'ca.crt'}", "persistence false"):
        assert line in conf.splitlines(), line
    # The server certificate names the hosts and is signed by the CA.
    text = subprocess.run(["openssl", "x509", "-in", str(root / "server.crt"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "DNS:broker.lan, IP Address:10.1.2.3" in text
    subprocess.run(["openssl", "verify", "-CAfile", str(root / "ca.crt"), str(root / "server.crt")], check=True,
                   capture_output=True)
    assert yaml.safe_load((root / "broker.yaml").read_text())["federation"] == "lab"
    with pytest.raises(BrokerSetupError, match="already holds a broker's files"):
        BrokerDirectory.init(root, BrokerSettings(federation="lab"))


@needs_openssl
def test_logins_add_rotate_remove(tmp_path: Path) -> None:
    BrokerDirectory.init(tmp_path, BrokerSettings(federation="lab", persistence=False))
    directory = BrokerDirectory.open(tmp_path)
    secret = directory.add_login("pi-01")
    first = secret.read_text().strip()
    assert mode(secret) == 0o600 and check_password(first, read_password_file(directory.password_file)["pi-01"])
    with pytest.raises(BrokerSetupError, match="already has a login; pass --rotate"):
        directory.add_login("pi-01")
    directory.add_login("pi-01", rotate=True)
    second = secret.read_text().strip()
    assert second != first and check_password(second, read_password_file(directory.password_file)["pi-01"])
    config = directory.client_config("pi-01")
    assert (config.username, config.tls, config.port, config.host) == ("pi-01", True, 8883, "localhost")
    assert config.login() == ("pi-01", second) and config.ca_file == str(directory.ca_file)
    with pytest.raises(BrokerSetupError, match="coordinator's username; .* pass --rotate to give the coordinator"):
        directory.add_login("coordinator")
    coordinator = directory.client_password_file("coordinator")
    old_password = coordinator.read_text().strip()
    directory.add_login("coordinator", rotate=True)  # the coordinator's password can be rotated too
    new_password = coordinator.read_text().strip()
    assert new_password != old_password
    assert check_password(new_password, read_password_file(directory.password_file)["coordinator"])
    with pytest.raises(BrokerSetupError, match="device name must be"):
        directory.add_login("../x")
    directory.remove_login("pi-01")
    assert directory.logins() == ["coordinator"] and not secret.exists()
    with pytest.raises(BrokerSetupError, match="has no login here"):
        directory.remove_login("pi-01")
    with pytest.raises(BrokerSetupError, match="cannot be removed"):
        directory.remove_login("coordinator")
    with pytest.raises(BrokerSetupError, match="has no login here"):
        directory.client_config("pi-01")


def test_open_and_settings_errors(tmp_path: Path) -> None:
    with pytest.raises(BrokerSetupError, match="no broker made by `fedfit broker init`"):
        BrokerDirectory.open(tmp_path)
    (tmp_path / "broker.yaml").write_text("federation: lab\ncolour: red\n")
    with pytest.raises(BrokerSetupError, match="not what `fedfit broker init` writes"):
        BrokerDirectory.open(tmp_path)
    for settings, message in ((BrokerSettings(federation="a b"), "federation"),
                              (BrokerSettings(federation="lab", port=0), "port"),
                              (BrokerSettings(federation="lab", hosts=[]), "at least one host"),
                              (BrokerSettings(federation="lab", hosts=["broker.lan", "bad host"]),
                               "'bad host' is not a host name or an IP address"),
                              (BrokerSettings(federation="lab", bind="0.0.0.0\nallow_anonymous true"),
                               "is not a host name or an IP address"),
                              (BrokerSettings(federation="lab", user="no-such-user-here"),
                               "there is no user 'no-such-user-here' here")):
        with pytest.raises(BrokerSetupError, match=message):
            BrokerDirectory.init(tmp_path / "x", settings)
        assert not (tmp_path / "x").exists()  # refused before anything was written


@needs_openssl
def test_broker_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "broker"
    assert main(["broker", "init", str(root), "--federation", "lab", "--host", "broker.lan", "--port", "9883"]) == 0
    out = capsys.readouterr().out
    assert f"mosquitto -c {root / 'mosquitto.conf'}" in out
    printed = out.split("the coordinator's configuration: (written to ", 1)[1].split("\n", 1)[1]
    assert printed.strip() == (root / "coordinator.yaml").read_text().strip()  # what it printed is what it wrote
    config = from_mapping(CoordinatorConfig, yaml.safe_load(printed))
    config.validate()  # complete: the federation included
    assert config.federation == "lab"
    assert asdict(config.broker) == {"host": "broker.lan", "port": 9883, "tls": True, "ca_file": str(root / "ca.crt"),
                                     "username": "coordinator", "password": None, "keepalive": 30,
                                     "password_file": str(root / "clients" / "coordinator.password")}
    assert main(["broker", "add-device", str(root), "pi-01", "--device-dir", "/etc/fedfit"]) == 0
    out = capsys.readouterr().out
    section = yaml.safe_load(out.split("its agent.yaml:\n", 1)[1])
    assert section["agent_id"] == "pi-01" and section["federation"] == "lab"
    assert section["broker"]["ca_file"] == "/etc/fedfit/ca.crt"
    assert section["broker"]["password_file"] == "/etc/fedfit/pi-01.password"
    assert "state_dir" not in section  # on a device: systemd's StateDirectory
    from_mapping(AgentConfig, section).validate()
    bundle = root / "devices" / "pi-01"
    assert sorted(p.name for p in bundle.iterdir()) == ["agent.yaml", "ca.crt", "pi-01.password"]
    assert (bundle / "pi-01.password").stat().st_mode & 0o777 == 0o600
    assert (bundle / "pi-01.password").read_text() == (root / "clients" / "pi-01.password").read_text()
    assert "systemctl reload mosquitto" in out
    assert main(["broker", "add-device", str(root), "pi-02", "--dataset", "digits", "--shard", "1",
                 "--num-shards", "3"]) == 0
    local = from_mapping(AgentConfig, yaml.safe_load((root / "devices" / "pi-02" / "agent.yaml").read_text()))
    local.validate()  # on this machine: the bundle's own files and a state directory in it
    assert local.broker.ca_file == str(root / "devices" / "pi-02" / "ca.crt")
    assert local.state_dir == str(root / "devices" / "pi-02" / "state")
    assert (local.data.dataset, local.data.shard, local.data.num_shards) == ("digits", 1, 3)
    assert main(["broker", "add-device", str(root), "pi-03", "--dataset", "digits", "--shard", "3",
                 "--num-shards", "3"]) == 2
    assert "--shard must be in 0..2" in capsys.readouterr().err
    assert main(["broker", "remove-device", str(root), "pi-02"]) == 0
    capsys.readouterr()
    # Flags that cannot work are refused before anything is made: no login, no broker.
    assert main(["broker", "add-device", str(root), "pi-04", "--dataset", "digitz"]) == 2
    assert main(["broker", "add-device", str(root), "pi-04", "--data-path", "d.npz", "--shard", "1"]) == 2
    assert main(["broker", "add-device", str(root), "pi-04", "--dataset", "digits", "--partition", "bogus"]) == 2
    assert "pi-04" not in BrokerDirectory.open(root).logins()
    assert main(["broker", "init", str(tmp_path / "other"), "--federation", "lab", "--rounds", "0"]) == 2
    assert not (tmp_path / "other").exists()
    capsys.readouterr()
    assert main(["broker", "list", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == ["coordinator (coordinator)", "pi-01"]
    assert main(["broker", "add-device", str(root), "pi-01"]) == 2
    assert "already has a login; pass --rotate" in capsys.readouterr().err
    assert main(["broker", "remove-device", str(root), "pi-01"]) == 0
    assert main(["broker", "remove-device", str(root), "pi-01"]) == 2
    assert "has no login here" in capsys.readouterr().err
    assert main(["broker", "add-device", str(tmp_path / "nowhere"), "pi-01"]) == 2
    assert "no broker made by `fedfit broker init`" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["broker", "init", str(afile / "broker"), "--federation", "lab"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the broker's files in {afile / 'broker'}: Not a directory" in err and "Traceback" not in err


@needs_openssl
def test_missing_openssl_is_one_sentence_and_blocks_no_later_init(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no openssl on it
    assert main(["broker", "init", str(tmp_path / "b"), "--federation", "lab"]) == 2
    assert "the 'openssl' command is not installed" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # the directory init made is gone again, no half-made broker in it
    monkeypatch.setenv("PATH", path)
    assert main(["broker", "init", str(tmp_path / "b"), "--federation", "lab"]) == 0

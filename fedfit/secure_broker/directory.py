"""A secured broker's directory, as ``fedfit broker init`` makes it and ``add-device`` extends it.

::

    DIR/broker.yaml       what init was given (federation, hosts, port, coordinator's username)
    DIR/ca.crt, ca.key    the fleet's certificate authority; ca.crt goes to every device, ca.key stays here
    DIR/server.crt, .key  the broker's TLS certificate and key
    DIR/passwd            Mosquitto's password file: one login per device and one for the coordinator
    DIR/acl               Mosquitto's ACL: every device pinned to its own topics
    DIR/mosquitto.conf    TLS listener, no anonymous clients, the two files above
    DIR/clients/NAME.password   each login's password (0600), to copy to that device only
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from common.durable import write_atomic
from common.mqtt_link import BrokerConfig
from fedfit.secure_broker.acl import acl_text
from fedfit.secure_broker.passwords import (
    hash_password,
    new_password,
    read_password_file,
    write_password_file,
)
from fedfit.secure_broker.pki import make_ca, make_server_certificate, subject_alt_names
from protocol import validate_name

DEFAULT_PORT = 8883  # MQTT over TLS


class BrokerSetupError(ValueError):
    """A broker directory cannot be made or changed as asked; the message says why."""


@dataclass(frozen=True)
class BrokerSettings:
    """What ``fedfit broker init`` was given; kept in ``broker.yaml``."""

    federation: str
    hosts: list[str] = field(default_factory=lambda: ["localhost", "127.0.0.1"])
    port: int = DEFAULT_PORT
    bind: str | None = None  # None: every interface
    coordinator: str = "coordinator"
    persistence: bool = True
    user: str | None = None  # the user mosquitto runs as when started as root (None: its default, "mosquitto")

    def validate(self) -> None:
        """Raises BrokerSetupError with one clear sentence."""
        try:
            validate_name(self.federation, "federation")
            validate_name(self.coordinator, "coordinator username")
        except ValueError as exc:
            raise BrokerSetupError(str(exc)) from None
        if not 0 < self.port < 65536:
            raise BrokerSetupError(f"the port must be in 1..65535, got {self.port}")
        if not self.hosts:
            raise BrokerSetupError("give at least one host name or address the devices connect to")
        try:  # before anything is written: these go into the certificate and mosquitto.conf
            subject_alt_names(self.hosts)
            if self.bind is not None:
                subject_alt_names([self.bind])
        except ValueError as exc:
            raise BrokerSetupError(str(exc)) from None


class BrokerDirectory:
    """Files of one secured Mosquitto; see the module's docstring for the layout."""

    def __init__(self, path: Path, settings: BrokerSettings) -> None:
        self.path = path
        self.settings = settings

    # ------------------------------------------------------------------ files
    @property
    def conf(self) -> Path:
        return self.path / "mosquitto.conf"

    @property
    def ca_file(self) -> Path:
        return self.path / "ca.crt"

    @property
    def password_file(self) -> Path:
        return self.path / "passwd"

    @property
    def acl_file(self) -> Path:
        return self.path / "acl"

    def client_password_file(self, name: str) -> Path:
        """Where the password of login ``name`` is kept for its device."""
        return self.path / "clients" / f"{name}.password"

    # -------------------------------------------------------------- lifecycle
    @classmethod
    def init(cls, path: Path, settings: BrokerSettings) -> BrokerDirectory:
        """Make a new directory: CA, server certificate, ACL, configuration and the coordinator's login."""
        settings.validate()
        if settings.user is not None:
            try:
                pwd.getpwnam(settings.user)
            except KeyError:
                raise BrokerSetupError(f"there is no user {settings.user!r} here for mosquitto to run as") from None
        path = path.resolve()
        if (path / "broker.yaml").exists():
            raise BrokerSetupError(f"{path} already holds a broker's files; add devices with "
                                   f"`fedfit broker add-device {path} NAME`, or choose another directory")
        made = not path.exists()
        try:
            (path / "clients").mkdir(parents=True, exist_ok=True)
            os.chmod(path / "clients", 0o700)
            directory = cls(path, settings)
            ca = make_ca(path, f"FedFit CA {settings.federation}")
            make_server_certificate(path, ca, settings.hosts)
            write_atomic(directory.acl_file, acl_text(settings.federation, settings.coordinator).encode(),
                         mode=0o640)
            write_atomic(directory.conf, directory.mosquitto_conf().encode(), mode=0o640)
            if settings.persistence:
                (path / "data").mkdir(exist_ok=True)
            directory.add_login(settings.coordinator, role="coordinator")  # also shares the broker's files with it
            write_atomic(path / "broker.yaml", yaml.safe_dump(asdict(settings), sort_keys=False).encode())
        except BaseException:
            if made:  # no half-made broker (a CA key without broker.yaml) stays behind
                shutil.rmtree(path, ignore_errors=True)
            raise
        return directory

    @classmethod
    def open(cls, path: Path) -> BrokerDirectory:
        """The directory ``fedfit broker init`` made at ``path``."""
        path = path.resolve()
        try:
            data = yaml.safe_load((path / "broker.yaml").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BrokerSetupError(f"{path} holds no broker made by `fedfit broker init` (no broker.yaml)") from None
        except (OSError, yaml.YAMLError) as exc:
            raise BrokerSetupError(f"cannot read {path / 'broker.yaml'}: {exc}") from exc
        try:
            settings = BrokerSettings(**data)
        except TypeError as exc:
            raise BrokerSetupError(f"{path / 'broker.yaml'} is not what `fedfit broker init` writes: {exc}") from None
        settings.validate()
        return cls(path, settings)

    def mosquitto_conf(self) -> str:
        """Mosquitto's configuration: one TLS listener, logins required, the ACL."""
        s = self.settings
        lines = [
            "# Written by `fedfit broker init`; run: mosquitto -c " + str(self.conf),
            "per_listener_settings false",
            *([f"user {s.user}"] if s.user else []),
            "allow_anonymous false",
            f"password_file {self.password_file}",
            f"acl_file {self.acl_file}",
            f"listener {s.port}" + (f" {s.bind}" if s.bind else ""),
            f"cafile {self.ca_file}",
            f"certfile {self.path / 'server.crt'}",
            f"keyfile {self.path / 'server.key'}",
            # A task crosses the broker as many chunks at once; the default queue of 1000 would drop some.
            "max_queued_messages 100000",
            "max_inflight_messages 100",
        ]
        if s.persistence:
            lines += ["persistence true", f"persistence_location {self.path / 'data'}/"]
        else:
            lines.append("persistence false")
        return "\n".join(lines) + "\n"

    def share_with_broker(self) -> None:
        """Let the broker's group read what it reads (password file, ACL, server key, persistence): when run as
        root, mosquitto drops to its own user, and these files are not for anyone else."""
        try:
            group = grp.getgrnam(self.settings.user or "mosquitto").gr_gid
        except KeyError:
            return  # no such group here: the files keep this user's group
        for path in (self.password_file, self.acl_file, self.conf, self.path / "server.key", self.path / "data"):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.chown(path, -1, group)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self.path / "data", 0o770)

    # ----------------------------------------------------------------- logins
    def logins(self) -> list[str]:
        """Usernames in the password file, the coordinator's included."""
        return list(read_password_file(self.password_file))

    def add_login(self, name: str, *, role: str = "device", rotate: bool = False) -> Path:
        """Give ``name`` a new random password; returns the file holding it. A device's name is its agent id.

        Refuses an existing login unless ``rotate`` (which replaces its password; the coordinator's too), and a
        new device named like the coordinator. The running broker reads the change on SIGHUP (``systemctl reload
        mosquitto``)."""
        try:
            validate_name(name, "device name" if role == "device" else "coordinator username")
        except ValueError as exc:
            raise BrokerSetupError(str(exc)) from None
        if role == "device" and name == self.settings.coordinator and not rotate:
            raise BrokerSetupError(f"{name!r} is the coordinator's username; give the device another name (or pass "
                                   f"--rotate to give the coordinator a new password)")
        entries = read_password_file(self.password_file)
        if name in entries and not rotate:
            raise BrokerSetupError(f"{name!r} already has a login; pass --rotate to give it a new password")
        password = new_password()
        entries[name] = hash_password(password)
        secret = self.client_password_file(name)
        write_atomic(secret, (password + "\n").encode(), mode=0o600)
        write_password_file(self.password_file, entries)
        self.share_with_broker()
        return secret

    def remove_login(self, name: str) -> None:
        """Take ``name``'s login away (not the coordinator's); the broker refuses it after its next reload."""
        if name == self.settings.coordinator:
            raise BrokerSetupError("the coordinator's login cannot be removed")
        entries = read_password_file(self.password_file)
        if name not in entries:
            raise BrokerSetupError(f"{name!r} has no login here (logins: {', '.join(entries) or 'none'})")
        del entries[name]
        write_password_file(self.password_file, entries)
        self.share_with_broker()
        self.client_password_file(name).unlink(missing_ok=True)

    def client_config(self, name: str, host: str | None = None) -> BrokerConfig:
        """The ``broker`` section of login ``name``'s daemon, with paths into this directory."""
        if name not in read_password_file(self.password_file):
            raise BrokerSetupError(f"{name!r} has no login here; add it with `fedfit broker add-device`")
        return BrokerConfig(host=host or self.settings.hosts[0], port=self.settings.port, username=name,
                            password_file=str(self.client_password_file(name)), tls=True, ca_file=str(self.ca_file))

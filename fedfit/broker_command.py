"""``fedfit broker``: make and extend a secured Mosquitto for a fleet (``init``, ``add-device``,
``remove-device``, ``list``)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from common.mqtt_link import BrokerConfig
from fedfit.secure_broker import DEFAULT_PORT, BrokerDirectory, BrokerSettings, BrokerSetupError

_RELOAD = "reload the running broker to apply it: systemctl reload mosquitto (or kill -HUP its process)"


def add_parser(sub: Any) -> None:
    """The ``broker`` subcommand and its own subcommands."""
    broker = sub.add_parser("broker", help="make a secured Mosquitto for a fleet: TLS, a login per device, ACL")
    actions = broker.add_subparsers(dest="action", required=True)
    init = actions.add_parser("init", help="make DIR: CA, server certificate, mosquitto.conf, password file, ACL "
                                           "and the coordinator's login")
    init.add_argument("dir", help="directory to create (refused if it already holds a broker)")
    init.add_argument("--federation", required=True, help="the federation the ACL is written for")
    init.add_argument("--host", action="append", default=None, metavar="NAME_OR_IP", dest="hosts",
                      help="a host name or address the devices connect to, named in the broker's certificate "
                           "(repeatable; default: localhost and 127.0.0.1)")
    init.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TLS listener port (default {DEFAULT_PORT})")
    init.add_argument("--bind", default=None, metavar="ADDRESS",
                      help="listen on this address only (default: every address)")
    init.add_argument("--coordinator", default="coordinator", help="the coordinator's username (default: coordinator)")
    init.add_argument("--no-persistence", action="store_true", help="keep no retained messages across restarts")
    init.add_argument("--user", default=None,
                      help="the user mosquitto switches to when started as root (default: its own, mosquitto); "
                           "the files it reads are given that user's group")
    add = actions.add_parser("add-device", help="give device NAME (its agent id) a login and print its broker "
                                                "section")
    add.add_argument("dir")
    add.add_argument("name", help="the device's agent id; the ACL pins it to its own topics")
    add.add_argument("--rotate", action="store_true", help="replace the password of an existing login")
    add.add_argument("--device-dir", default=None, metavar="PATH",
                     help="where ca.crt and NAME.password will be on the device (default: their paths here)")
    remove = actions.add_parser("remove-device", help="take device NAME's login away")
    remove.add_argument("dir")
    remove.add_argument("name")
    listing = actions.add_parser("list", help="print the logins")
    listing.add_argument("dir")


def _section(config: BrokerConfig, device_dir: str | None) -> str:
    """The ``broker:`` YAML section of a daemon's configuration."""
    if device_dir is not None:
        assert config.password_file is not None and config.ca_file is not None
        config = replace(config, password_file=str(Path(device_dir) / Path(config.password_file).name),
                         ca_file=str(Path(device_dir) / Path(config.ca_file).name))
    fields = {key: getattr(config, key) for key in ("host", "port", "tls", "ca_file", "username", "password_file")}
    return yaml.safe_dump({"broker": fields}, sort_keys=False).rstrip()


def run(args: argparse.Namespace) -> int:
    """Carry out ``fedfit broker ACTION``; errors are BrokerSetupError or PkiError (one sentence each)."""
    try:
        return _run(args)
    except OSError as exc:  # a directory that is a file, not writable, a full disk...
        where = f" ({exc.filename})" if exc.filename else ""
        raise BrokerSetupError(f"cannot write the broker's files in {args.dir}: {exc.strerror or exc}"
                               f"{where}") from exc


def _run(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if args.action == "init":
        settings = BrokerSettings(federation=args.federation, hosts=args.hosts or ["localhost", "127.0.0.1"],
                                  port=args.port, bind=args.bind, coordinator=args.coordinator,
                                  persistence=not args.no_persistence, user=args.user)
        directory = BrokerDirectory.init(path, settings)
        print(f"made {directory.path}: ca.crt, ca.key (keep it here), server.crt, server.key, passwd, acl, "
              f"mosquitto.conf")
        print(f"start the broker: mosquitto -c {directory.conf}")
        print(f"add each device: fedfit broker add-device {directory.path} AGENT_ID")
        print("\nthe coordinator's configuration:")
        print(_section(directory.client_config(settings.coordinator), None))
        return 0
    directory = BrokerDirectory.open(path)
    if args.action == "add-device":
        secret = directory.add_login(args.name, rotate=args.rotate)
        print(f"{'new password for' if args.rotate else 'login for'} {args.name!r} in {secret}; {_RELOAD}")
        if args.name == directory.settings.coordinator:
            print(f"give {secret} to the coordinator (only to it): its broker section is unchanged")
            return 0
        print(f"copy {directory.ca_file} and {secret} to the device (only to it), and put in its agent.yaml:")
        print(f"agent_id: {args.name}\nfederation: {directory.settings.federation}")
        print(_section(directory.client_config(args.name), args.device_dir))
        print(f"# under the shipped systemd unit, install {secret.name} as /etc/fedfit/broker.password and set\n"
              f"# password_file: /run/credentials/fedfit-agent.service/broker-password (see examples/agent.yaml)")
    elif args.action == "remove-device":
        directory.remove_login(args.name)
        print(f"removed {args.name!r}; {_RELOAD}")
    else:
        for name in directory.logins():
            print(name + (" (coordinator)" if name == directory.settings.coordinator else ""))
    return 0

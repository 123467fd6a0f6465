"""``fedfit broker``: make and extend a secured Mosquitto for a fleet (``init``, ``add-device``,
``remove-device``, ``list``).

``init`` writes ``DIR/coordinator.yaml``, a complete coordinator configuration for the broker (its federation
included), and ``add-device`` a bundle for the device, ``DIR/devices/NAME/``: its complete ``agent.yaml``, the
CA certificate and its password. Both print the configuration they wrote.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from common.data import DATASET_NAMES, parse_partition
from common.durable import write_atomic
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
    init.add_argument("--dataset", default="auto",
                      help="the coordinator's dataset in the coordinator.yaml written (default auto: fashion-mnist "
                           "when installed, else digits); the agents' data must have its shape")
    init.add_argument("--algorithm", default="heterofl", help="the algorithm in coordinator.yaml (default heterofl)")
    init.add_argument("--rounds", type=int, default=10, help="rounds in coordinator.yaml (default 10)")
    init.add_argument("--min-agents", type=int, default=1,
                      help="agents the first round waits for, in coordinator.yaml (default 1)")
    add = actions.add_parser("add-device", help="give device NAME (its agent id) a login and print its broker "
                                                "section")
    add.add_argument("dir")
    add.add_argument("name", help="the device's agent id; the ACL pins it to its own topics")
    add.add_argument("--rotate", action="store_true", help="replace the password of an existing login")
    add.add_argument("--device-dir", default=None, metavar="PATH",
                     help="where ca.crt and NAME.password will be on the device (default: the bundle DIR/devices/NAME "
                          "here, for an agent on this machine)")
    data = add.add_mutually_exclusive_group()
    data.add_argument("--data-path", default=None, metavar="PATH",
                      help="the device's own data: an .npz with x and y, or a folder of one sub-folder per label")
    data.add_argument("--dataset", default=None, help="a shard of a known dataset instead (fashion-mnist, digits)")
    add.add_argument("--shard", type=int, default=0, help="with --dataset: this device's shard (default 0)")
    add.add_argument("--num-shards", type=int, default=1, help="with --dataset: how many shards (default 1)")
    add.add_argument("--partition", default="iid", help="with --dataset: iid (default) or a non-IID partition")
    remove = actions.add_parser("remove-device", help="take device NAME's login away")
    remove.add_argument("dir")
    remove.add_argument("name")
    listing = actions.add_parser("list", help="print the logins")
    listing.add_argument("dir")


def _broker_fields(config: BrokerConfig, device_dir: str | None) -> dict[str, Any]:
    """The ``broker:`` section of a daemon's configuration, with the files where they will be (``device_dir``)."""
    if device_dir is not None:
        assert config.password_file is not None and config.ca_file is not None
        config = replace(config, password_file=str(Path(device_dir) / Path(config.password_file).name),
                         ca_file=str(Path(device_dir) / Path(config.ca_file).name))
    return {key: getattr(config, key) for key in ("host", "port", "tls", "ca_file", "username", "password_file")}


def coordinator_yaml(directory: BrokerDirectory, *, algorithm: str = "heterofl", dataset: str = "auto",
                     rounds: int = 10, min_agents: int = 1) -> str:
    """A complete coordinator configuration for this broker: federation, broker login, and a small first run."""
    settings = directory.settings
    body = {
        "federation": settings.federation,
        "broker": _broker_fields(directory.client_config(settings.coordinator), None),
        "algorithm": algorithm,
        "model": {"family": "cnn"},
        "data": {"dataset": dataset},
        "rounds": rounds,
        "min_agents": min_agents,
    }
    return ("# Written by `fedfit broker init`: every other setting has its default (see examples/coordinator.yaml).\n"
            + yaml.safe_dump(body, sort_keys=False))


def agent_yaml(directory: BrokerDirectory, name: str, device_dir: str | None, data: dict[str, Any],
               state_dir: str | None = None) -> str:
    """A complete agent configuration for device ``name``: its id, the federation, its login and its data
    (``state_dir``: where it keeps its calibration and the updates waiting for their ack; None: the default,
    systemd's StateDirectory under the shipped unit)."""
    body: dict[str, Any] = {
        "agent_id": name,
        "federation": directory.settings.federation,
        "broker": _broker_fields(directory.client_config(name), device_dir),
        "data": data,
    }
    if state_dir is not None:
        body["state_dir"] = state_dir
    return ("# Written by `fedfit broker add-device`: every other setting has its default (see examples/agent.yaml).\n"
            + yaml.safe_dump(body, sort_keys=False))


def _check_init(args: argparse.Namespace) -> None:
    """The coordinator.yaml flags of ``init``, checked before the broker is made (BrokerSetupError)."""
    if args.rounds < 1 or args.min_agents < 1:
        raise BrokerSetupError("--rounds and --min-agents must be at least 1")
    if args.dataset.strip().lower() not in (*DATASET_NAMES, "auto"):
        raise BrokerSetupError(f"--dataset must be one of {', '.join((*DATASET_NAMES, 'auto'))}, got {args.dataset!r}")


def _data_section(args: argparse.Namespace) -> dict[str, Any]:
    """The ``data:`` section of a device's agent.yaml from the flags (BrokerSetupError when they do not fit)."""
    if args.dataset is None and (args.shard != 0 or args.num_shards != 1 or args.partition != "iid"):
        raise BrokerSetupError("--shard, --num-shards and --partition go with --dataset (a shard of a known dataset)")
    if args.dataset is not None:
        if args.dataset.strip().lower() not in DATASET_NAMES:
            raise BrokerSetupError(f"--dataset must be one of {', '.join(DATASET_NAMES)}, got {args.dataset!r}")
        if args.num_shards < 1:
            raise BrokerSetupError(f"--num-shards must be at least 1, got {args.num_shards}")
        try:
            parse_partition(args.partition)
        except ValueError as exc:
            raise BrokerSetupError(f"--partition: {exc}") from None
        if not 0 <= args.shard < args.num_shards:
            raise BrokerSetupError(f"--shard must be in 0..{args.num_shards - 1} (--num-shards {args.num_shards}), "
                                   f"got {args.shard}")
        return {"dataset": args.dataset, "partition": args.partition, "num_shards": args.num_shards,
                "shard": args.shard}
    return {"path": args.data_path or "/var/lib/fedfit-agent/data.npz"}


def _bundle(directory: BrokerDirectory, name: str, secret: Path, text: str) -> Path:
    """``DIR/devices/NAME/``: what goes to the device (agent.yaml, ca.crt, its password), readable by the owner."""
    bundle = directory.path / "devices" / name
    bundle.mkdir(parents=True, exist_ok=True, mode=0o700)
    bundle.chmod(0o700)
    shutil.copyfile(directory.ca_file, bundle / directory.ca_file.name)
    write_atomic(bundle / secret.name, secret.read_bytes(), mode=0o600)
    write_atomic(bundle / "agent.yaml", text.encode(), mode=0o600)
    return bundle


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
        _check_init(args)  # before anything is made
        settings = BrokerSettings(federation=args.federation, hosts=args.hosts or ["localhost", "127.0.0.1"],
                                  port=args.port, bind=args.bind, coordinator=args.coordinator,
                                  persistence=not args.no_persistence, user=args.user)
        directory = BrokerDirectory.init(path, settings)
        print(f"made {directory.path}: ca.crt, ca.key (keep it here), server.crt, server.key, passwd, acl, "
              f"mosquitto.conf")
        print(f"start the broker: mosquitto -c {directory.conf}")
        print(f"add each device: fedfit broker add-device {directory.path} AGENT_ID [--dataset NAME --shard I "
              f"--num-shards N | --data-path PATH]")
        text = coordinator_yaml(directory, algorithm=args.algorithm, dataset=args.dataset, rounds=args.rounds,
                                min_agents=args.min_agents)
        write_atomic(directory.path / "coordinator.yaml", text.encode(), mode=0o600)
        print(f"run the coordinator: fedfit coordinator --config {directory.path / 'coordinator.yaml'}")
        print(f"\nthe coordinator's configuration: (written to {directory.path / 'coordinator.yaml'})")
        print(text.rstrip())
        return 0
    directory = BrokerDirectory.open(path)
    if args.action == "add-device":
        data = _data_section(args)  # checked before the login is made
        secret = directory.add_login(args.name, rotate=args.rotate)
        print(f"{'new password for' if args.rotate else 'login for'} {args.name!r} in {secret}; {_RELOAD}")
        if args.name == directory.settings.coordinator:
            print(f"give {secret} to the coordinator (only to it): its broker section is unchanged")
            return 0
        here = directory.path / "devices" / args.name
        # Run from the bundle on this machine, the agent keeps its state in it; on a device, where systemd says.
        text = agent_yaml(directory, args.name, args.device_dir or str(here), data,
                          None if args.device_dir else str(here / "state"))
        bundle = _bundle(directory, args.name, secret, text)
        print(f"the device's bundle is {bundle}: copy it to the device (only to it); on this machine run the agent "
              f"with: fedfit agent --config {bundle / 'agent.yaml'}")
        print(f"# under the shipped systemd unit, install {secret.name} as /etc/fedfit/agent.password and set\n"
              f"# password_file: /run/credentials/fedfit-agent.service/broker-password (scripts/install-agent.sh "
              f"does it)")
        print("its agent.yaml:")
        print(text.rstrip())
    elif args.action == "remove-device":
        directory.remove_login(args.name)
        print(f"removed {args.name!r}; {_RELOAD}")
    else:
        for name in directory.logins():
            print(name + (" (coordinator)" if name == directory.settings.coordinator else ""))
    return 0

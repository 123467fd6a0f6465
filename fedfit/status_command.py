"""``fedfit status``: the fleet of a federation as its broker's retained statuses show it, read-only.

It logs in with the broker section of a configuration file (the coordinator's ``coordinator.yaml`` reads every
agent's status; a device's ``agent.yaml`` only its own and the coordinator's, as the ACL of ``fedfit broker``
allows), subscribes to the statuses, prints the fleet (:mod:`fedfit.fleet_view`) and leaves; ``--watch`` prints it
again every ``--interval`` seconds until interrupted. It never publishes, and its client id is its own, so it
disturbs neither the coordinator nor an agent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from common.config import ConfigError, from_mapping, load_yaml
from common.logs import configure_logging
from common.mqtt_link import BrokerConfig, MqttLink
from fedfit.fleet_view import StatusBook, format_view, view_json
from protocol import ProtocolError, Topics, validate_name

#: Seconds the retained statuses have to arrive once the subscription is acknowledged (they come at once; a large
#: fleet's take a moment).
DEFAULT_WAIT_S = 1.0
CONNECT_TIMEOUT_S = 10.0


def add_parser(sub: Any) -> None:
    """The ``status`` subcommand."""
    status = sub.add_parser("status", help="show the fleet: each agent online or not, its memory, what it trains "
                                           "and last answered; the round in progress (read-only)")
    status.add_argument("--config", required=True,
                        help="a coordinator.yaml (or an agent.yaml): its federation and broker login are used")
    status.add_argument("--json", action="store_true", help="print the fleet as JSON (one object per refresh)")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    status.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                        help=f"seconds to collect the statuses after subscribing (default {DEFAULT_WAIT_S:g})")


def _connection(path: str) -> tuple[str, BrokerConfig]:
    """The federation and broker settings of a coordinator or agent configuration file (nothing else of it is
    read, so either kind serves)."""
    mapping = load_yaml(path)
    federation = mapping.get("federation", "default")
    if not isinstance(federation, str):
        raise ConfigError(f"{path}: federation must be a name, got {federation!r}")
    try:
        validate_name(federation, "federation")
    except ProtocolError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    broker = from_mapping(BrokerConfig, mapping.get("broker", {}), "broker")
    broker.validate()
    return federation, broker


def run(args: argparse.Namespace) -> int:
    """Print the fleet once, or every ``--interval`` seconds with ``--watch``."""
    if args.interval <= 0 or args.wait < 0:
        raise ConfigError("--interval must be above 0 and --wait at least 0")
    federation, broker = _connection(args.config)
    configure_logging("warning", sys.stderr)  # stdout is the fleet's (--json: one object a line)
    topics = Topics(federation)
    book = StatusBook(federation)
    link = MqttLink(client_id=f"fedfit-status-{federation}-{uuid.uuid4().hex[:8]}", broker=broker,
                    subscriptions=[topics.all_agent_status(), topics.coordinator_status()], handler=book.feed)
    link.start(timeout=CONNECT_TIMEOUT_S)
    try:
        time.sleep(args.wait)  # the broker sends the retained statuses right after the subscription
        while True:
            view, now = book.view(), time.time()
            if args.json:
                print(json.dumps(view_json(view, now), sort_keys=True), flush=True)
            else:
                print(format_view(view, now) + ("\n" if args.watch else ""), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
    finally:
        link.stop()

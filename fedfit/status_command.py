"""``fedfit status``: the fleet of a federation as its broker's retained statuses show it, read-only.

It logs in with the broker section of a configuration file (the coordinator's ``coordinator.yaml`` reads every
agent's status; a device's ``agent.yaml`` only its own and the coordinator's, as the ACL of ``fedfit broker``
allows), subscribes to the statuses, prints the fleet (:mod:`fedfit.fleet_view`) and leaves; ``--watch`` prints it
again every ``--interval`` seconds until interrupted, saying so at the top while the broker is unreachable (and
since when) until paho's reconnection brings the statuses back. It never publishes, and its client id is its own,
so it disturbs neither the coordinator nor an agent.

A simulated run's ``RUN/status.yaml`` (:mod:`fedfit.sim.status_file`) says whether its run goes on: once it has
ended (or its process is gone), the command says so, when and where its report is, instead of looking for a broker
that went with the run; ``--watch`` does the same when the run ends while it watches.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from common.config import ConfigError, from_mapping, load_yaml
from common.logs import configure_logging
from common.mqtt_link import BrokerConfig, BrokerUnavailable, MqttLink
from fedfit.fleet_view import StatusBook, format_view, outage_line, view_json
from fedfit.sim.status_file import RunMark, read_run_mark
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


def _connection(path: str, mapping: dict[str, Any]) -> tuple[str, BrokerConfig]:
    """The federation and broker settings of a coordinator or agent configuration file (``path``, read as
    ``mapping``; nothing else of it is read, so either kind serves)."""
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


def _run_over(path: Path) -> RunMark | None:
    """The run ``path`` is the status file of, when that run is over (ended, or its process gone); else None."""
    mark = read_run_mark(path, load_yaml(path))
    return mark if mark is not None and mark.over() is not None else None


def _say_over(mark: RunMark, args: argparse.Namespace, out: IO[str]) -> int:
    """Say that the run is over; 0 when it ended, 1 when it stopped without ending (killed, crashed)."""
    if args.json:
        print(json.dumps({"federation": None, "now": time.time(), "run": mark.as_json()}, sort_keys=True),
              file=out, flush=True)
    else:
        print(mark.over(), file=out, flush=True)
    return 0 if mark.state() == "ended" else 1


def run(args: argparse.Namespace) -> int:
    """Print the fleet once, or every ``--interval`` seconds with ``--watch``; or say that the run a simulated
    run's status file belongs to is over."""
    if args.interval <= 0 or args.wait < 0:
        raise ConfigError("--interval must be above 0 and --wait at least 0")
    path = Path(args.config)
    mapping = load_yaml(path)
    mark = read_run_mark(path, mapping)
    if mark is not None and mark.over() is not None:
        return _say_over(mark, args, sys.stdout)
    federation, broker = _connection(args.config, mapping)
    configure_logging("warning", sys.stderr)  # stdout is the fleet's (--json: one object a line)
    topics = Topics(federation)
    book = StatusBook(federation)
    link = MqttLink(client_id=f"fedfit-status-{federation}-{uuid.uuid4().hex[:8]}", broker=broker,
                    subscriptions=[topics.all_agent_status(), topics.coordinator_status()], handler=book.feed)
    run_over: Callable[[], RunMark | None] = (lambda: _run_over(path)) if mark is not None else (lambda: None)
    try:
        link.start(timeout=CONNECT_TIMEOUT_S)
    except BrokerUnavailable:
        over = run_over()  # the run ended (or died) while this command started
        if over is None:
            raise
        link.stop()
        return _say_over(over, args, sys.stdout)
    try:
        return show(link, book, args, sys.stdout, threading.Event(), run_over)
    finally:
        link.stop()


def show(link: MqttLink, book: StatusBook, args: argparse.Namespace, out: IO[str], stop: threading.Event,
         run_over: Callable[[], RunMark | None] = lambda: None) -> int:
    """Print the fleet ``book`` holds, once (after ``--wait`` seconds for the retained statuses), or with
    ``--watch`` every ``--interval`` seconds until ``stop`` is set. While ``link`` is without its broker, each
    refresh says so first; then a simulated run that ``run_over`` finds over ends the watch, saying so."""
    stop.wait(args.wait)  # the broker sends the retained statuses right after the subscription
    while True:
        view, now, down = book.view(), time.time(), link.down_for()
        lost_at = None if down is None else now - down
        if lost_at is not None and (over := run_over()) is not None:
            return _say_over(over, args, out)
        if args.json:
            print(json.dumps({**view_json(view, now), "broker": {"address": str(link.broker),
                                                                  "connected": lost_at is None, "lost_at": lost_at}},
                             sort_keys=True), file=out, flush=True)
        else:
            screen = format_view(view, now)
            if lost_at is not None:
                screen = outage_line(str(link.broker), lost_at, now) + "\n" + screen
            print(screen + ("\n" if args.watch else ""), file=out, flush=True)
        if not args.watch or stop.wait(args.interval):
            return 0

"""``fedfit deliver --config coordinator.yaml``: hand the agents online the trained models of a finished federation,
on request: a device that joined after the federation's end, one that was offline then, or a delivery a stop cut
short.

It runs the federation's coordinator for no round: the same login and ``state_dir``, resumed from its checkpoint
(:meth:`coordinator.daemon.Coordinator.deploy`), so the agents read its status as their coordinator's and report the
model they then hold. Run it while the coordinator daemon of that federation is not running (they share a client id
and a state directory). It waits for ``--agents`` agents (default the configuration's ``min_agents``) for up to
``--wait`` seconds (default ``wait_for_agents_s``), writes ``state_dir/models`` from the checkpoint, sends each agent
the largest trained model its budget runs, waits ``deployment.wait_s`` for their reports, and prints who holds what.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common.config import from_mapping, load_yaml

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """The ``deliver`` sub-command's arguments."""
    deliver = sub.add_parser(
        "deliver", help="send the agents online the trained models of a finished federation (on request)",
        description="Run the federation's coordinator for no round (its login and state_dir, resumed from its "
                    "checkpoint) and send each agent online the largest trained model its budget runs; while the "
                    "coordinator daemon is not running.")
    deliver.add_argument("--config", required=True, help="the coordinator's YAML (its broker login and state_dir)")
    deliver.add_argument("--agents", type=int, default=None, metavar="N",
                         help="agents to wait for (default: the configuration's min_agents)")
    deliver.add_argument("--wait", type=float, default=None, metavar="S",
                         help="seconds to wait for them (default: the configuration's wait_for_agents_s)")
    deliver.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                         help="default: warning")


def run(args: argparse.Namespace) -> int:
    """Deliver and print; 0 when every agent online holds a model of this run, 1 otherwise."""
    from common.logs import configure_logging
    from coordinator.config import CoordinatorConfig
    from coordinator.daemon import REGISTRY_SETTLE_S, Coordinator
    from coordinator.model_courier import holds
    from coordinator.strategies import check_algorithm

    configure_logging(args.log_level)
    mapping = load_yaml(args.config)
    mapping.pop("experiment", None)
    config = from_mapping(CoordinatorConfig, mapping, where="")
    check_algorithm(config.algorithm)
    config.resume = True
    config.validate()
    if not (Path(config.state_dir) / "checkpoint.safetensors").is_file():
        raise ValueError(f"state_dir {config.state_dir} holds no finished round (no checkpoint.safetensors): there is "
                         f"no model to deliver")
    if args.agents is not None and args.agents < 1 or args.wait is not None and not args.wait >= 0:
        raise ValueError("--agents must be at least 1 and --wait zero or more seconds")
    coordinator = Coordinator(config)
    coordinator.start()
    try:
        online = coordinator.registry.wait_settled(args.agents or config.min_agents, REGISTRY_SETTLE_S,
                                                   config.wait_for_agents_s if args.wait is None else args.wait)
        if not online:
            raise ValueError(f"no agent of federation '{config.federation}' came online within the wait: nothing "
                             f"was sent")
        outcome = coordinator.deploy()
    finally:
        coordinator.stop()
    if not outcome:
        raise ValueError("no model was written (no device trained one, or writing them failed: see the log)")
    for agent, held in sorted(outcome.items()):
        print(f"{agent}: {'holds ' + held.partition('@')[0] if holds(held) else 'none: ' + held}")
    kept = sum(1 for held in outcome.values() if holds(held))
    print(f"{kept} of {len(outcome)} agents online hold a model of this run ({config.state_dir}/models)",
          file=sys.stdout)
    return 0 if kept == len(outcome) else 1

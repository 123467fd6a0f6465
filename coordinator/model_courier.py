"""The trained models, handed to the devices that run them: once the last round is done, the run's deployable
models (each level some device trained, cut as the coordinator evaluated it: :mod:`coordinator.deployment`) are
written into ``state_dir/models``, and every agent online that reads protocol revision 8 is sent the largest trained
one its memory runs (:meth:`common.model_package.Manifest.for_budget` of the budget it reports), as a
:class:`~protocol.ModelDelivery` in chunks on its task topic. The agent checks every file against its digest, checks
that the model fits the memory it has now, stores it atomically beside its state and says so in its status report
(``name@sha256``); the courier waits up to ``deployment.wait_s`` for those reports and logs who holds what.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from common.data import Dataset
from common.logs import Logger
from common.model_package import Manifest, ModelEntry, manifest_to_dict, read_verified
from common.mqtt_link import MqttLink
from coordinator.config import CoordinatorConfig
from coordinator.deployable import TrainedSoFar
from coordinator.deployment import cut_models, write_models
from coordinator.evaluation import Evaluator
from coordinator.metrics import RoundResult
from coordinator.planning import model_options
from coordinator.registry import AgentRecord, FleetRegistry
from coordinator.strategies.base import Strategy
from coordinator.tasks import State
from models import ModelFamily
from protocol import MODEL_DELIVERY_REVISION, ModelDelivery, Topics, encode_parts, iter_chunks

__all__ = ["MODELS_DIR", "ModelCourier", "held_text", "holds", "one_model"]

#: Where in ``state_dir`` the run's deployable models are written.
MODELS_DIR = "models"
_HELD = re.compile(r"[^\s@]+@[0-9a-f]{64}")


def holds(outcome: str) -> bool:
    """Whether an agent's :attr:`ModelCourier.outcome` says it holds a model (``name@sha256``), not why it does not."""
    return _HELD.fullmatch(outcome) is not None


def held_text(entry: ModelEntry) -> str:
    """How an agent's report names the model it holds: ``name@sha256`` of its ONNX graph."""
    return f"{entry.name}@{entry.onnx.sha256}"


def one_model(manifest: Manifest, entry: ModelEntry) -> Manifest:
    """``manifest`` naming ``entry`` alone (what a device holds)."""
    return replace(manifest, models=(entry,))


def delivery(folder: Path, manifest: Manifest, entry: ModelEntry, agent_id: str) -> ModelDelivery:
    """The message handing ``entry`` of the model folder ``folder`` to ``agent_id``: its one-model manifest and its
    files, each read and checked against its digest."""
    files = (entry.onnx, entry.state, *entry.stages)
    weights = {file.path: np.frombuffer(read_verified(folder, file), dtype=np.uint8) for file in files}
    return ModelDelivery(f"model-{manifest.round}-{agent_id}", manifest.round, agent_id, entry.name,
                         manifest_to_dict(one_model(manifest, entry)), weights)


class ModelCourier:
    """Writes a finished run's models and hands each device its own (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, link: MqttLink, topics: Topics, registry: FleetRegistry,
                 log: Logger, *, reads_reports: Callable[[], bool] = lambda: True,
                 pace: Callable[[str], None] = lambda transfer: None) -> None:
        """``reads_reports``: whether the coordinator's status says it reads the agents' reports (only then do they
        say what they hold); ``pace(transfer)``: wait for room to send the next chunk (the dispatcher's)."""
        self.config = config
        self.link = link
        self.topics = topics
        self.registry = registry
        self.log = log
        self.reads_reports = reads_reports
        self.pace = pace
        self.folder = Path(config.state_dir) / MODELS_DIR
        #: Per agent, the model it holds (``name@sha256``) or why it holds none, once :meth:`deliver` ran.
        self.outcome: dict[str, str] = {}

    def write(self, strategy: Strategy, family: ModelFamily, dataset: Dataset, evaluator: Evaluator,
              states: Mapping[str, State], trained: TrainedSoFar, record: RoundResult | None,
              round_number: int) -> Manifest | None:
        """Write the run's trained models into ``state_dir/models`` (replacing an earlier export whole, never half);
        None when no device trained any."""
        models, _ = cut_models(strategy.eval_targets(), states, family, evaluator, trained, record)
        if not models:
            self.log.warning("no_model_to_deploy", message="no device trained any model of this run")
            return None
        partial = self.folder.with_name(f".{MODELS_DIR}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        manifest = write_models(partial, models, family, dataset, evaluator, algorithm=self.config.algorithm,
                                family_name=self.config.model.family, model_options=model_options(self.config),
                                round_number=round_number, source=str(Path(self.config.state_dir).resolve()))
        replaced = self.folder.with_name(f".{MODELS_DIR}.replaced")  # an earlier run's, moved aside, then gone
        shutil.rmtree(replaced, ignore_errors=True)
        if self.folder.exists():
            os.replace(self.folder, replaced)
        os.replace(partial, self.folder)
        shutil.rmtree(replaced, ignore_errors=True)
        self.log.info("models_written", folder=str(self.folder), models=[entry.name for entry in manifest.models])
        return manifest

    def finish(self, strategy: Strategy, family: ModelFamily, dataset: Dataset, evaluator: Evaluator,
               states: Mapping[str, State], trained: TrainedSoFar, record: RoundResult | None,
               round_number: int) -> dict[str, str]:
        """The end of a federation: :meth:`write` the models, then :meth:`deliver` them. A failure is logged, not
        raised: the federation's training stands whatever becomes of its models (empty outcome)."""
        try:
            manifest = self.write(strategy, family, dataset, evaluator, states, trained, record, round_number)
            return self.deliver(manifest) if manifest is not None else {}
        except Exception as exc:  # noqa: BLE001 - an exporter's or a file's failure must not fail the federation
            self.log.error("models_not_delivered", error=f"{type(exc).__name__}: {exc}",
                           message="the run's models could not be written or delivered; fedfit export RUN_DIR "
                                   "writes them from the checkpoint")
            return {}

    def choose(self, manifest: Manifest, agent: AgentRecord) -> ModelEntry | str:
        """The model ``agent`` gets, or why it gets none."""
        if agent.capabilities is None or agent.capabilities.protocol_version < MODEL_DELIVERY_REVISION:
            return "its protocol revision predates model delivery"
        budget = agent.budget()
        entry = manifest.for_budget(budget) if budget is not None else None
        if entry is None:
            return f"no trained model runs within its {(budget or 0) / 2**20:.1f} MiB"
        return entry

    def deliver(self, manifest: Manifest) -> dict[str, str]:
        """Send each agent online its model and wait for their reports; returns, per agent, the model it holds
        (``name@sha256``) or why it holds none of this run's."""
        outcome: dict[str, str] = {}
        expected: dict[str, str] = {}
        for agent in self.registry.online():
            chosen = self.choose(manifest, agent)
            if isinstance(chosen, str):
                outcome[agent.agent_id] = chosen
                self.log.info("model_not_sent", agent=agent.agent_id, reason=chosen)
                continue
            message = delivery(self.folder, manifest, chosen, agent.agent_id)
            sent = 0
            for chunk in iter_chunks(encode_parts(message), message.delivery_id):
                self.pace(message.delivery_id)
                self.link.publish(self.topics.agent_task(agent.agent_id), chunk)
                sent += len(chunk)
            expected[agent.agent_id] = held_text(chosen)
            self.log.info("model_sent", agent=agent.agent_id, model=chosen.name, bytes=sent)
        if expected and not self.reads_reports():  # an agent older than revision 5 is online: none reports
            for agent_id, held in expected.items():
                outcome[agent_id] = (f"sent {held}; not confirmed: an agent older than protocol revision 5 is online, "
                                     f"so none reports what it holds")
            self.log.warning("models_not_confirmed", sent=len(expected),
                             reason="an agent older than protocol revision 5 is online: no agent reports")
            self.outcome = outcome
            return outcome

        def answered(record: AgentRecord | None, held: str) -> str | None:
            """What the agent said of the model sent: it holds it (``held``), it refused it (why), or nothing yet."""
            if record is None:
                return None
            if record.model == held:
                return held
            if record.model_refused.startswith(f"{held}: "):
                return f"refused {record.model_refused}"
            return None

        def all_answered(records: Mapping[str, AgentRecord]) -> bool:
            return all(answered(records.get(agent_id), held) is not None for agent_id, held in expected.items())

        wait = self.config.deployment.wait_s
        self.registry.wait_until(all_answered, wait)
        for agent_id, held in expected.items():
            said = answered(self.registry.get(agent_id), held)
            outcome[agent_id] = said if said is not None else f"did not say it holds {held} within {wait:g} s"
            if said != held:
                self.log.warning("model_not_held", agent=agent_id, model=held, outcome=outcome[agent_id])
        self.log.info("models_delivered", held=sum(1 for agent_id in expected if holds(outcome[agent_id])),
                      sent=len(expected), online=len(outcome))
        self.outcome = outcome
        return outcome

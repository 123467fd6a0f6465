"""What a finished round reports: each device's task record and outcome, the verdicts devices hear, the accuracy of
every evaluation target, the deployable model, and the round's result as `metrics.jsonl` keeps it
(:func:`review` does it all for a closed round)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from common.logs import Logger
from common.mqtt_link import MqttLink
from coordinator import deployable
from coordinator.evaluation import Evaluator
from coordinator.intake import spec_or_none
from coordinator.metrics import RoundResult, TaskRecord, TaskStatus, round_timing
from coordinator.round import Answer, Round
from coordinator.strategies.base import Strategy
from coordinator.tasks import EvalTarget, State, TaskOutcome
from models import ModelFamily, SubmodelSpec
from protocol import Ack, Topics, encode


def outcomes(current: Round, family: ModelFamily, log: Logger,
             carried: Collection[str] = ()) -> tuple[dict[str, TaskRecord], list[TaskOutcome]]:
    """Every selected agent's record (skipped, missing or answered) and how every task ended, for the strategy
    (answered tasks by task id, then the missing ones); the ``carried`` tasks (a buffered round's, still training,
    to be answered in a later round) are neither."""
    records = {s.agent_id: TaskRecord(s.agent_id, "-", TaskStatus.SKIPPED, "-", reason=s.reason)
               for s in current.skipped}
    ended: list[TaskOutcome] = []
    for task_id, answer in sorted(current.answers.items()):
        update, record = answer.update, answer.record
        records[update.agent_id] = record
        if answer.rejection is not None:
            log.warning("update_rejected", agent=update.agent_id, task=task_id, reason=answer.rejection)
        ended.append(TaskOutcome(current.tasks[task_id].task, record.status,
                                 answer.spec if answer.aggregated else None, dict(update.metrics),
                                 update.reason, spec_or_none(update.spec_trained)))
    now = time.time()
    for task_id, dispatched in current.tasks.items():
        if task_id not in current.answers and task_id not in carried:
            task = dispatched.task
            reason = ("no update by deadline" if current.buffer_size is None or dispatched.deadline <= now else
                      f"still training after {current.number - dispatched.round + 1} rounds: carried no further "
                      f"(buffered.max_staleness {current.max_staleness})")
            records[task.agent_id] = TaskRecord(task.agent_id, task.level, TaskStatus.MISSING, task.spec.describe(),
                                                reason=reason, params_sent=family.param_count(task.spec))
            ended.append(TaskOutcome(task, TaskStatus.MISSING, None, {}))
    return records, ended


def send_verdicts(current: Round, link: MqttLink, topics: Topics, log: Logger) -> list[tuple[Ack, str]]:
    """Tell every device whose stored update was screened whether it is aggregated or, with the reason, not.
    Returns each verdict with the sha256 of the update it judged (sent or not)."""
    verdicts: list[tuple[Ack, str]] = []
    for task_id, answer in sorted(current.answers.items(), key=lambda item: item[1].update.agent_id):
        if not answer.screened:
            continue
        agent, reason = answer.update.agent_id, answer.rejection
        ack = Ack(task_id, current.tasks[task_id].round, agent, reason, "rejected" if reason else "aggregated")
        verdicts.append((ack, answer.digest))
        try:  # best effort: the round is stored already, and the device's uplink settled at the first ack
            link.publish(topics.agent_ack(agent), encode(ack))
        except Exception as exc:  # noqa: BLE001 - one device's verdict never ends the round
            log.warning("verdict_not_sent", agent=agent, round=current.number, error=str(exc))
    return verdicts


def trained(targets: Mapping[str, EvalTarget], family: ModelFamily, aggregated: Sequence[Answer],
            trains: Callable[[SubmodelSpec, Mapping[str, EvalTarget]], set[str]]) -> tuple[list[str], list[int]]:
    """Which evaluation targets some aggregated update trained (``trains(spec, targets)``: those an update of that
    spec trains, :meth:`Strategy.trained_targets`; an ensemble when some update reached one of its outputs), and which
    outputs of the global model (1-based, depth order: its exits, then its final head) some update's tensors
    reached."""
    global_spec = targets["global"].spec
    heads = [set(family.head_keys(block)) for block in (*sorted(global_spec.exits), None)]
    exits = [number for number, keys in enumerate(heads, start=1) if any(keys & answer.keys for answer in aggregated)]
    named = set().union(set(), *(trains(answer.spec, targets) for answer in aggregated if answer.spec is not None))
    levels = sorted(name for name, target in targets.items() if name != "global" and (
        name in named if not target.ensemble else bool(exits)))
    return levels, exits


def evaluate_targets(evaluator: Evaluator, targets: Mapping[str, EvalTarget], states: dict[str, State],
                     members: Sequence[int] = ()) -> dict[str, list[float]]:
    """Accuracy of every output of each evaluation target (a model shared by several targets is evaluated once;
    an ensemble's over the outputs ``members``, 0-based, none: all); the BN statistics of ``store_bn`` targets are
    written into their group's state in ``states``."""
    results: dict[str, list[float]] = {}
    done: dict[tuple[str, SubmodelSpec], tuple[list[float], dict[str, torch.Tensor]]] = {}
    ensembles = {(target.group, target.spec) for target in targets.values() if target.ensemble}
    for name, target in targets.items():
        key = (target.group, target.spec)
        if key not in done:  # with the ensemble's accuracy last when some target of this model asks for it
            done[key] = evaluator.evaluate(states[target.group], target.spec, ensemble=key in ensembles,
                                           members=members if key in ensembles else ())
        accuracies, bn_state = done[key]
        if target.store_bn:
            store_bn(states[target.group], bn_state)
        results[name] = accuracies[-1:] if target.ensemble else accuracies[:-1] if key in ensembles else accuracies
    return results


def store_bn(state: State, bn_state: Mapping[str, torch.Tensor]) -> None:
    """Write a sub-model's BN statistics into the leading slices of the global tensors they belong to."""
    for key, value in bn_state.items():
        target = state[key]
        if value.shape == target.shape:
            state[key] = value
        else:
            target = target.clone()
            region = target
            for dim, size in enumerate(value.shape):
                region = region.narrow(dim, 0, size)
            region.copy_(value)
            state[key] = target


def round_result(current: Round, records: Mapping[str, TaskRecord], accuracies: Mapping[str, list[float]],
                 trained_outputs: tuple[list[str], list[int]], bytes_down: int, seconds: float,
                 deployed: tuple[str, float] | None = None, *, levels_evaluated: bool = True) -> RoundResult:
    """The round as `metrics.jsonl` keeps it: accuracies (the global model's outputs, each level's last, the
    ``deployed`` model's: `coordinator.deployable`; ``levels_evaluated`` False: the other levels were not
    evaluated), who took part, traffic, what was trained and where the time went."""
    global_outputs = accuracies["global"]
    levels, exits = trained_outputs
    return RoundResult(
        round=current.number,
        global_accuracy=global_outputs[-1],
        level_accuracy={name: outputs[-1] for name, outputs in accuracies.items() if name != "global"},
        exit_accuracy={f"exit{i}": acc for i, acc in enumerate(global_outputs, start=1)}
        if len(global_outputs) > 1 else {},
        participants=sum(1 for _ in current.aggregated()),
        selected=sum(1 for task in current.tasks.values() if task.round == current.number) + len(current.skipped),
        bytes_down=bytes_down,
        bytes_up=current.bytes_up,
        seconds=round(seconds, 3),
        tasks=[records[agent] for agent in sorted(records)],
        trained_levels=levels,
        trained_exits=[f"exit{i}" for i in exits] if len(global_outputs) > 1 else [],
        timing=round_timing(current.timing, current.device_times()),
        carried=sum(1 for task in current.tasks.values() if task.round != current.number),
        deployed=deployed[0] if deployed is not None else "global",
        deployed_accuracy=deployed[1] if deployed is not None else None,
        levels_evaluated=levels_evaluated,
    )


@dataclass
class RoundReview:
    """A closed round, reviewed: every selected agent's record, every target's accuracy, what its updates trained
    (levels, and outputs of the global model) and the deployable model with its accuracy."""

    current: Round
    records: dict[str, TaskRecord]
    accuracies: dict[str, list[float]]
    trained: tuple[list[str], list[int]]
    deployed: tuple[str, float]
    every_target: bool = True
    #: What the round spent of the run's privacy (`coordinator.privacy.guard`), None when off.
    privacy: dict[str, Any] | None = None
    #: How the round's secure exchange went (`coordinator.secure`), None when off.
    secure: dict[str, Any] | None = None

    def result(self, bytes_down: int, seconds: float) -> RoundResult:
        """The round as `metrics.jsonl` keeps it, its traffic and wall time so far included."""
        return replace(round_result(self.current, self.records, self.accuracies, self.trained, bytes_down, seconds,
                                    self.deployed, levels_evaluated=self.every_target), privacy=self.privacy,
                       secure=self.secure)


def review(current: Round, strategy: Strategy, family: ModelFamily, evaluator: Evaluator, states: dict[str, State],
           trained_so_far: deployable.TrainedSoFar, carried: Collection[str], log: Logger, *,
           every_target: bool = True) -> RoundReview:
    """Review a closed round: tell the strategy how every task ended (the ``carried`` ones are still training),
    add what its updates trained to ``trained_so_far``, evaluate every target of ``states`` (the time it takes in
    the round's ``evaluation`` timing; without ``every_target``, only the global model, its ensembles and the
    deployable model) and pick the deployable model."""
    records, ended = outcomes(current, family, log, carried=carried)
    strategy.observe(current.number, ended)
    targets = strategy.eval_targets()
    trained_now = trained(targets, family, list(current.aggregated()), strategy.trained_targets)
    trained_so_far.add(*trained_now)
    chosen = deployable.deployed_name(targets, family, trained_so_far)
    # between level evaluations: the global model, its ensembles, the deployable model, and what shares their models
    models = {(target.group, target.spec) for name, target in targets.items()
              if name in (deployable.GLOBAL, chosen) or target.ensemble}
    evaluated = targets if every_target else {name: target for name, target in targets.items()
                                              if (target.group, target.spec) in models}
    started = time.perf_counter()
    accuracies = evaluate_targets(evaluator, evaluated, states, trained_so_far.members())
    current.timing["evaluation"] = time.perf_counter() - started
    return RoundReview(current, records, accuracies, trained_now, (chosen, accuracies[chosen][-1]), every_target)

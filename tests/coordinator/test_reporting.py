"""What a finished round reports (coordinator.reporting) on its own: how each task ended (records, and the
outcomes told to the strategy), the verdicts devices hear, what the aggregated updates trained, the evaluation
of every target (a model evaluated once, BN statistics stored where asked and only into the keys they hold),
the round's result and the whole review. Rounds are real, over a small CNN family's specs, with an intake that
measures each update by its largest value; the evaluator and the strategy are stand-ins that record what they
are asked."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from coordinator import reporting
from coordinator.config import ScreeningConfig
from coordinator.deployable import TrainedSoFar
from coordinator.metrics import TaskRecord, TaskStatus
from coordinator.round import Answer, DispatchedTask, Examined, Round
from coordinator.screening import Change
from coordinator.strategies import EvalTarget, TaskOutcome, TaskPlan, TaskResult
from coordinator.strategies.base import Skip, State
from models import SubmodelSpec, get_family
from protocol import Ack, BytesLike, Topics, TrainingPlan, Update, UpdateStatus, decode

FAMILY = get_family("cnn", 10, 1, hidden=[4, 8, 16, 32])
#: The global model: three outputs (exits after blocks 1 and 2, then the final head); two levels inside it.
GLOBAL = SubmodelSpec(exits=(1, 2))
SMALL = SubmodelSpec(width=0.25, exits=(1, 2))
MID = SubmodelSpec(width=0.5, exits=(1, 2))
#: The most an honest run moves a weight here: an update filled with more is beyond its plan's reach.
BOUND = 1.0
TOPICS = Topics("report")
EXIT1, FINAL = FAMILY.head_keys(1), FAMILY.head_keys(None)


class RecordingLink:
    """The link as send_verdicts uses it: every message kept, decoded, by topic; a publish to an agent in
    ``failing`` raises."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.failing: set[str] = set()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        if any(topic == TOPICS.agent_ack(agent) for agent in self.failing):
            raise OSError("the link is down")
        self.sent.append((topic, decode(payload)))
        return True


class RecordingLog:
    """A logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def debug(self, event: str, **fields: Any) -> None:
        self.events.append(("debug", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.events.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append(("warning", event, fields))

    def error(self, event: str, **fields: Any) -> None:
        self.events.append(("error", event, fields))

    def exception(self, event: str, **fields: Any) -> None:
        self.events.append(("exception", event, fields))

    def bind(self, **fields: Any) -> RecordingLog:
        return self

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for _, name, fields in self.events if name == event]


class CountingAggregate:
    """A round's aggregate that only counts what is folded in."""

    def __init__(self) -> None:
        self.folded: list[str] = []
        self.failure: str | None = None
        self.left_out: dict[str, str] = {}

    def add(self, result: TaskResult) -> None:
        self.folded.append(result.task.agent_id)

    def fresh(self) -> CountingAggregate:
        return CountingAggregate()

    def result(self) -> dict[str, State]:
        return {}


class Harness:
    """A collecting round of ``tasks`` (and the ``carried`` ones) whose intake reads an update's tensors as
    its result and measures it by its largest value (beyond :data:`BOUND`: rejected); one with negative
    samples is refused."""

    def __init__(self, tasks: Mapping[str, TaskPlan], *, number: int = 1, skipped: Sequence[Skip] = (),
                 carried: Sequence[DispatchedTask] = (), buffer_size: int | None = None,
                 max_staleness: int = 0, deadline: float | None = None) -> None:
        self.aggregate = CountingAggregate()
        deadline = time.time() + 60 if deadline is None else deadline
        aggregate: Any = self.aggregate  # a RoundAggregate as far as the round can tell
        screening = ScreeningConfig(min_peers=100)  # rule 1 (the plan's reach) only
        self.round = Round(number, dict(tasks), list(skipped), deadline, aggregate, screening, self,
                           carried=carried, buffer_size=buffer_size, max_staleness=max_staleness)
        self.round.open()

    def examine(self, update: Update, task: TaskPlan) -> Examined:
        record = TaskRecord(update.agent_id, task.level, TaskStatus.answered(update.status),
                            task.spec.describe(), reason=update.reason, num_samples=update.num_samples,
                            metrics=dict(update.metrics), params_sent=FAMILY.param_count(task.spec))
        if not update.status.trained:
            return Examined(record)
        if update.num_samples < 0:
            record.status = TaskStatus.REJECTED
            return Examined(record, refusal="update rejected: negative samples")
        spec = SubmodelSpec.from_dict(update.spec_trained) if update.spec_trained is not None else task.spec
        state = {key: torch.from_numpy(np.array(value)) for key, value in update.weights.items()}
        return Examined(record, TaskResult(task, spec, state, {}, update.num_samples, list(update.labels)))

    def store(self, update: Update, payload: BytesLike) -> None:
        pass

    def measure(self, result: TaskResult, sent_round: int) -> Change:
        return Change(max(float(value.abs().max()) for value in result.state.values()), 1, 1.0, BOUND)

    def rebase(self, result: TaskResult, sent_round: int, round_number: int) -> TaskResult:
        return result

    def reload(self, task_id: str, task: TaskPlan) -> TaskResult:
        raise AssertionError("no update is read back here")

    def offer(self, update: Update, size: int = 100) -> None:
        """Hand ``update`` to the round as it arrived (``size`` bytes, its digest named after its agent)."""
        receipt = self.round.receive(update, bytes(size), f"sha-{update.agent_id}")
        assert receipt.verdict == "accepted", receipt

    def closed(self) -> Round:
        self.round.close()
        self.round.finish()
        return self.round


def plan(agent: str, spec: SubmodelSpec = SMALL, level: str = "small") -> TaskPlan:
    return TaskPlan(agent, level, spec, TrainingPlan())


def update(task_id: str, agent: str, *, status: str = "ok", fill: float = 0.5, keys: Sequence[str] = EXIT1,
           spec: SubmodelSpec | None = None, samples: int = 10, round_number: int = 1,
           reason: str | None = None) -> Update:
    """An answer to ``task_id``: for a trained status, ``keys`` filled with ``fill`` (``spec``: the one it
    names)."""
    weights = {key: np.full(2, fill, np.float32) for key in keys} if UpdateStatus(status).trained else {}
    named = spec.to_dict() if spec is not None else None
    return Update(task_id, round_number, agent, UpdateStatus(status), named, samples, [0, 1], weights,
                  {"loss": 0.5}, reason)


class Evaluator:
    """A stand-in evaluator: accuracies by the spec's width (one per output, then the ensemble's), the BN
    statistics given in ``bn`` by spec, and every call kept."""

    def __init__(self, bn: Mapping[SubmodelSpec, dict[str, torch.Tensor]] | None = None) -> None:
        self.bn = bn or {}
        self.calls: list[tuple[SubmodelSpec, bool, tuple[int, ...]]] = []

    @staticmethod
    def accuracies(spec: SubmodelSpec, ensemble: bool = False) -> list[float]:
        outputs = [spec.width * number / 10 for number in range(1, len(spec.exits) + 2)]
        return [*outputs, spec.width] if ensemble else outputs

    def evaluate(self, state: Mapping[str, torch.Tensor], spec: SubmodelSpec, *, ensemble: bool = False,
                 members: Sequence[int] = ()) -> tuple[list[float], dict[str, torch.Tensor]]:
        self.calls.append((spec, ensemble, tuple(members)))
        return self.accuracies(spec, ensemble), dict(self.bn.get(spec, {}))


class Strategy:
    """A stand-in strategy: the evaluation ``targets``, the default rule for what an update trained (its spec
    is the target's), and every round's outcomes kept."""

    def __init__(self, targets: dict[str, EvalTarget]) -> None:
        self.targets = targets
        self.observed: list[tuple[int, list[TaskOutcome]]] = []

    def observe(self, round_number: int, outcomes: Sequence[TaskOutcome]) -> None:
        self.observed.append((round_number, list(outcomes)))

    def eval_targets(self) -> dict[str, EvalTarget]:
        return dict(self.targets)

    def trained_targets(self, spec: SubmodelSpec, targets: Mapping[str, EvalTarget]) -> set[str]:
        return {name for name, target in targets.items() if name != "global" and target.spec == spec}


TARGETS = {"global": EvalTarget("global", GLOBAL, store_bn=True), "small": EvalTarget("global", SMALL),
           "mid": EvalTarget("global", MID)}


# ----------------------------------------------------------------------------------------------- outcomes
def test_every_selected_agent_gets_a_record_and_every_task_an_outcome_answered_first_then_missing() -> None:
    tasks = {"t1": plan("ok"), "t2": plan("declined"), "t3": plan("refused"), "t4": plan("rejected"),
             "t5": plan("silent", MID, "mid")}
    harness = Harness(tasks, skipped=[Skip("skipped", "no memory")])
    harness.offer(update("t1", "ok", spec=SMALL))
    harness.offer(update("t2", "declined", status="declined", reason="too small"))
    harness.offer(update("t3", "refused", samples=-1))
    harness.offer(update("t4", "rejected", fill=5 * BOUND, spec=SMALL))
    log = RecordingLog()
    records, ended = reporting.outcomes(harness.closed(), FAMILY, log)
    assert {agent: record.status for agent, record in records.items()} == {
        "ok": "ok", "declined": "declined", "refused": "rejected", "rejected": "rejected",
        "silent": "missing", "skipped": "skipped"}
    assert (records["skipped"].level, records["skipped"].reason) == ("-", "no memory")
    silent = records["silent"]
    assert (silent.level, silent.reason, silent.spec_sent) == ("mid", "no update by deadline", MID.describe())
    assert silent.params_sent == FAMILY.param_count(MID)
    assert [(o.task.agent_id, o.status) for o in ended] == [  # answered by task id, then missing; no skip
        ("ok", "ok"), ("declined", "declined"), ("refused", "rejected"), ("rejected", "rejected"),
        ("silent", "missing")]
    by_agent = {outcome.task.agent_id: outcome for outcome in ended}
    assert by_agent["ok"].spec_trained == SMALL and by_agent["ok"].metrics == {"loss": 0.5}
    rejected = by_agent["rejected"]
    assert rejected.spec_trained is None and rejected.spec_tried == SMALL  # tried it; not aggregated
    assert by_agent["declined"].reason == "too small" and by_agent["refused"].spec_trained is None
    assert [fields["agent"] for fields in log.named("update_rejected")] == ["rejected"]  # screened out


def test_carried_tasks_are_left_out_and_one_carried_no_further_says_why() -> None:
    carried = [DispatchedTask("r3-old", 3, plan("old"), time.time() + 60),
               DispatchedTask("r4-young", 4, plan("young"), time.time() + 60)]
    harness = Harness({"r5-fresh": plan("fresh")}, number=5, carried=carried, buffer_size=0, max_staleness=2,
                      deadline=time.time() - 1)  # the fresh task's deadline passed; the carried ones' did not
    records, ended = reporting.outcomes(harness.round, FAMILY, RecordingLog(),
                                        carried={"r4-young"})
    assert set(records) == {"fresh", "old"} and [o.task.agent_id for o in ended] == ["fresh", "old"]
    assert records["fresh"].reason == "no update by deadline"
    assert records["old"].reason == ("still training after 3 rounds: carried no further "
                                     "(buffered.max_staleness 2)")


# ----------------------------------------------------------------------------------------------- verdicts
def test_one_verdict_per_screened_update_goes_to_its_agent_in_agent_order_with_the_digest_it_judged() -> None:
    tasks = {"t1": plan("zed"), "t2": plan("amy"), "t3": plan("max"), "t4": plan("bob"), "t5": plan("cat")}
    carried = [DispatchedTask("r1-eve", 1, plan("eve"), time.time() + 60)]
    harness = Harness(tasks, number=2, carried=carried)
    for task_id, agent in (("t1", "zed"), ("t2", "amy"), ("r1-eve", "eve")):
        harness.offer(update(task_id, agent, round_number=1 if task_id == "r1-eve" else 2))
    harness.offer(update("t3", "max", status="declined", round_number=2))  # not screened: no verdict
    harness.offer(update("t4", "bob", samples=-1, round_number=2))  # refused at its ack: no verdict
    harness.offer(update("t5", "cat", fill=5 * BOUND, round_number=2))  # screened out
    current = harness.closed()
    link = RecordingLink()
    verdicts = reporting.send_verdicts(current, link, TOPICS, RecordingLog())  # type: ignore[arg-type]
    rejection = current.answers["t5"].rejection
    assert rejection is not None and rejection.startswith("update rejected")
    expected = [Ack("t2", 2, "amy", None, "aggregated"), Ack("t5", 2, "cat", rejection, "rejected"),
                Ack("r1-eve", 1, "eve", None, "aggregated"),  # a carried task's verdict names its own round
                Ack("t1", 2, "zed", None, "aggregated")]
    assert link.sent == [(TOPICS.agent_ack(ack.agent_id), ack) for ack in expected]
    assert verdicts == [(ack, f"sha-{ack.agent_id}") for ack in expected]


def test_a_verdict_that_cannot_be_sent_is_logged_and_the_others_still_go() -> None:
    harness = Harness({"t1": plan("a"), "t2": plan("b"), "t3": plan("c")})
    for task_id, agent in (("t1", "a"), ("t2", "b"), ("t3", "c")):
        harness.offer(update(task_id, agent))
    link, log = RecordingLink(), RecordingLog()
    link.failing.add("b")
    verdicts = reporting.send_verdicts(harness.closed(), link, TOPICS, log)  # type: ignore[arg-type]
    assert [ack.agent_id for ack, _ in verdicts] == ["a", "b", "c"]  # returned, sent or not
    assert [message.agent_id for _, message in link.sent] == ["a", "c"]
    assert [fields["agent"] for fields in log.named("verdict_not_sent")] == ["b"]


# ----------------------------------------------------------------------------------------------- trained
def answer(spec: SubmodelSpec | None, keys: Sequence[str]) -> Answer:
    """An aggregated update of ``spec`` whose tensors are ``keys``."""
    record = TaskRecord("a", "small", TaskStatus.OK, "-")
    return Answer(update("t", "a"), 10, "", record, spec=spec, keys=frozenset(keys),
                  change=Change(0.5, 1, 1.0, None))


def test_trained_names_the_levels_the_updates_trained_and_the_outputs_their_tensors_reached() -> None:
    asked: list[SubmodelSpec] = []

    def trains(spec: SubmodelSpec, targets: Mapping[str, EvalTarget]) -> set[str]:
        asked.append(spec)
        return {name for name, target in targets.items() if target.spec == spec}  # "global" too, when it is

    aggregated = [answer(SMALL, ["conv1.weight", *EXIT1]), answer(GLOBAL, ["conv1.weight", *FINAL]),
                  answer(None, FAMILY.head_keys(2))]
    assert reporting.trained(TARGETS, FAMILY, aggregated, trains) == (["small"], [1, 2, 3])
    assert asked == [SMALL, GLOBAL]  # an answer without a spec names no level
    assert reporting.trained(TARGETS, FAMILY, [answer(MID, ["conv1.weight"])], trains) == (["mid"], [])
    assert reporting.trained(TARGETS, FAMILY, [], trains) == ([], [])


def test_an_ensemble_counts_as_trained_once_an_update_reached_one_of_its_outputs() -> None:
    targets = {**TARGETS, "ensemble": EvalTarget("global", GLOBAL, ensemble=True)}

    def trains(spec: SubmodelSpec, targets: Mapping[str, EvalTarget]) -> set[str]:
        return set()

    assert reporting.trained(targets, FAMILY, [answer(MID, ["conv1.weight"])], trains) == ([], [])
    reached = [answer(MID, FAMILY.head_keys(2))]
    assert reporting.trained(targets, FAMILY, reached, trains) == (["ensemble"], [2])


# ----------------------------------------------------------------------------------------------- evaluation
def test_a_model_shared_by_targets_is_evaluated_once_and_its_bn_stored_only_for_store_bn_targets() -> None:
    states = {group: {"bn1.running_mean": torch.zeros(4)} for group in ("global", "other", "third")}
    evaluator = Evaluator({GLOBAL: {"bn1.running_mean": torch.full((4,), 7.0)},
                           SMALL: {"bn1.running_mean": torch.full((2,), 3.0)}})
    targets = {"top": EvalTarget("global", GLOBAL),  # the global model, evaluated first without storing
               "global": EvalTarget("global", GLOBAL, store_bn=True),
               "side": EvalTarget("other", SMALL, store_bn=True),
               "third": EvalTarget("third", SMALL)}
    results = reporting.evaluate_targets(evaluator, targets, states)  # type: ignore[arg-type]
    assert [spec for spec, _, _ in evaluator.calls] == [GLOBAL, SMALL, SMALL]  # once per (group, spec)
    assert results == {"top": Evaluator.accuracies(GLOBAL), "global": Evaluator.accuracies(GLOBAL),
                       "side": Evaluator.accuracies(SMALL), "third": Evaluator.accuracies(SMALL)}
    assert states["global"]["bn1.running_mean"].tolist() == [7.0] * 4
    assert states["other"]["bn1.running_mean"].tolist() == [3.0, 3.0, 0.0, 0.0]  # its leading slice
    assert states["third"]["bn1.running_mean"].tolist() == [0.0] * 4  # not asked to store


def test_an_ensemble_target_gets_the_ensembles_accuracy_and_its_models_other_targets_the_outputs() -> None:
    targets = {"global": EvalTarget("global", GLOBAL), "small": EvalTarget("global", SMALL),
               "ensemble": EvalTarget("global", GLOBAL, ensemble=True)}
    evaluator: Any = Evaluator()
    results = reporting.evaluate_targets(evaluator, targets, {"global": {}}, members=[0, 2])
    assert evaluator.calls == [(GLOBAL, True, (0, 2)), (SMALL, False, ())]  # members: the ensemble's model
    outputs = Evaluator.accuracies(GLOBAL, ensemble=True)
    assert results == {"global": outputs[:-1], "ensemble": outputs[-1:], "small": Evaluator.accuracies(SMALL)}
    assert len(results["global"]) == 3 and results["ensemble"] == [GLOBAL.width]


def test_store_bn_writes_only_the_keys_it_holds_into_their_leading_slices_without_touching_the_old_tensors(
) -> None:
    mean, var, tracked, weight = torch.arange(4.0), torch.zeros(3, 4), torch.tensor(5), torch.ones(4)
    state = {"bn.running_mean": mean, "bn.running_var": var, "bn.num_batches_tracked": tracked,
             "conv.weight": weight}
    reporting.store_bn(state, {"bn.running_mean": torch.tensor([9.0, 9.0]),
                               "bn.running_var": torch.ones(2, 3), "bn.num_batches_tracked": torch.tensor(1)})
    assert state["bn.running_mean"].tolist() == [9.0, 9.0, 2.0, 3.0]
    assert state["bn.running_var"].tolist() == [[1.0] * 3 + [0.0], [1.0] * 3 + [0.0], [0.0] * 4]
    assert int(state["bn.num_batches_tracked"]) == 1 and state["conv.weight"] is weight
    # The tensors the state held before (a carried task's base may share them) are as they were.
    assert mean.tolist() == [0.0, 1.0, 2.0, 3.0] and not var.any() and int(tracked) == 5


# ----------------------------------------------------------------------------------------------- the result
def test_the_round_result_counts_who_took_part_what_was_selected_carried_and_sent() -> None:
    carried = [DispatchedTask("r1-old", 1, plan("old"), time.time() + 60)]
    harness = Harness({"t-a": plan("a"), "t-b": plan("b")}, number=2, skipped=[Skip("s", "no memory")],
                      carried=carried, buffer_size=0)
    harness.offer(update("t-a", "a", round_number=2), size=100)
    harness.offer(update("t-b", "b", status="declined", round_number=2), size=7)
    harness.offer(update("r1-old", "old", round_number=1), size=30)
    current = harness.closed()
    records, _ = reporting.outcomes(current, FAMILY, RecordingLog())
    accuracies = {"global": [0.1, 0.2, 0.3], "small": [0.05, 0.15, 0.25]}
    result = reporting.round_result(current, records, accuracies, (["small"], [1, 3]), bytes_down=500,
                                    seconds=1.23456)
    assert (result.round, result.participants, result.selected, result.carried) == (2, 2, 3, 1)
    assert (result.bytes_down, result.bytes_up, result.seconds) == (500, 137, 1.235)
    assert result.global_accuracy == 0.3 and result.level_accuracy == {"small": 0.25}
    assert result.exit_accuracy == {"exit1": 0.1, "exit2": 0.2, "exit3": 0.3}
    assert (result.trained_levels, result.trained_exits) == (["small"], ["exit1", "exit3"])
    assert [record.agent for record in result.tasks] == ["a", "b", "old", "s"]  # by agent
    assert (result.deployed, result.deployed_accuracy) == ("global", None)
    assert "validation" in result.timing


def test_a_global_model_with_one_output_reports_no_exits_and_the_deployed_model_is_kept() -> None:
    harness = Harness({"t-a": plan("a")})
    harness.offer(update("t-a", "a"))
    current = harness.closed()
    records, _ = reporting.outcomes(current, FAMILY, RecordingLog())
    result = reporting.round_result(current, records, {"global": [0.5], "small": [0.4]}, (["small"], [1]),
                                    bytes_down=0, seconds=0.5, deployed=("small", 0.4))
    assert result.exit_accuracy == {} and result.trained_exits == [] and result.global_accuracy == 0.5
    assert (result.deployed, result.deployed_accuracy, result.headline) == ("small", 0.4, 0.4)
    accuracies = {"global": [0.5], "small": [0.4]}
    reporting.round_result(current, records, accuracies, (["small"], [1]), bytes_down=0, seconds=0.5)
    assert accuracies == {"global": [0.5], "small": [0.4]}  # read, not consumed


# ----------------------------------------------------------------------------------------------- the review
def test_a_review_tells_the_strategy_adds_what_was_trained_evaluates_and_deploys_the_largest_level_so_far(
) -> None:
    harness = Harness({"t-a": plan("a"), "t-b": plan("b"), "t-c": plan("c")})
    harness.offer(update("t-a", "a", spec=SMALL, keys=["conv1.weight", *EXIT1]))
    harness.offer(update("t-b", "b", status="declined"))
    current = harness.closed()
    strategy, evaluator = Strategy(TARGETS), Evaluator({GLOBAL: {"bn1.running_mean": torch.ones(4)}})
    states = {"global": {"bn1.running_mean": torch.zeros(4)}}
    so_far = TrainedSoFar(levels={"mid"}, exits={3})  # an earlier round trained the mid level
    review = reporting.review(current, strategy, FAMILY, evaluator, states, so_far,  # type: ignore[arg-type]
                              carried=(), log=RecordingLog())
    ((number, ended),) = strategy.observed
    assert number == 1 and [(o.task.agent_id, o.status) for o in ended] == [
        ("a", "ok"), ("b", "declined"), ("c", "missing")]
    assert review.trained == (["small"], [1]) and (so_far.levels, so_far.exits) == ({"mid", "small"}, {1, 3})
    assert review.accuracies == {name: Evaluator.accuracies(target.spec) for name, target in TARGETS.items()}
    assert states["global"]["bn1.running_mean"].tolist() == [1.0] * 4  # the global target's statistics kept
    assert review.deployed == ("mid", Evaluator.accuracies(MID)[-1])  # larger than small, trained so far
    assert current.timing["evaluation"] >= 0 and set(review.records) == {"a", "b", "c"}
    first, again = review.result(100, 2.0), review.result(100, 2.0)
    assert first == again and "global" in review.accuracies  # making the result leaves the review whole
    assert (first.deployed, first.participants, first.trained_levels) == ("mid", 1, ["small"])


def test_a_round_between_level_evaluations_evaluates_only_the_global_and_the_deployable_model() -> None:
    # data.levels_every: the other levels wait for their round; what is evaluated, and deployed, is as in any round.
    harness = Harness({"t-a": plan("a")})
    harness.offer(update("t-a", "a", spec=SMALL, keys=["conv1.weight", *EXIT1]))
    current = harness.closed()
    evaluator = Evaluator({GLOBAL: {"bn1.running_mean": torch.ones(4)}})
    states = {"global": {"bn1.running_mean": torch.zeros(4)}}
    review = reporting.review(current, Strategy(TARGETS), FAMILY, evaluator, states,  # type: ignore[arg-type]
                              TrainedSoFar(levels={"mid"}), carried=(), log=RecordingLog(), every_target=False)
    assert sorted(review.accuracies) == ["global", "mid"]  # small, trained this round, is not the deployable one
    # (a target sharing the global model's or the deployable one's model would come with it, at no cost)
    assert [spec for spec, *_ in evaluator.calls] == [GLOBAL, MID]
    assert states["global"]["bn1.running_mean"].tolist() == [1.0] * 4  # the global model's statistics kept
    result = review.result(100, 2.0)
    assert review.deployed == ("mid", Evaluator.accuracies(MID)[-1]) and not result.levels_evaluated
    assert set(result.level_accuracy) == {"mid"}
    again = Harness({"t-a": plan("a")})
    again.offer(update("t-a", "a", spec=SMALL, keys=["conv1.weight", *EXIT1]))
    full = reporting.review(again.closed(), Strategy(TARGETS), FAMILY, Evaluator(), states,  # type: ignore[arg-type]
                            TrainedSoFar(levels={"mid"}), carried=(), log=RecordingLog())
    assert sorted(full.accuracies) == ["global", "mid", "small"] and full.result(100, 2.0).levels_evaluated

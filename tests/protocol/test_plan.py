"""Training plans and typed adaptation on the wire: round trips, tasks of old coordinators, and rejections."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import pytest

from protocol import (
    DEFAULT_LIMITS,
    PLAN_VERSION,
    Adaptation,
    Candidate,
    Limits,
    LossTerm,
    Message,
    OptimizerSettings,
    ProtocolError,
    Recipe,
    Stage,
    Task,
    TrainingPlan,
    UpdateClip,
    decode,
    encode,
    encode_tensor,
)
from protocol._frozen import FrozenMap, freeze
from protocol._plain import plain
from protocol._reader import FieldReader

from .conftest import CANDIDATE_PLAN, SAMPLE_PLAN, SEGMENT_PLAN, make_old_task, pack, wire_of

MutateWire = Callable[[dict[str, Any]], None]


def _task(messages: dict[str, Message], name: str = "task") -> Task:
    task = messages[name]
    assert isinstance(task, Task)
    return task


def _decode_task(payload: bytes) -> Task:
    task = decode(payload, expected=Task)
    assert isinstance(task, Task)
    return task


def _rejection(payload: bytes) -> str:
    """The reason decode gives; it must be exactly one ProtocolError raised by a reader, not a wrapped crash."""
    with pytest.raises(ProtocolError) as caught:
        decode(payload)
    assert type(caught.value) is ProtocolError
    assert caught.value.__cause__ is None
    reason = str(caught.value)
    assert not reason.startswith("malformed message"), reason
    return reason


# ---- round trips -----------------------------------------------------------------------------------------


def test_task_with_plan_and_ladder_round_trips(
    messages: dict[str, Message], assert_same: Callable[[object, Message], None]
) -> None:
    task = _task(messages)
    decoded = _decode_task(encode(task))
    assert_same(decoded, task)
    assert decoded.recipe is None and decoded.plan is not None
    assert decoded.plan == SAMPLE_PLAN
    assert isinstance(decoded.plan.optimizer, OptimizerSettings)
    assert isinstance(decoded.plan.loss, tuple) and all(type(term) is LossTerm for term in decoded.plan.loss)
    assert isinstance(decoded.plan.schedule, tuple) and all(type(stage) is Stage for stage in decoded.plan.schedule)
    assert [term.kind for term in decoded.plan.loss] == ["ce", "ce", "kd"]
    assert decoded.plan.loss[2] == LossTerm.kd(-2, -1, weight=0.3, tau=3.0, detach_teacher=True)
    assert decoded.training_plan() is decoded.plan
    assert isinstance(decoded.adaptation, Adaptation) and decoded.adaptation.kind == "ladder"
    assert [type(c) for c in decoded.adaptation.candidates] == [Candidate, Candidate]
    assert [c.plan for c in decoded.adaptation.candidates] == [CANDIDATE_PLAN, SEGMENT_PLAN]
    assert decoded.adaptation.candidates[1].spec == {"width": 0.125, "segments": [[0, 1], [2]]}
    assert decoded.adaptation.rates == []
    assert hash(decoded.plan) == hash(SAMPLE_PLAN)  # frozen all the way down, as built by the coordinator


@pytest.mark.parametrize(
    "adaptation",
    [
        None,
        Adaptation("none"),
        Adaptation("ladder", [Candidate({"width": 0.5}, TrainingPlan(seed=3))]),
        Adaptation("ladder", [Candidate({"w": w / 64}, TrainingPlan(batch_size=w + 2)) for w in range(64)]),
        Adaptation("width-levels", rates=[1.0, 0.5, 0.25, 0.125]),
        Adaptation("width-levels", rates=[1]),
        Adaptation("depthwise"),
        Adaptation("depthwise", route="exit"),
    ],
    ids=["absent", "none", "ladder", "ladder-64", "width-levels", "width-levels-int", "depthwise",
         "depthwise-exit"],
)
def test_every_adaptation_kind_round_trips(adaptation: Adaptation | None, messages: dict[str, Message]) -> None:
    task = _task(messages)
    task.adaptation = adaptation
    decoded = _decode_task(encode(task))
    assert decoded.adaptation == adaptation
    if adaptation is not None:
        assert all(type(rate) is float for rate in decoded.adaptation.rates)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "plan",
    [
        TrainingPlan(),
        SAMPLE_PLAN,
        CANDIDATE_PLAN,
        SEGMENT_PLAN,
        TrainingPlan.from_recipe(Recipe(1, 2, 1e-3, 0.0, 0.0, None, False, -7)),
        TrainingPlan(seed=2**63 - 1, loss=tuple(LossTerm.ce(output=-i) for i in range(1, 65))),
        TrainingPlan(schedule=tuple(Stage(1 + i % 3, "exit" if i % 2 else "skip", i % 5 == 0) for i in range(1024))),
        TrainingPlan(loss=(LossTerm.ce(), LossTerm.width_kd(tau=2.0)), widths=(1.0, 0.75, 0.5, 0.25)),
        TrainingPlan(update_clip=UpdateClip(0.5, 1.2)),
    ],
    ids=["default", "sample", "candidate", "segments", "from-recipe", "64-terms", "1024-stages", "ordered-dropout",
         "update-clip"],
)
def test_plan_to_dict_from_dict_round_trip(plan: TrainingPlan) -> None:
    data = plan.to_dict()
    assert isinstance(data, dict) and data["version"] == PLAN_VERSION
    assert isinstance(data["loss"], list) and isinstance(data["schedule"], list)  # lists, not tuples
    assert TrainingPlan.from_dict(data) == plan
    through_msgpack = msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False)
    assert through_msgpack == data
    assert TrainingPlan.from_dict(through_msgpack) == plan


def test_plan_dict_layout() -> None:
    assert TrainingPlan().to_dict() == {
        "optimizer": {"kind": "sgd", "lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4, "clip_norm": 1.0},
        "epochs": 1,
        "batch_size": 32,
        "seed": 0,
        "loss": [{"kind": "ce", "weight": 1.0, "output": -1, "masked": False, "teacher": None, "tau": None,
                  "detach_teacher": False}],
        "schedule": [],
        "version": 1,
    }  # fmt: skip
    data = SAMPLE_PLAN.to_dict()
    data["loss"].clear()  # the dict is a copy: changing it leaves the plan alone
    assert len(SAMPLE_PLAN.loss) == 3


def test_plan_types_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE_PLAN.epochs = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE_PLAN.loss[0].weight = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE_PLAN.optimizer.lr = 1.0  # type: ignore[misc]


def test_plan_field_names_are_the_contract() -> None:
    def names(cls: type) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert names(TrainingPlan) == ["optimizer", "epochs", "batch_size", "seed", "loss", "schedule", "version", "copies",
                                   "widths", "update_clip"]
    assert names(UpdateClip) == ["bound", "noise_multiplier"]
    assert names(OptimizerSettings) == ["kind", "lr", "momentum", "weight_decay", "clip_norm"]
    assert names(LossTerm) == ["kind", "weight", "output", "masked", "teacher", "tau", "detach_teacher",
                               "teacher_spec"]
    assert names(Stage) == ["epochs", "route", "cache", "micro_batch"]
    assert names(Adaptation) == ["kind", "candidates", "rates", "route", "min_micro_batch", "head_alone"]
    assert names(Candidate) == ["spec", "plan"]
    assert names(Recipe) == [
        "epochs", "batch_size", "lr", "momentum", "weight_decay", "clip_norm", "masked_ce", "seed",
    ]  # fmt: skip


def test_plan_helpers() -> None:
    assert TrainingPlan().version == PLAN_VERSION == 1
    assert TrainingPlan().loss == (LossTerm("ce"),) and TrainingPlan().schedule == ()
    assert SAMPLE_PLAN.uses_masked_ce and not CANDIDATE_PLAN.uses_masked_ce
    assert not TrainingPlan(loss=(LossTerm.kd(-2, -1, weight=1.0, tau=1.0),)).uses_masked_ce
    assert TrainingPlan().outputs_needed() == 1
    assert SAMPLE_PLAN.outputs_needed() == 2
    assert CANDIDATE_PLAN.outputs_needed() == 1  # output 0 of a one-output model is its last
    assert TrainingPlan(loss=(LossTerm.ce(output=-3),)).outputs_needed() == 3
    assert TrainingPlan(loss=(LossTerm.ce(output=2),)).outputs_needed() == 3
    assert TrainingPlan(loss=(LossTerm.kd(-1, -4, weight=1.0, tau=2.0),)).outputs_needed() == 4
    kd = LossTerm.kd(1, -1, weight=0.5, tau=2.0, detach_teacher=True)
    assert (kd.kind, kd.output, kd.teacher, kd.tau, kd.weight, kd.detach_teacher, kd.masked) == (
        "kd", 1, -1, 2.0, 0.5, True, False
    )  # fmt: skip


# ---- tasks of coordinators that predate plans ------------------------------------------------------------


EXPECTED_OLD_PLAN = TrainingPlan(
    optimizer=OptimizerSettings(kind="sgd", lr=0.01, momentum=0.5, weight_decay=1e-4, clip_norm=None),
    epochs=3,
    batch_size=20,
    seed=9,
    loss=(LossTerm("ce", weight=1.0, output=-1, masked=True),),
    schedule=(),
    version=1,
)


def test_old_task_decodes_and_stands_for_its_recipe(
    old_task_wire: dict[str, Any], assert_same: Callable[[object, Message], None]
) -> None:
    assert "plan" not in old_task_wire and "adaptation" not in old_task_wire
    _, expected = make_old_task()
    task = _decode_task(pack(old_task_wire))
    assert_same(task, expected)
    assert task.plan is None and task.adaptation is None and task.recipe is not None
    plan = task.training_plan()
    assert plan == TrainingPlan.from_recipe(task.recipe) == EXPECTED_OLD_PLAN
    assert plan.uses_masked_ce
    assert TrainingPlan.from_dict(plan.to_dict()) == plan


def test_from_recipe_maps_every_field() -> None:
    recipe = Recipe(epochs=4, batch_size=8, lr=0.3, momentum=0.0, weight_decay=0.0, clip_norm=2.5,
                    masked_ce=False, seed=123)  # fmt: skip
    assert TrainingPlan.from_recipe(recipe) == TrainingPlan(
        optimizer=OptimizerSettings("sgd", 0.3, 0.0, 0.0, 2.5), epochs=4, batch_size=8, seed=123,
        loss=(LossTerm.ce(),), schedule=(),
    )  # fmt: skip
    assert not TrainingPlan.from_recipe(recipe).uses_masked_ce


def test_old_task_with_legacy_width_levels_hint_decodes(old_task_wire: dict[str, Any]) -> None:
    old_task_wire["adaptation"] = {"kind": "width-levels", "rates": [1.0, 0.5, 0.25, 0.125, 0.0625]}
    task = _decode_task(pack(old_task_wire))
    assert task.adaptation == Adaptation("width-levels", candidates=[], rates=[1.0, 0.5, 0.25, 0.125, 0.0625])
    assert task.training_plan() == EXPECTED_OLD_PLAN


def test_old_task_with_explicit_null_adaptation_decodes(old_task_wire: dict[str, Any]) -> None:
    old_task_wire["adaptation"] = None
    assert _decode_task(pack(old_task_wire)).adaptation is None


def test_new_task_without_adaptation_key_decodes(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    del wire["adaptation"]
    task = _decode_task(pack(wire))
    assert task.adaptation is None and task.plan == SAMPLE_PLAN


def test_decoded_old_task_re_encodes_with_a_null_plan(old_task_wire: dict[str, Any]) -> None:
    task = _decode_task(pack(old_task_wire))
    wire = wire_of(task)
    assert wire["plan"] is None and wire["adaptation"] is None
    assert wire["recipe"] == old_task_wire["recipe"]
    again = _decode_task(encode(task))
    assert again.recipe == task.recipe and again.training_plan() == EXPECTED_OLD_PLAN


def test_field_reader_optional_fields() -> None:
    @dataclasses.dataclass
    class Pair:
        a: int
        b: int | None

    data: dict[str, Any] = {"a": 1}
    reader = FieldReader(data, "pair", DEFAULT_LIMITS, Pair, optional=("b",))
    assert reader.integer("a") == 1 and reader.raw("b") is None and reader.opt_integer("b") is None
    assert data == {"a": 1}  # the decoded map is not changed
    assert FieldReader({"a": 1, "b": 2}, "pair", DEFAULT_LIMITS, Pair, optional=("b",)).opt_integer("b") == 2
    with pytest.raises(ProtocolError, match=r"pair: missing field\(s\) 'b'"):
        FieldReader({"a": 1}, "pair", DEFAULT_LIMITS, Pair)
    with pytest.raises(ProtocolError, match=r"pair: missing field\(s\) 'a'"):
        FieldReader({"b": 1}, "pair", DEFAULT_LIMITS, Pair, optional=("b",))
    with pytest.raises(ProtocolError, match=r"pair: unknown field\(s\) 'c'"):
        FieldReader({"a": 1, "c": 1}, "pair", DEFAULT_LIMITS, Pair, optional=("b",))
    with pytest.raises(ProtocolError, match=r"pair: unknown field\(s\) 'c'"):  # optional does not add fields
        FieldReader({"a": 1, "b": 1, "c": 1}, "pair", DEFAULT_LIMITS, Pair, optional=("c",))


# ---- rejections on decode --------------------------------------------------------------------------------


def _term(wire: dict[str, Any], index: int) -> dict[str, Any]:
    term: dict[str, Any] = wire["plan"]["loss"][index]
    return term


def _future_plan(wire: dict[str, Any]) -> None:
    """A plan of a newer coordinator: version 2, a new field and a new loss kind with its own field."""
    wire["plan"]["version"] = 2
    wire["plan"]["mixup"] = 0.2
    wire["plan"]["loss"].append({"kind": "mutual_kd", "weight": 1.0, "peers": 2})


def _drop(path: str) -> MutateWire:
    def mutate(wire: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            wire = wire[part]
        del wire[last]

    return mutate


def _put(path: str, value: object) -> MutateWire:
    def mutate(wire: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = wire
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return mutate


def _deep(levels: int) -> dict[str, Any]:
    tree: dict[str, Any] = {"width": 0.5}
    for _ in range(levels - 1):
        tree = {"x": tree}
    return tree


NESTED_SPEC = {"layer_widths": {"conv1": 0.5, "conv2": 0.25}, "rounding": "floor"}
NESTED_WIRE = plain(LossTerm.nested_kd(NESTED_SPEC, weight=5.0, tau=3.0))
assert isinstance(NESTED_WIRE, dict)

REJECTIONS: list[tuple[str, str, MutateWire, tuple[str, ...]]] = [
    # (id, sample, mutation of its wire map, texts the one reason must hold)
    ("future-kind", "task", _put("plan.loss.1.kind", "future_kd"),
     ("task.plan.loss[1].kind", "unknown loss term kind", "'future_kd'", "ce, kd, mutual_kd, nested_kd")),
    ("future-kind-new-fields", "task",
     lambda w: w["plan"]["loss"].append({"kind": "future_kd", "weight": 0.5, "peers": [1, 2], "tau": 2.0}),
     ("task.plan.loss[3].kind", "unknown loss term kind", "'future_kd'")),
    ("future-kind-in-candidate", "task", _put("adaptation.candidates.1.plan.loss.0.kind", "future_kd"),
     ("task.adaptation.candidates[1].plan.loss[0].kind", "'future_kd'")),
    ("nested-kd-without-teacher-spec", "task", _put("plan.loss.1", {**LossTerm.mutual_kd().__dict__,
                                                                     "kind": "nested_kd"}),
     ("task.plan.loss[1]", "'nested_kd' term needs 'teacher_spec' (a map) and 'tau'")),
    ("nested-kd-without-tau", "task", _put("plan.loss.1", {**NESTED_WIRE, "tau": None}),
     ("task.plan.loss[1]", "'nested_kd' term needs")),
    ("nested-kd-with-teacher", "task", _put("plan.loss.1", {**NESTED_WIRE, "teacher": -1}),
     ("task.plan.loss[1]", "'nested_kd' term", "takes no 'teacher', 'masked' or 'detach_teacher'")),
    ("nested-kd-masked", "task", _put("plan.loss.1", {**NESTED_WIRE, "masked": True}),
     ("task.plan.loss[1]", "'nested_kd' term", "no 'teacher', 'masked'")),
    ("nested-kd-detached", "task", _put("plan.loss.1", {**NESTED_WIRE, "detach_teacher": True}),
     ("task.plan.loss[1]", "'nested_kd' term", "'detach_teacher'")),
    ("nested-kd-spec-list", "task", _put("plan.loss.1", {**NESTED_WIRE, "teacher_spec": [0.5]}),
     ("task.plan.loss[1].teacher_spec must be a map",)),
    ("nested-kd-spec-text", "task", _put("plan.loss.1", {**NESTED_WIRE, "teacher_spec": "width=0.5"}),
     ("task.plan.loss[1].teacher_spec must be a map",)),
    ("nested-kd-spec-too-deep", "task", _put("plan.loss.1", {**NESTED_WIRE, "teacher_spec": _deep(17)}),
     ("task.plan.loss[1].teacher_spec", "nested deeper than 16 levels")),
    ("nested-kd-spec-nan", "task", _put("plan.loss.1", {**NESTED_WIRE, "teacher_spec": {"width": math.nan}}),
     ("task.plan.loss[1].teacher_spec.width must be finite",)),
    ("nested-kd-in-candidate-without-spec", "task",
     _put("adaptation.candidates.0.plan.loss.1", {**NESTED_WIRE, "teacher_spec": None}),
     ("task.adaptation.candidates[0].plan.loss[1]", "'nested_kd' term needs 'teacher_spec'")),
    ("ce-with-teacher-spec", "task", _put("plan.loss.0.teacher_spec", {"width": 0.5}),
     ("task.plan.loss[0]", "only a 'nested_kd' term takes a 'teacher_spec'")),
    ("kd-with-teacher-spec", "task", _put("plan.loss.2.teacher_spec", {}),
     ("task.plan.loss[2]", "only a 'nested_kd' term takes a 'teacher_spec'")),
    ("mutual-kd-new-fields", "task",
     lambda w: w["plan"]["loss"].append({**LossTerm.mutual_kd().__dict__, "peers": [1, 2]}),
     ("task.plan.loss[3]", "unknown field(s) 'peers'")),
    ("loss-kind-null", "task", _put("plan.loss.0.kind", None), ("task.plan.loss[0].kind", "unknown loss term")),
    ("loss-kind-not-text", "task", _put("plan.loss.0.kind", ["ce"]), ("task.plan.loss[0].kind",)),
    ("kd-without-teacher", "task", _put("plan.loss.2.teacher", None),
     ("task.plan.loss[2]", "'kd' term needs 'teacher' and 'tau'")),
    ("kd-without-tau", "task", _put("plan.loss.2.tau", None),
     ("task.plan.loss[2]", "'kd' term needs 'teacher' and 'tau'")),
    ("kd-masked", "task", _put("plan.loss.2.masked", True), ("task.plan.loss[2]", "cannot be 'masked'")),
    ("ce-with-teacher", "task", _put("plan.loss.0.teacher", -1),
     ("task.plan.loss[0]", "'ce' term takes no 'teacher'")),
    ("ce-with-tau", "task", _put("plan.loss.1.tau", 2.0), ("task.plan.loss[1]", "'ce' term takes no", "'tau'")),
    ("ce-detached", "task", _put("plan.loss.1.detach_teacher", True),
     ("task.plan.loss[1]", "'ce' term takes no", "'detach_teacher'")),
    ("plan-version-2", "task", _put("plan.version", 2),
     ("task.plan.version", "version int 2", "version 1", "upgrade")),
    ("plan-version-0", "task", _put("plan.version", 0), ("task.plan.version", "version int 0")),
    ("plan-version-text", "task", _put("plan.version", "1"), ("task.plan.version", "str '1'")),
    ("plan-version-float", "task", _put("plan.version", 1.0), ("task.plan.version", "float 1.0")),
    ("plan-version-bool", "task", _put("plan.version", True), ("task.plan.version", "bool True")),
    ("plan-version-missing", "task", _drop("plan.version"), ("task.plan: missing field(s) 'version'",)),
    ("future-plan", "task", _future_plan, ("task.plan.version", "version int 2")),
    ("candidate-plan-version-2", "task", _put("adaptation.candidates.0.plan.version", 2),
     ("task.adaptation.candidates[0].plan.version", "version int 2")),
    ("unknown-plan-field", "task", _put("plan.mixup", 0.2), ("task.plan: unknown field(s) 'mixup'",)),
    ("unknown-candidate-plan-field", "task", _put("adaptation.candidates.0.plan.ema", True),
     ("task.adaptation.candidates[0].plan: unknown field(s) 'ema'",)),
    ("unknown-term-field", "task", _put("plan.loss.2.temperature", 3.0),
     ("task.plan.loss[2]: unknown field(s) 'temperature'",)),
    ("unknown-adaptation-kind", "task", _put("adaptation.kind", "shrink-depth"),
     ("task.adaptation.kind", "unknown adaptation kind", "'shrink-depth'", "none, ladder, depthwise, width-levels")),
    ("adaptation-kind-missing", "task", _drop("adaptation.kind"), ("task.adaptation", "missing field(s) 'kind'")),
    ("unknown-adaptation-field", "task", _put("adaptation.depths", [1]),
     ("task.adaptation: unknown field(s) 'depths'",)),
    ("ladder-empty", "task", _put("adaptation.candidates", []), ("task.adaptation", "'ladder'", "candidate")),
    ("ladder-no-candidates", "task", _drop("adaptation.candidates"), ("task.adaptation", "'ladder'", "candidate")),
    ("ladder-too-long", "task",
     lambda w: w["adaptation"].__setitem__("candidates", w["adaptation"]["candidates"][:1] * 65),
     ("task.adaptation.candidates", "at most 64")),
    ("width-levels-no-rates", "task_recipe", _drop("adaptation.rates"),
     ("task.adaptation", "'width-levels'", "'rates'")),
    ("width-levels-empty-rates", "task_recipe", _put("adaptation.rates", []),
     ("task.adaptation", "'width-levels'", "'rates'")),
    ("width-levels-rate-above-1", "task_recipe", _put("adaptation.rates", [1.0, 1.5]),
     ("task.adaptation.rates", "(0, 1]")),
    ("width-levels-rate-0", "task_recipe", _put("adaptation.rates", [0.5, 0]), ("task.adaptation.rates",)),
    ("width-levels-negative-rate", "task_recipe", _put("adaptation.rates", [-0.5]), ("task.adaptation.rates",)),
    ("plan-and-recipe", "task", lambda w: w.__setitem__("recipe", wire_of_recipe()), ("'plan'", "'recipe'", "both")),
    ("plan-and-recipe-old", "task_recipe", lambda w: w.__setitem__("plan", SAMPLE_PLAN.to_dict()),
     ("'plan'", "'recipe'", "both")),
    ("neither-null", "task", _put("plan", None), ("'plan'", "'recipe'", "neither")),
    ("neither-absent", "task", _drop("plan"), ("'plan'", "'recipe'", "neither")),
    ("neither-old", "task_recipe", _put("recipe", None), ("'plan'", "'recipe'", "neither")),
    ("batch-size-1", "task", _put("plan.batch_size", 1), ("task.plan.batch_size must be >= 2", "got 1")),
    ("batch-size-0", "task", _put("plan.batch_size", 0), ("task.plan.batch_size must be >= 2",)),
    ("candidate-batch-size-1", "task", _put("adaptation.candidates.0.plan.batch_size", 1),
     ("task.adaptation.candidates[0].plan.batch_size must be >= 2",)),
    ("lr-nan", "task", _put("plan.optimizer.lr", math.nan), ("task.plan.optimizer.lr must be finite",)),
    ("lr-inf", "task", _put("plan.optimizer.lr", math.inf), ("task.plan.optimizer.lr must be finite",)),
    ("lr-minus-inf", "task", _put("plan.optimizer.lr", -math.inf), ("task.plan.optimizer.lr must be finite",)),
    ("candidate-lr-nan", "task", _put("adaptation.candidates.1.plan.optimizer.lr", math.nan),
     ("task.adaptation.candidates[1].plan.optimizer.lr must be finite",)),
    ("optimizer-adam", "task", _put("plan.optimizer.kind", "adam"), ("task.plan.optimizer.kind", "'adam'")),
    ("route-unknown", "task", _put("plan.schedule.0.route", "teleport"), ("task.plan.schedule[0].route",)),
    ("no-loss-terms", "task", _put("plan.loss", []), ("task.plan.loss must hold at least one term",)),
    ("stage-cache-text", "task", _put("plan.schedule.0.cache", "yes"), ("task.plan.schedule[0].cache",)),
    ("route-on-a-ladder", "task", _put("adaptation.route", "exit"),
     ("task.adaptation.route", "only a 'depthwise' adaptation has a route")),
    ("route-unknown-depthwise", "task", lambda w: w.__setitem__("adaptation", {"kind": "depthwise", "route": "x"}),
     ("task.adaptation.route",)),
    ("copies-0", "task", _put("plan.copies", 0), ("task.plan.copies must be >= 1",)),
    ("copies-above-limit", "task", _put("plan.copies", 9), ("task.plan.copies is 9, more than the limit of 8",)),
    ("copies-text", "task", _put("plan.copies", "2"), ("task.plan.copies",)),
    ("mutual-kd-without-tau", "task", _put("plan.loss.0", {**LossTerm.mutual_kd().__dict__, "tau": None}),
     ("task.plan.loss[0]", "'mutual_kd' term needs 'tau'")),
    ("mutual-kd-with-teacher", "task", _put("plan.loss.0", {**LossTerm.mutual_kd().__dict__, "teacher": -1}),
     ("task.plan.loss[0]", "'mutual_kd' term", "no 'teacher'")),
]


def wire_of_recipe() -> dict[str, Any]:
    return dataclasses.asdict(Recipe(1, 8, 0.1, 0.0, 0.0, None, False, 0))


@pytest.mark.parametrize(
    ("sample", "mutate", "texts"), [case[1:] for case in REJECTIONS], ids=[case[0] for case in REJECTIONS]
)
def test_rejection_is_one_protocol_error_naming_the_problem(
    sample: str, mutate: MutateWire, texts: tuple[str, ...], messages: dict[str, Message]
) -> None:
    wire = wire_of(messages[sample])
    mutate(wire)
    reason = _rejection(pack(wire))
    for text in texts:
        assert text in reason, (text, reason)


def test_old_task_rejections(old_task_wire: dict[str, Any]) -> None:
    for kind, extra in [("shrink", {}), ("width-levels", {}), ("width-levels", {"rates": [2.0]}), ("ladder", {})]:
        wire = copy.deepcopy(old_task_wire)
        wire["adaptation"] = {"kind": kind, **extra}
        assert "task.adaptation" in _rejection(pack(wire)), (kind, extra)
    wire = copy.deepcopy(old_task_wire)
    wire["plan"] = TrainingPlan().to_dict()
    assert "not both" in _rejection(pack(wire))
    wire = copy.deepcopy(old_task_wire)
    del wire["recipe"]
    assert "missing field(s) 'recipe'" in _rejection(pack(wire))


@pytest.mark.parametrize(
    ("mutate", "texts"),
    [
        (lambda p: p.__setitem__("version", 2), ("plan.version", "version int 2")),
        (lambda p: p.__setitem__("extra", 1), ("plan: unknown field(s) 'extra'",)),
        (lambda p: p["loss"][0].__setitem__("kind", "future_kd"), ("plan.loss[0].kind", "'future_kd'")),
        (lambda p: p["loss"][0].__setitem__("kind", "nested_kd"), ("plan.loss[0]", "'nested_kd' term needs")),
        (lambda p: p["loss"][0].__setitem__("kind", {"nested": "map"}), ("plan.loss[0].kind",)),
        (lambda p: p.__setitem__("batch_size", 1), ("plan.batch_size must be >= 2",)),
        (lambda p: p["optimizer"].__setitem__("lr", math.inf), ("plan.optimizer.lr must be finite",)),
        (lambda p: p.pop("seed"), ("plan: missing field(s) 'seed'",)),
        (lambda p: p.__setitem__("loss", [{"kind": "ce"}]), ("plan.loss[0]: missing field(s)",)),
        (lambda p: p.__setitem__("schedule", [{"epochs": 1, "route": "skip"}] * 1025), ("plan.schedule has 1025",)),
    ],
)
def test_from_dict_rejects_with_the_plan_label(
    mutate: Callable[[dict[str, Any]], None], texts: tuple[str, ...]
) -> None:
    data = SAMPLE_PLAN.to_dict()
    mutate(data)
    with pytest.raises(ProtocolError) as caught:
        TrainingPlan.from_dict(data)
    for text in texts:
        assert text in str(caught.value), (text, str(caught.value))


@pytest.mark.parametrize("data", [None, [], "plan", 1, b"\x00", TrainingPlan()])
def test_from_dict_rejects_non_maps(data: object) -> None:
    with pytest.raises(ProtocolError, match="plan must be a map"):
        TrainingPlan.from_dict(data)


def test_from_dict_applies_limits() -> None:
    with pytest.raises(ProtocolError, match="plan.optimizer.kind is 3 characters long"):
        TrainingPlan.from_dict(TrainingPlan().to_dict(), Limits(max_str_len=2))


# ---- encode refuses what decode refuses ------------------------------------------------------------------


def _wire_value(value: object) -> object:
    """Message values as msgpack primitives, written independently of the codec (and without its checks)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Fields added later stay off the wire at their default (see test_copies_stay_off_the_wire_at_their_...).
        later = {TrainingPlan: {"copies": 1, "widths": (), "update_clip": None}, Stage: {"cache": False, "micro_batch": 0},
                 Adaptation: {"route": "skip", "min_micro_batch": 0, "head_alone": False}, LossTerm: {"teacher_spec": None}}
        omitted = later.get(type(value), {})
        return {f.name: _wire_value(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.name in omitted and getattr(value, f.name) == omitted[f.name])}
    if isinstance(value, Mapping):  # dicts, and a nested_kd term's frozen teacher_spec
        return {key: _wire_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wire_value(item) for item in value]
    return value


def _unchecked_payload(task: Task) -> bytes:
    body: dict[str, Any] = {"v": 1, "type": "task"}
    for f in dataclasses.fields(task):
        if f.name != "weights" and not (f.name in ("ask_to_upload", "secure") and not getattr(task, f.name)):
            body[f.name] = _wire_value(getattr(task, f.name))
    body["weights"] = {name: encode_tensor(array) for name, array in task.weights.items()}
    return pack(body)


def _with_plan(**changes: Any) -> Callable[[Task], None]:
    def change(task: Task) -> None:
        assert task.plan is not None
        task.plan = dataclasses.replace(task.plan, **changes)

    return change


def _with_optimizer(**changes: Any) -> Callable[[Task], None]:
    return _with_plan(optimizer=dataclasses.replace(SAMPLE_PLAN.optimizer, **changes))


def _with_term(term: LossTerm) -> Callable[[Task], None]:
    return _with_plan(loss=(*SAMPLE_PLAN.loss, term))


def _with_adaptation(adaptation: Adaptation) -> Callable[[Task], None]:
    def change(task: Task) -> None:
        task.adaptation = adaptation

    return change


def _with_recipe(task: Task) -> None:
    task.recipe = Recipe(1, 8, 0.1, 0.0, 0.0, None, False, 0)


def _without_plan(task: Task) -> None:
    task.plan = None


ENCODE_REFUSALS: list[tuple[str, Callable[[Task], None], str]] = [
    ("future-kind", _with_term(LossTerm("future_kd")), "task.plan.loss[3].kind"),
    ("nested-kd-without-spec", _with_term(LossTerm("nested_kd", tau=3.0)), "'nested_kd' term needs 'teacher_spec'"),
    ("nested-kd-with-teacher", _with_term(LossTerm("nested_kd", teacher=-1, tau=3.0, teacher_spec={})),
     "'nested_kd' term needs"),
    ("nested-kd-spec-list", _with_term(LossTerm("nested_kd", tau=3.0, teacher_spec=[0.5])),  # type: ignore[arg-type]
     "task.plan.loss[3].teacher_spec must be a map"),
    ("ce-with-teacher-spec", _with_term(LossTerm("ce", teacher_spec={"width": 0.5})),
     "only a 'nested_kd' term takes a 'teacher_spec'"),
    ("mutual-kd-without-tau", _with_term(LossTerm("mutual_kd")), "'mutual_kd' term needs 'tau'"),
    ("copies-9", _with_plan(copies=9), "task.plan.copies is 9"),
    ("kd-without-teacher", _with_term(LossTerm("kd", tau=2.0)), "'kd' term needs"),
    ("kd-without-tau", _with_term(LossTerm("kd", output=-2, teacher=-1)), "'kd' term needs"),
    ("ce-with-teacher", _with_term(LossTerm("ce", teacher=-2)), "'ce' term takes no"),
    ("plan-version-2", _with_plan(version=2), "task.plan.version"),
    ("no-terms", _with_plan(loss=()), "task.plan.loss must hold at least one term"),
    ("batch-size-1", _with_plan(batch_size=1), "task.plan.batch_size must be >= 2"),
    ("epochs-0", _with_plan(epochs=0), "task.plan.epochs must be >= 1"),
    ("lr-nan", _with_optimizer(lr=math.nan), "task.plan.optimizer.lr must be finite"),
    ("lr-inf", _with_optimizer(lr=math.inf), "task.plan.optimizer.lr must be finite"),
    ("route", _with_plan(schedule=(Stage(1, "teleport"),)), "task.plan.schedule[0].route"),
    ("unknown-adaptation", _with_adaptation(Adaptation("shrink-depth")), "unknown adaptation kind"),
    ("ladder-empty", _with_adaptation(Adaptation("ladder")), "'ladder' adaptation needs"),
    ("width-levels-empty", _with_adaptation(Adaptation("width-levels")), "'width-levels' adaptation needs"),
    ("rate-above-1", _with_adaptation(Adaptation("width-levels", rates=[1.0, 1.01])), "(0, 1]"),
    ("candidate-plan", _with_adaptation(Adaptation("ladder", [Candidate({}, TrainingPlan(batch_size=1))])),
     "task.adaptation.candidates[0].plan.batch_size must be >= 2"),
    ("both", _with_recipe, "not both and not neither"),
    ("neither", _without_plan, "not both and not neither"),
]


@pytest.mark.parametrize(
    ("change", "text"), [case[1:] for case in ENCODE_REFUSALS], ids=[case[0] for case in ENCODE_REFUSALS]
)
def test_encode_refuses_what_decode_refuses(
    change: Callable[[Task], None], text: str, messages: dict[str, Message]
) -> None:
    task = _task(messages)
    change(task)
    reason = _rejection(_unchecked_payload(task))  # what the receiving side would say
    assert text in reason, (text, reason)
    with pytest.raises(ProtocolError) as caught:
        encode(task)
    assert str(caught.value) == f"cannot encode task: {reason}"


def test_unchecked_payload_of_a_valid_task_decodes(
    messages: dict[str, Message], assert_same: Callable[[object, Message], None]
) -> None:
    """The helper above writes what encode writes (so its refusals are meaningful)."""
    for name in ("task", "task_recipe"):
        task = _task(messages, name)
        assert _unchecked_payload(task) == encode(task, version=1)
        assert_same(decode(_unchecked_payload(task)), task)


# ---- falsy non-lists are not lists ------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "kind", "value"), [
    ("candidates", "none", 0), ("candidates", "width-levels", False), ("candidates", "none", {}),
    ("rates", "ladder", ""), ("rates", "none", 0), ("rates", "ladder", {}),
])  # fmt: skip
def test_adaptation_lists_must_be_lists(field: str, kind: str, value: object, messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    wire["adaptation"]["kind"] = kind
    wire["adaptation"]["rates"] = [0.5]
    wire["adaptation"][field] = value
    reason = _rejection(pack(wire))
    assert f"task.adaptation.{field} must be a list" in reason


# ---- structural fuzz of plans and adaptations ------------------------------------------------------------

_ODD_VALUES: list[object] = [
    None, True, False, 0, 1, -1, 2, 65, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, 0.5, 1.5, -0.5, math.nan, math.inf,
    "", "ce", "kd", "mutual_kd", "nested_kd", "ladder", "none", "width-levels", "skip", "exit", "sgd", "x" * 5000,
    b"\x00",
    [], [1], [0.5, 2.0], [None], [[]], [{}], {}, {"kind": "ce"}, {"kind": "kd"}, {1: 2},
]  # fmt: skip


def _containers(node: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    found: list[tuple[object, ...]] = []
    if isinstance(node, dict):
        found.append(path)
        for key, value in node.items():
            found.extend(_containers(value, (*path, key)))
    elif isinstance(node, list):
        found.append(path)
        for index, value in enumerate(node):
            found.extend(_containers(value, (*path, index)))
    return found


def _fuzz_wire(wire: dict[str, Any], roots: tuple[str, ...], rng: random.Random) -> dict[str, Any]:
    """Apply 1 to 3 random edits (replace, delete, add, duplicate) somewhere inside the given top-level fields."""
    wire = copy.deepcopy(wire)
    for _ in range(rng.randint(1, 3)):
        root = rng.choice(roots)
        if not isinstance(wire.get(root), (dict, list)):
            wire[root] = rng.choice(_ODD_VALUES + [{}])
            continue
        path = rng.choice(_containers(wire[root], (root,)))
        node: Any = wire
        for part in path:
            node = node[part]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        op = rng.randrange(4)
        if op == 0 and keys:
            node[rng.choice(keys)] = copy.deepcopy(rng.choice(_ODD_VALUES))
        elif op == 1 and keys:
            del node[rng.choice(keys)]
        elif op == 2 and isinstance(node, dict):
            key = rng.choice(["kind", "extra", "version", "candidates", "rates", "teacher", "tau", "teacher_spec"])
            node[key] = copy.deepcopy(rng.choice(_ODD_VALUES))
        elif op == 2:
            node.append(copy.deepcopy(rng.choice(_ODD_VALUES)))
        elif keys:
            key = rng.choice(keys)
            if isinstance(node, list):
                node.append(copy.deepcopy(node[key]))
            else:
                node[key] = copy.deepcopy(node[rng.choice(keys)])
    return wire


def test_structural_fuzz_of_plans_only_ever_raises_protocol_error(
    messages: dict[str, Message], old_task_wire: dict[str, Any]
) -> None:
    rng = random.Random(20261123)
    bases = [
        (wire_of(messages["task"]), ("plan", "adaptation", "recipe")),
        (wire_of(messages["task_recipe"]), ("recipe", "adaptation", "plan")),
        (old_task_wire, ("recipe", "adaptation", "plan")),
    ]
    accepted = rejected = 0
    for _ in range(900):
        base, roots = rng.choice(bases)
        mutated = _fuzz_wire(base, roots, rng)
        try:
            payload = pack(mutated)
        except (TypeError, ValueError):  # pragma: no cover - every value above packs
            continue
        try:
            task = decode(payload)
        except ProtocolError as exc:
            assert type(exc) is ProtocolError
            assert not str(exc).startswith("malformed message"), str(exc)  # a reader's reason, not a crash
            rejected += 1
            continue
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - this is the failure being tested for
            pytest.fail(f"decode leaked {type(exc).__name__}: {exc!r} for {mutated!r}")
        assert isinstance(task, Task)
        assert (task.plan is None) != (task.recipe is None)
        assert isinstance(task.training_plan(), TrainingPlan)
        again = _decode_task(encode(task))  # whatever decode accepts, encode sends unchanged
        assert (again.plan, again.recipe, again.adaptation) == (task.plan, task.recipe, task.adaptation)
        accepted += 1
    assert rejected > 300 and accepted > 50, (accepted, rejected)


def test_plan_from_dict_fuzz_only_ever_raises_protocol_error() -> None:
    rng = random.Random(7)
    base = {"plan": SAMPLE_PLAN.to_dict()}
    for _ in range(600):
        data = _fuzz_wire(base, ("plan",), rng)["plan"]
        try:
            plan = TrainingPlan.from_dict(data)
        except ProtocolError:
            continue
        assert TrainingPlan.from_dict(plan.to_dict()) == plan



def test_copies_stay_off_the_wire_at_their_default_and_round_trip_above_it() -> None:
    # An agent that predates copies reads every plan that trains one (the field is not written).
    assert "copies" not in TrainingPlan().to_dict()
    plan = TrainingPlan(loss=(LossTerm.ce(), LossTerm.mutual_kd(weight=0.5, tau=2.0)), copies=3)
    wire = plan.to_dict()
    assert wire["copies"] == 3
    assert wire["loss"][1] == {"kind": "mutual_kd", "weight": 0.5, "output": -1, "masked": False, "teacher": None,
                               "tau": 2.0, "detach_teacher": False}
    assert TrainingPlan.from_dict(wire) == plan
    assert TrainingPlan.from_dict(TrainingPlan().to_dict()).copies == 1


def test_a_task_of_one_copy_plans_carries_no_copies_field(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])  # its plan and its ladder candidates' plans train one copy
    assert "copies" not in wire["plan"]
    assert all("copies" not in candidate["plan"] for candidate in wire["adaptation"]["candidates"])


def test_stage_cache_and_adaptation_route_stay_off_the_wire_at_their_defaults() -> None:
    # Agents that predate them read every plan without cached stages and every skip-route adaptation.
    assert TrainingPlan(schedule=(Stage(2, "skip"),)).to_dict()["schedule"] == [{"epochs": 2, "route": "skip"}]
    cached = TrainingPlan(schedule=(Stage(2, "exit", cache=True),))
    assert cached.to_dict()["schedule"] == [{"epochs": 2, "route": "exit", "cache": True}]
    assert TrainingPlan.from_dict(cached.to_dict()) == cached
    assert TrainingPlan.from_dict(TrainingPlan(schedule=(Stage(),)).to_dict()).schedule[0].cache is False


def test_micro_batches_stay_off_the_wire_at_their_defaults_and_round_trip() -> None:
    assert "micro_batch" not in TrainingPlan(schedule=(Stage(2),)).to_dict()["schedule"][0]
    micro = TrainingPlan(batch_size=32, schedule=(Stage(1, micro_batch=8), Stage(1)))
    assert micro.to_dict()["schedule"][0] == {"epochs": 1, "route": "skip", "micro_batch": 8}
    assert TrainingPlan.from_dict(micro.to_dict()) == micro
    depthwise = Adaptation("depthwise", min_micro_batch=4)
    assert plain(Adaptation("depthwise")) == {"kind": "depthwise", "candidates": [], "rates": []}
    assert plain(depthwise)["min_micro_batch"] == 4


@pytest.mark.parametrize(("where", "value", "said"), [
    ("plan.schedule.0.micro_batch", 1, "task.plan.schedule[0].micro_batch must be 0 (whole batches) or at least 2"),
    ("plan.schedule.0.micro_batch", -4, "task.plan.schedule[0].micro_batch must be >= 0"),
    ("plan.schedule.0.micro_batch", "8", "task.plan.schedule[0].micro_batch"),
])  # fmt: skip
def test_a_bad_micro_batch_is_one_protocol_error(where: str, value: object, said: str,
                                                 messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    _put(where, value)(wire)
    assert said in _rejection(pack(wire))


@pytest.mark.parametrize(("adaptation", "said"), [
    ({"kind": "depthwise", "min_micro_batch": 1}, "min_micro_batch: only a 'depthwise' adaptation takes one, and it is 0 or at least 2, got 1"),
    ({"kind": "none", "min_micro_batch": 4}, "min_micro_batch: only a 'depthwise' adaptation takes one"),
    ({"kind": "none", "head_alone": True}, "head_alone: only a 'depthwise' adaptation trains the head alone"),
    ({"kind": "depthwise", "head_alone": 1}, "head_alone must be true or false"),
])  # fmt: skip
def test_a_bad_depthwise_setting_is_one_protocol_error(adaptation: dict, said: str,
                                                       messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    wire["adaptation"] = adaptation
    assert f"task.adaptation.{said}" in _rejection(pack(wire))


def test_the_head_alone_offer_stays_off_the_wire_unless_made_and_round_trips(messages: dict[str, Message]) -> None:
    assert "head_alone" not in plain(Adaptation("depthwise", min_micro_batch=4))  # older agents refuse the field
    offered = dataclasses.replace(messages["task"], adaptation=Adaptation("depthwise", head_alone=True))
    wire = wire_of(offered)
    assert wire["adaptation"]["head_alone"] is True
    assert decode(pack(wire)).adaptation.head_alone is True


# ---- nested_kd: distillation from nested sub-models (FlexFL) ---------------------------------------------


NESTED_PLAN = TrainingPlan(seed=5, loss=(
    LossTerm.ce(),
    LossTerm.nested_kd({"layer_widths": {"conv1": 0.25, "conv2": 0.25}, "rounding": "floor"}, weight=10.0, tau=3.0),
    LossTerm.nested_kd(NESTED_SPEC, weight=5.0, tau=3.0, output=-1),
))


def test_nested_kd_terms_round_trip_and_stay_hashable(messages: dict[str, Message]) -> None:
    term = NESTED_PLAN.loss[2]
    assert (term.kind, term.weight, term.tau, term.output, term.teacher, term.masked, term.detach_teacher) == (
        "nested_kd", 5.0, 3.0, -1, None, False, False)
    assert term.teacher_spec == NESTED_SPEC and isinstance(term.teacher_spec, FrozenMap)
    wire = NESTED_PLAN.to_dict()
    assert wire["loss"][2] == {"kind": "nested_kd", "weight": 5.0, "output": -1, "masked": False, "teacher": None,
                               "tau": 3.0, "detach_teacher": False, "teacher_spec": NESTED_SPEC}
    spec_wire = wire["loss"][2]["teacher_spec"]
    assert type(spec_wire) is dict and type(spec_wire["layer_widths"]) is dict
    through_msgpack = msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)
    for data in (wire, through_msgpack):
        again = TrainingPlan.from_dict(data)
        assert again == NESTED_PLAN and hash(again) == hash(NESTED_PLAN)
        assert isinstance(again.loss[1].teacher_spec, FrozenMap)
    # Usable as a key, as the estimator caches use plans (coordinator.planning keys on replace(plan, seed=0)).
    cache = {dataclasses.replace(NESTED_PLAN, seed=0): 1}
    assert cache[dataclasses.replace(TrainingPlan.from_dict(through_msgpack), seed=0)] == 1
    task = _task(messages)
    task.plan = NESTED_PLAN
    decoded = _decode_task(encode(task))
    assert decoded.plan == NESTED_PLAN and hash(decoded.plan) == hash(NESTED_PLAN)


def test_a_term_built_with_a_dict_spec_is_frozen() -> None:
    term = LossTerm("nested_kd", weight=1.0, tau=2.0, teacher_spec={"width": 0.5, "exits": [1, 2]})
    assert isinstance(term.teacher_spec, FrozenMap) and term.teacher_spec["exits"] == (1, 2)
    assert term == LossTerm.nested_kd({"width": 0.5, "exits": (1, 2)}, weight=1.0, tau=2.0)
    assert hash(term) == hash(LossTerm.nested_kd({"exits": [1, 2], "width": 0.5}, weight=1.0, tau=2.0))
    assert term != LossTerm.nested_kd({"width": 0.25, "exits": [1, 2]}, weight=1.0, tau=2.0)
    assert plain(term)["teacher_spec"] == {"width": 0.5, "exits": [1, 2]}  # type: ignore[index]


def test_frozen_map_is_an_immutable_hashable_mapping() -> None:
    frozen = freeze({"a": {"b": [1, {"c": 2}]}, "d": 1.5})
    assert isinstance(frozen, FrozenMap) and isinstance(frozen["a"], FrozenMap)
    assert frozen["a"]["b"] == (1, FrozenMap({"c": 2}))
    assert frozen == {"a": {"b": [1, {"c": 2}]}, "d": 1.5} and frozen != {"a": {}, "d": 1.5} and frozen != [1]
    assert hash(frozen) == hash(freeze({"d": 1.5, "a": {"b": (1, {"c": 2})}}))
    assert len(frozen) == 2 and list(frozen) == ["a", "d"] and dict(frozen)["d"] == 1.5
    with pytest.raises(TypeError):
        frozen["x"] = 1  # type: ignore[index]
    assert copy.deepcopy(frozen) == frozen and freeze(frozen) is frozen


def test_plans_without_nested_kd_are_written_as_before(messages: dict[str, Message]) -> None:
    for plan in (TrainingPlan(), SAMPLE_PLAN, CANDIDATE_PLAN, SEGMENT_PLAN):
        assert all("teacher_spec" not in term for term in plan.to_dict()["loss"])  # type: ignore[union-attr]
    wire = wire_of(messages["task"])
    assert all("teacher_spec" not in term for term in wire["plan"]["loss"])
    assert all("teacher_spec" not in term for candidate in wire["adaptation"]["candidates"]
               for term in candidate["plan"]["loss"])
    # An explicit null is read as absent (as 'copies' is).
    data = SAMPLE_PLAN.to_dict()
    data["loss"][0]["teacher_spec"] = None  # type: ignore[index]
    assert TrainingPlan.from_dict(data) == SAMPLE_PLAN


def test_an_agent_that_predates_nested_kd_refuses_it_naming_the_kind(monkeypatch: pytest.MonkeyPatch,
                                                                       messages: dict[str, Message]) -> None:
    monkeypatch.setattr("protocol.plan.LOSS_KINDS", ("ce", "kd", "mutual_kd"))
    assert TrainingPlan.from_dict(SAMPLE_PLAN.to_dict()) == SAMPLE_PLAN  # every other plan still reads
    with pytest.raises(ProtocolError) as caught:
        TrainingPlan.from_dict(NESTED_PLAN.to_dict())
    reason = str(caught.value)
    assert reason.startswith("plan.loss[1].kind: unknown loss term kind") and "'nested_kd'" in reason
    assert "ce, kd, mutual_kd" in reason and "upgrade it" in reason
    wire = wire_of(messages["task"])
    wire["plan"] = NESTED_PLAN.to_dict()
    reason = _rejection(pack(wire))
    assert reason.startswith("task.plan.loss[1].kind: unknown loss term kind") and "'nested_kd'" in reason


def test_a_teacher_spec_is_held_to_the_readers_limits() -> None:
    data = NESTED_PLAN.to_dict()
    TrainingPlan.from_dict(data, Limits(max_list_len=4))  # 4 entries each: layer_widths, its 2, rounding
    with pytest.raises(ProtocolError, match=r"plan.loss\[1\].teacher_spec holds more than the limit of 3 entries"):
        TrainingPlan.from_dict(data, Limits(max_list_len=3))
    long_name = TrainingPlan(loss=(LossTerm.nested_kd({"layer_widths": {"x" * 13: 0.5}}, weight=1.0, tau=3.0),))
    with pytest.raises(ProtocolError, match=r"plan.loss\[0\].teacher_spec.layer_widths key is 13 characters long"):
        TrainingPlan.from_dict(long_name.to_dict(), Limits(max_str_len=12))


def test_ordered_dropout_stays_off_the_wire_unless_used_and_is_refused_malformed() -> None:
    plain = TrainingPlan()
    assert "widths" not in plain.to_dict() and not plain.ordered_dropout
    dropout = TrainingPlan(loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(1.0, 0.5))
    assert dropout.to_dict()["widths"] == [1.0, 0.5] and dropout.ordered_dropout
    # What an agent that predates it is sent: the spec itself, on the other terms.
    assert dropout.without_ordered_dropout() == TrainingPlan(loss=(LossTerm.ce(),))
    assert TrainingPlan(loss=(LossTerm.width_kd(),), widths=(0.5,)).without_ordered_dropout().loss == (LossTerm("ce"),)
    assert plain.without_ordered_dropout() is plain
    for widths, message in (([1.5], "distinct width rates in \\(0, 1\\]"), ([0.5, 0.5], "distinct"),
                            ([0], "must be > 0"), (["1"], "widths item"), (list(range(1, 40)), "limit of 32")):
        data = {**dropout.to_dict(), "widths": widths}
        with pytest.raises(ProtocolError, match=message):
            TrainingPlan.from_dict(data)
    bad_term = {**dropout.to_dict()}
    bad_term["loss"] = [*bad_term["loss"][:1], {**bad_term["loss"][1], "teacher": 0}]
    with pytest.raises(ProtocolError, match="a 'width_kd' term needs 'tau' and takes no 'teacher'"):
        TrainingPlan.from_dict(bad_term)


def test_ask_to_upload_stays_off_the_wire_unless_set(messages: dict[str, Message]) -> None:
    """Revision 6: a task that does not ask is what older agents read; one that asks says so, in both versions."""
    task = _task(messages)
    assert "ask_to_upload" not in msgpack.unpackb(encode(task, version=1))
    assert _decode_task(encode(task)).ask_to_upload is False
    asking = dataclasses.replace(task, ask_to_upload=True)
    for version in (1, 2):
        assert _decode_task(encode(asking, version=version)).ask_to_upload is True
    with pytest.raises(ProtocolError, match="ask_to_upload"):
        decode(pack({**wire_of(task), "ask_to_upload": "yes"}))


def test_the_update_clip_stays_off_the_wire_unless_set_and_is_refused_malformed() -> None:
    assert "update_clip" not in TrainingPlan().to_dict()
    private = TrainingPlan(update_clip=UpdateClip(2.0))
    assert private.to_dict()["update_clip"] == {"bound": 2.0, "noise_multiplier": 0.0}
    for clip, message in (({"bound": 0.0, "noise_multiplier": 0.0}, "bound must be > 0"),
                          ({"bound": 1.0, "noise_multiplier": -1.0}, "noise_multiplier must be >= 0"),
                          ({"bound": 1.0}, "missing field"), ({"bound": 1.0, "noise_multiplier": 0, "x": 1}, "unknown"),
                          (3.0, "must be a map")):
        with pytest.raises(ProtocolError, match=message):
            TrainingPlan.from_dict({**private.to_dict(), "update_clip": clip})

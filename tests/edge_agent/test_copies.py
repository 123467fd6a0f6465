"""m-FeDepth on the device: auxiliary copies kept between rounds, as many as the memory holds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edge_agent.calibration import Calibration
from edge_agent.copies import CopyStore, read_copies, write_copies
from models import SubmodelSpec, estimate_plan_memory
from protocol import LossTerm, ModelRef


def _mutual_plan(task_plan, copies: int):
    """The tests' plan with up to ``copies`` copies and a mutual distillation term (as FeDepth sends it)."""
    return replace(task_plan(loss=(LossTerm.ce(), LossTerm.mutual_kd(weight=1.0, tau=1.0))), copies=copies)


def test_write_and_read_copies_round_trip(tmp_path):
    copies = [{"a": np.arange(3, dtype=np.float32), "b": np.ones((2, 2), np.float32)},
              {"a": np.zeros(3, np.float32), "b": np.full((2, 2), 2.0, np.float32)}]
    path = tmp_path / "c.safetensors"
    write_copies(path, copies)
    back = read_copies(path, 2, ["a", "b"])
    for want, got in zip(copies, back):
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert not path.with_name("c.safetensors.tmp").exists()
    with pytest.raises(ValueError, match="lack copy 2"):
        read_copies(path, 3, ["a", "b"])
    with pytest.raises(ValueError, match="lack copy 0's \\['c'\\]"):
        read_copies(path, 1, ["a", "c"])
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read the stored copies"):
        read_copies(tmp_path / "bad.safetensors", 1, ["a"])


def test_the_store_initialises_at_random_keeps_and_tops_up(tmp_path, family, model_ref):
    store = CopyStore(tmp_path / "copies")
    spec = SubmodelSpec.full()
    first = store.load(model_ref, family, spec, 2, seed=5)
    assert len(first) == 2 and set(first[0]) == set(family.state_keys(spec))
    assert not np.array_equal(first[0]["conv1.weight"], first[1]["conv1.weight"])  # distinct initialisations
    again = store.load(model_ref, family, spec, 2, seed=5)
    assert all(np.array_equal(first[0][k], again[0][k]) for k in first[0])  # same seed, same start
    trained = [{k: v + 1.0 for k, v in copy.items()} for copy in first[:1]]
    store.save(model_ref, spec, trained)
    kept = store.load(model_ref, family, spec, 2, seed=9)
    assert all(np.array_equal(kept[0][k], trained[0][k]) for k in kept[0])  # continues from what was kept
    assert not np.array_equal(kept[1]["conv1.weight"], trained[0]["conv1.weight"])  # the second is new
    # Another spec or model has its own copies.
    assert store.path(model_ref, spec) != store.path(model_ref, SubmodelSpec.uniform(0.5))
    assert store.path(model_ref, spec) != store.path(ModelRef("cnn", 10, 1, {"hidden": [4, 4]}), spec)


def test_a_device_with_room_trains_the_plans_copies_and_keeps_the_others(family, make_task, make_runner,
                                                                         task_plan, tmp_path):
    plan = _mutual_plan(task_plan, 3)
    runner = make_runner()
    task = make_task(SubmodelSpec.full(), plan=plan)
    update = runner.run(task)
    assert update.status == "ok", update.reason
    assert update.metrics["copies"] == 3.0
    assert "trained 3 of up to 3 copies with mutual distillation" in update.reason
    assert set(update.weights) == set(family.trainable_keys(SubmodelSpec.full()))  # one model is uploaded
    path = CopyStore(runner.copies_dir).path(task.model, SubmodelSpec.full())
    kept = read_copies(path, 2, family.state_keys(SubmodelSpec.full()))
    fresh = CopyStore(tmp_path / "fresh").load(task.model, family, SubmodelSpec.full(), 2, seed=plan.seed)
    assert not np.array_equal(kept[0]["conv1.weight"], fresh[0]["conv1.weight"])  # trained, then kept
    # The next round continues from the kept copies.
    runner.run(make_task(SubmodelSpec.full(), plan=plan, task_id="r2-agent-0001", round_number=2))
    after = read_copies(path, 2, family.state_keys(SubmodelSpec.full()))
    assert not np.array_equal(after[0]["conv1.weight"], kept[0]["conv1.weight"])


def test_a_device_takes_as_many_copies_as_its_memory_holds(family, make_task, make_runner, task_plan):
    spec = SubmodelSpec.full()
    plan = _mutual_plan(task_plan, 3)
    estimates = {m: estimate_plan_memory(family, spec, replace(plan, copies=m), input_size=(8, 8)) for m in (1, 2, 3)}
    assert estimates[1].total < estimates[2].total < estimates[3].total
    corrected = {m: Calibration().corrected(e.total, e.overhead) for m, e in estimates.items()}
    update = make_runner(budget=(corrected[2] + corrected[3]) // 2).run(make_task(spec, plan=plan))
    assert update.status == "ok", update.reason
    assert update.metrics["copies"] == 2.0
    assert "trained 2 of up to 3 copies" in update.reason
    update = make_runner(budget=(corrected[1] + corrected[2]) // 2, name="poorer").run(make_task(spec, plan=plan))
    assert update.status == "ok", update.reason
    assert "copies" not in update.metrics and "trained 1 of up to 3 copies" in update.reason


def test_a_device_short_of_even_one_copy_names_every_option_it_tried(make_task, make_runner, task_plan):
    update = make_runner(budget=1000).run(make_task(SubmodelSpec.full(), plan=_mutual_plan(task_plan, 2)))
    assert update.status == "declined"
    assert "estimated: width=1 x2 copies " in update.reason and ", width=1 " in update.reason

"""DepthFL: depth levels at the stage ends with a classifier after each stage (parameter counts by hand), the
mutual self-distillation loss against a hand-computed case, the levels clients get for their memory, the
distillation ramp, and the ensemble of the classifiers."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.nn import functional as F

from coordinator.config import CoordinatorConfig, DepthFLConfig, ModelConfig
from coordinator.evaluation import accuracies
from coordinator.strategies import make_strategy
from coordinator.strategies.depthfl import kd_ramp, mutual_distillation_loss
from models import SubmodelSpec, get_family
from models.training import loss_of

PRERESNET20 = get_family("preresnet20", 10, 1, exit_convs=0)


def depthfl(make_context, *, cost=None, **settings):
    config = CoordinatorConfig(model=ModelConfig(family="preresnet20", options={"exit_convs": 0}),
                               depthfl=DepthFLConfig(**settings))
    return make_strategy("depthfl", make_context(config, family=PRERESNET20,
                                                 **({"cost": cost} if cost else {})))


def body_params(spec: SubmodelSpec) -> int:
    return sum(math.prod(shape) for key, shape in PRERESNET20.shapes(spec, track_bn_stats=False).items()
               if not key.startswith("exits."))


def test_levels_end_at_each_stage_with_a_classifier_after_every_stage(make_context):
    strategy = depthfl(make_context)
    assert PRERESNET20.stage_ends == (3, 6, 9)
    assert [(level.name, level.spec) for level in strategy.levels] == [
        ("3", SubmodelSpec(exits=(2, 5))),
        ("2", SubmodelSpec(depth=6, exits=(2, 5))),
        ("1", SubmodelSpec(depth=3, exits=(2,)))]
    assert [PRERESNET20.num_outputs(level.spec) for level in strategy.levels] == [3, 2, 1]
    # PreResNet-20 on one input channel, by hand: the stem 3x3x1x16; a stage-1 block two 3x3x16x16 convolutions
    # and two BNs of 16 (weight and bias); stage 2's first block 3x3x16x32 + 3x3x32x32, a 1x1x16x32 shortcut,
    # BNs of 16 and 32; its other blocks as stage 1's at 32 channels.
    stage1 = 144 + 3 * (2 * 2304 + 2 * 32)
    stage2 = (4608 + 9216 + 512 + 32 + 64) + 2 * (2 * 9216 + 2 * 64)
    assert body_params(strategy.levels[2].spec) == stage1
    assert body_params(strategy.levels[1].spec) == stage1 + stage2
    # Every level is nested in the deeper ones: a client short of memory falls to a shallower one.
    assert PRERESNET20.is_nested(strategy.levels[2].spec, strategy.levels[1].spec)
    assert PRERESNET20.is_nested(strategy.levels[1].spec, strategy.levels[0].spec)


def test_a_plain_cnns_stages_are_its_blocks():
    assert get_family("cnn", 10, 1).stage_ends == tuple(range(1, get_family("cnn", 10, 1).num_blocks + 1))


def test_mutual_distillation_matches_the_papers_loss_by_hand():
    torch.manual_seed(0)
    logits = [torch.randn(4, 5, requires_grad=True) for _ in range(3)]
    targets = torch.tensor([0, 3, 1, 4])
    weight = 0.6
    loss = loss_of(logits, targets, mutual_distillation_loss(3, weight=weight))

    def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:  # KL(p_teacher || p_student), batch mean
        p = torch.softmax(teacher, dim=1)
        return (p * (torch.log(p) - torch.log_softmax(student, dim=1))).sum(dim=1).mean()

    by_hand = sum(F.cross_entropy(z, targets) for z in logits)
    by_hand = by_hand + sum(weight / 2 * kl(logits[j].detach(), logits[i])
                            for i in range(3) for j in range(3) if i != j)
    assert torch.allclose(loss, by_hand)
    # Each classifier is pulled towards the others, never the others towards it: the gradient of the loss is that
    # of its own cross-entropy and its own distillation terms alone.
    (grad,) = torch.autograd.grad(loss, [logits[0]])
    own = F.cross_entropy(logits[0], targets) + weight / 2 * (kl(logits[1].detach(), logits[0])
                                                              + kl(logits[2].detach(), logits[0]))
    (expected,) = torch.autograd.grad(own, [logits[0]])
    assert torch.allclose(grad, expected)


def test_one_classifier_or_no_weight_leaves_the_cross_entropies():
    assert [term.kind for term in mutual_distillation_loss(1, weight=1.0)] == ["ce"]
    assert [term.kind for term in mutual_distillation_loss(3, weight=0.0)] == ["ce"] * 3
    terms = mutual_distillation_loss(3, weight=1.0)
    assert sorted((t.output, t.teacher) for t in terms if t.kind == "kd") == [
        (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert all(t.weight == 0.5 and t.detach_teacher and t.tau == 1.0 for t in terms if t.kind == "kd")
    with pytest.raises(ValueError, match="at least one classifier"):
        mutual_distillation_loss(0, weight=1.0)


def test_each_client_trains_the_deepest_level_its_memory_fits(make_context, make_agent):
    def cost(spec, plan):  # bytes by depth: 300 for the first stage, 600 for two, 1000 for the whole body
        return {3: 300, 6: 600}.get(spec.depth, 1000)

    strategy = depthfl(make_context, cost=cost)
    agents = [make_agent("deep", 1000), make_agent("mid", 700), make_agent("shallow", 300), make_agent("tiny", 200)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    assert {task.agent_id: task.level for task in plan.tasks} == {"deep": "3", "mid": "2", "shallow": "1"}
    assert [skip.agent_id for skip in plan.skipped] == ["tiny"]
    deep = next(task for task in plan.tasks if task.agent_id == "deep")
    assert len([t for t in deep.plan.loss if t.kind == "ce"]) == 3
    assert len([t for t in deep.plan.loss if t.kind == "kd"]) == 6
    # Short of memory, the deep client may fall to either shallower level.
    assert deep.adaptation is not None and [candidate.spec for candidate in deep.adaptation.candidates] == [
        SubmodelSpec(depth=6, exits=(2, 5)).to_dict(), SubmodelSpec(depth=3, exits=(2,)).to_dict()]


def test_the_reference_codes_ramp_of_the_distillation_weight(make_context):
    assert kd_ramp(7, 0) == 1.0
    assert kd_ramp(0, 300) == pytest.approx(math.exp(-5))
    assert kd_ramp(150, 300) == pytest.approx(math.exp(-1.25))
    assert kd_ramp(300, 300) == kd_ramp(900, 300) == 1.0
    strategy = depthfl(make_context, kd_weight=0.5, kd_rampup=10)
    plan = strategy.level_plan(strategy.levels[0], 5)
    weights = [t.weight for t in plan.loss if t.kind == "kd"]
    assert len(weights) == 6 and weights == pytest.approx([0.5 * math.exp(-5 * 0.25) / 2] * 6)


def test_the_global_model_is_evaluated_at_every_classifier_and_as_their_ensemble(make_context):
    targets = depthfl(make_context).eval_targets()
    assert set(targets) == {"global", "ensemble", "3", "2", "1"}
    assert targets["ensemble"].ensemble and targets["ensemble"].spec == targets["global"].spec


def test_the_ensemble_is_the_mean_of_the_classifiers_logits():
    family = get_family("cnn", 3, 1, hidden=[4, 4, 4])
    spec = SubmodelSpec(exits=(0, 1))
    torch.manual_seed(1)
    model = family.build(spec).eval()
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40,))
    *each, ensemble = accuracies(model, x, y, batch_size=16, ensemble=True)
    assert each == accuracies(model, x, y, batch_size=16)
    with torch.no_grad():
        mean = torch.stack(list(model.forward_exits(x))).mean(dim=0)
    assert ensemble == int((mean.argmax(dim=1) == y).sum()) / len(y)


def test_bad_settings_are_refused():
    for settings, message in (({"kd_weight": -1.0}, "kd_weight"), ({"kd_rampup": -2}, "kd_rampup"),
                              ({"tau": 0.0}, "tau")):
        with pytest.raises(ValueError, match=message):
            CoordinatorConfig(depthfl=DepthFLConfig(**settings)).validate()


def test_depths_may_be_set_and_too_many_classifiers_are_refused_at_set_up(make_context):
    vgg16 = get_family("vgg16", 10, 1, exit_convs=0)
    config = CoordinatorConfig(model=ModelConfig(family="vgg16", options={"exit_convs": 0}))
    with pytest.raises(ValueError, match="13 classifiers on model 'vgg16' need 169 loss terms"):
        make_strategy("depthfl", make_context(config, family=vgg16))
    pooled = CoordinatorConfig(model=config.model, depthfl=DepthFLConfig(depths=[2, 4, 7, 10, 13]))
    strategy = make_strategy("depthfl", make_context(pooled, family=vgg16))
    assert [level.spec for level in strategy.levels][::-1] == [
        SubmodelSpec(depth=2, exits=(1,)), SubmodelSpec(depth=4, exits=(1, 3)), SubmodelSpec(depth=7, exits=(1, 3, 6)),
        SubmodelSpec(depth=10, exits=(1, 3, 6, 9)), SubmodelSpec(exits=(1, 3, 6, 9))]
    short = CoordinatorConfig(model=config.model, depthfl=DepthFLConfig(depths=[2, 4]))
    with pytest.raises(ValueError, match="must end with every block of model 'vgg16' \\(13\\)"):
        make_strategy("depthfl", make_context(short, family=vgg16))
    with pytest.raises(ValueError, match="depthfl.depths must be increasing"):
        CoordinatorConfig(depthfl=DepthFLConfig(depths=[4, 2])).validate()


def test_its_classifiers_are_heads_without_convolutions_unless_the_model_options_say_otherwise() -> None:
    """DepthFL's default heads are the cheapest that keep its mutual distillation (exit_convs 0): with three
    convolutions each, the strongest fair tier (the plain model's memory) trained its first level only."""
    from coordinator.planning import model_options

    assert model_options(CoordinatorConfig(algorithm="depthfl", model=ModelConfig(family="preresnet20"))) == {
        "exit_convs": 0}
    chosen = CoordinatorConfig(algorithm="depthfl", model=ModelConfig(family="preresnet20", options={"exit_convs": 2}))
    assert model_options(chosen) == {"exit_convs": 2}
    assert model_options(CoordinatorConfig(algorithm="scalefl", model=ModelConfig(family="preresnet20"))) == {}



def test_a_checkpoint_made_with_other_heads_is_refused_with_the_setting_that_resumes_it(tmp_path) -> None:
    """A DepthFL checkpoint from before its heads lost their convolutions names the setting to resume it; one that
    records its model options names them."""
    from common.data import load_dataset
    from coordinator.checkpoint import restore_checkpoint, save_checkpoint
    from coordinator.config import DataConfig
    from coordinator.planning import model_family, strategy_for

    digits = load_dataset("digits")
    made = CoordinatorConfig(algorithm="depthfl", model=ModelConfig(family="preresnet20", options={"exit_convs": 3}),
                             data=DataConfig(dataset="digits", bn_samples=20))
    states = strategy_for(made, digits, model_family(made, digits)).initial_states(0)
    now = CoordinatorConfig(algorithm="depthfl", model=ModelConfig(family="preresnet20"),
                            data=DataConfig(dataset="digits", bn_samples=20))
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, states, {"round": 2, "algorithm": "depthfl", "family": "preresnet20"})
    with pytest.raises(ValueError, match="set model.options.exit_convs: 3 to resume it"):
        restore_checkpoint(path, now, strategy_for(now, digits))
    save_checkpoint(path, states, {"round": 2, "algorithm": "depthfl", "family": "preresnet20",
                                   "model_options": {"exit_convs": 3}})
    with pytest.raises(ValueError, match="made with model options {'exit_convs': 3}, this run has {'exit_convs': 0}"):
        restore_checkpoint(path, now, strategy_for(now, digits))
    assert restore_checkpoint(path, made, strategy_for(made, digits))[1] == 2
    assert model_family(now, digits).options["exit_convs"] == 0 and model_family(made, digits).options["exit_convs"] == 3

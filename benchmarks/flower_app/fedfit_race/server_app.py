"""The ServerApp: Flower's own FedAvg (sample-weighted by ``num-examples``) on FedFit's workload, timed per round.

Set up as FedFit's coordinator sets itself up (``coordinator.planning.strategy_for`` on the same configuration and
dataset): the same initial weights (``strategy.initial_states(seed)``), the same training plan (sent to the
clients as JSON in the train config), the same evaluation (``coordinator.evaluation.Evaluator``: static-BN
statistics recomputed on the server's ``data.bn_samples`` training sample, then accuracy on the test set).
Federated evaluation is off (``fraction_evaluate=0``); the global model is evaluated on the server after every
round, as FedFit's coordinator does. What goes down is ``family.state_keys`` of the full model (what a FedFit task
carries), what comes back ``family.trainable_keys`` (what a FedFit update carries).

Per round it records (Unix times): ``start`` (``configure_train`` entered: the round begins), ``replies_in``
(``aggregate_train`` entered: every reply is in), ``aggregated``, ``eval_start`` and ``evaluated`` (the round's
end), and every reply's metrics (see ``client_app``). It writes them with the accuracies to the run config's
``out-file``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from common.data import load_dataset, subsample
from coordinator.evaluation import Evaluator
from coordinator.planning import model_family, strategy_for
from fedfit_race.task import coordinator_config, load_workload
from models import SubmodelSpec

app = ServerApp()


class TimedFedAvg(FedAvg):
    """Flower's FedAvg, unchanged, with the time each round's phases begin and every reply's metrics recorded."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rounds: dict[int, dict[str, Any]] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.rounds[server_round] = {"round": server_round, "start": time.time()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        record = self.rounds[server_round]
        record["replies_in"] = time.time()
        replies = list(replies)
        record["clients"] = [dict(next(iter(reply.content.metric_records.values())))
                             for reply in replies if not reply.has_error()]
        record["errors"] = [str(reply.error.reason) for reply in replies if reply.has_error()]
        result = super().aggregate_train(server_round, replies)
        record["aggregated"] = time.time()
        return result


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the workload's rounds and write the timings and accuracies to ``out-file``."""
    workload = load_workload(str(context.run_config["workload-file"]))
    config = coordinator_config(workload)
    dataset = load_dataset(config.data.dataset, config.data.root)
    family = model_family(config, dataset)
    strategy = strategy_for(config, dataset, family)
    spec = SubmodelSpec.full()
    state = strategy.initial_states(config.seed)["global"]
    test_x, test_y = dataset.x_test, dataset.y_test
    if config.data.eval_samples is not None:
        test_x, test_y = subsample(test_x, test_y, config.data.eval_samples, config.seed)
    evaluator = Evaluator(family, strategy.context.server_x, torch.tensor(np.asarray(test_x)),
                          torch.tensor(np.asarray(test_y), dtype=torch.long))
    clients = int(workload["clients"])
    fedavg = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                         min_available_nodes=clients)
    accuracy: dict[int, float] = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # FedFit does not evaluate the initial model either
            return None
        fedavg.rounds[server_round]["eval_start"] = time.time()
        for key, value in arrays.to_torch_state_dict().items():
            state[key] = value
        outputs, _ = evaluator.evaluate(state, spec)
        accuracy[server_round] = outputs[-1]
        fedavg.rounds[server_round]["evaluated"] = time.time()
        return MetricRecord({"accuracy": outputs[-1]})

    model = {"family": config.model.family, "num_classes": dataset.num_classes, "in_channels": dataset.in_channels,
             "options": dict(config.model.options)}
    train_config = ConfigRecord({"plan": json.dumps(strategy.recipe_plan().to_dict()), "model": json.dumps(model),
                                 "seed": config.seed})
    initial = ArrayRecord({key: state[key] for key in family.state_keys(spec)})
    fedavg.start(grid=grid, initial_arrays=initial, num_rounds=config.rounds, timeout=config.round_timeout_s,
                 train_config=train_config, evaluate_fn=evaluate)
    rounds = [{**fedavg.rounds[r], "global_accuracy": accuracy.get(r)} for r in sorted(fedavg.rounds)]
    out = Path(str(context.run_config["out-file"]))
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps({"rounds": rounds}))
    partial.rename(out)

"""The ClientApp: trains the global model on this SuperNode's shard exactly as a FedFit agent's training child does.

The same family builds the model (``track_bn_stats=False``: static BN), the same ``models.train`` runs the plan the
server sent (FedFit's recipe plan, with the seed FedFit's coordinator would give this agent in this round), and
the reply carries the same tensors an update carries (``family.trainable_keys``) with the sample count FedAvg
weights by. Node config (``flower-supernode --node-config``): ``agent-id`` (FedFit's agent id: the seed depends
on it), ``data-file`` (the shard as an .npz of float32 ``x`` and int64 ``y``, read with ``allow_pickle=False``;
``flower_race.py`` writes it from ``common.data.load_shard``) and ``torch-threads``.

Besides ``num-examples`` the reply's metrics carry ``train-seconds`` (``TrainResult.seconds``, the figure a FedFit
agent reports as ``seconds``) and Unix times for the race's breakdown: ``process-start`` (this ClientApp process),
``handler-start`` (this function entered: the message is here), ``train-start``, ``train-end`` and
``reply-ready``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfit_race.task import process_start_time, task_seed
from models import SubmodelSpec, get_family, train
from protocol import TrainingPlan

app = ClientApp()


@app.train()
def train_task(msg: Message, context: Context) -> Message:
    """One round's local training on this node's shard."""
    handler_start = time.time()
    config = msg.content["config"]
    node = context.node_config
    torch.set_num_threads(int(node["torch-threads"]))
    with np.load(str(node["data-file"]), allow_pickle=False) as archive:
        x = torch.from_numpy(np.array(archive["x"], dtype=np.float32))
        y = torch.from_numpy(np.array(archive["y"], dtype=np.int64))
    model_ref = json.loads(str(config["model"]))
    family = get_family(model_ref["family"], int(model_ref["num_classes"]), int(model_ref["in_channels"]),
                        **model_ref["options"])
    spec = SubmodelSpec.full()
    plan = TrainingPlan.from_dict(json.loads(str(config["plan"])))
    plan = replace(plan, seed=task_seed(int(config["seed"]), int(config["server-round"]), str(node["agent-id"])))
    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
    labels = sorted(int(label) for label in np.unique(y.numpy()))
    train_start = time.time()
    result = train(model, spec, x, y, plan, labels=labels, num_classes=family.num_classes, device="cpu")
    train_end = time.time()
    trained = model.state_dict()
    arrays = ArrayRecord({key: trained[key].detach() for key in family.trainable_keys(spec)})
    metrics = MetricRecord({
        "num-examples": len(y), "train-seconds": float(result.seconds), "loss": float(result.loss),
        "steps": int(result.steps), "shard": int(node["shard"]), "process-start": process_start_time(),
        "handler-start": handler_start, "train-start": train_start, "train-end": train_end,
        "reply-ready": time.time()})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

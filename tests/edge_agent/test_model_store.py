"""edge_agent.model_store: a delivered model is kept only whole, checked and fitting; the one held before stays
otherwise, and a restarted agent knows what it holds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import structlog

from common.model_package import InputSpec, Manifest, ManifestError, ModelEntry, read_manifest, write_file
from coordinator.model_courier import delivery
from edge_agent.model_store import CURRENT, ModelStore
from protocol import MODEL_DELIVERY_REVISION, AgentReport, CoordinatorStatus, ProtocolError

LOG = structlog.get_logger()


def folder_of(tmp_path: Path, *names: str, memory: int = 1000) -> tuple[Path, Manifest]:
    """A model folder whose models' files are bytes made up for the test (the store reads no graph)."""
    folder = tmp_path / "export"
    entries = []
    for name in names:
        graph = write_file(folder, f"{name}/model.onnx", f"graph {name}".encode())
        state = write_file(folder, f"{name}/model.safetensors", f"state {name}".encode())
        entries.append(ModelEntry(name, {"width": 1.0}, 10, 100, 1, "last", (), (100,), 0.5, (0.5,), True, False,
                                  memory, graph, state))
    return folder, Manifest("heterofl", "cnn", {}, 10, 3, "run", InputSpec(1, 8, 8, 0.0, 1.0),
                            tuple(map(str, range(10))), tuple(entries))


def test_a_delivered_model_is_stored_and_the_link_switched(tmp_path: Path) -> None:
    folder, manifest = folder_of(tmp_path, "b", "c")
    store = ModelStore(tmp_path / "agent", LOG)
    assert store.held == "" and store.folder is None
    held = store.receive(delivery(folder, manifest, manifest.model("b"), "pi-01"), available=10_000)
    assert held == f"b@{manifest.model('b').onnx.sha256}" and store.held == held
    kept = read_manifest(tmp_path / "agent" / CURRENT)
    assert [entry.name for entry in kept.models] == ["b"] and kept.input == manifest.input
    assert (tmp_path / "agent" / CURRENT / "b" / "model.onnx").read_bytes() == b"graph b"
    first = (tmp_path / "agent" / CURRENT).resolve()
    store.receive(delivery(folder, manifest, manifest.model("c"), "pi-01"), available=10_000)
    assert store.held.startswith("c@") and not first.exists()  # the earlier folder is gone once the link moved
    assert ModelStore(tmp_path / "agent", LOG).held == store.held  # a restarted agent reads what it holds


def test_a_refused_delivery_leaves_the_model_held(tmp_path: Path) -> None:
    folder, manifest = folder_of(tmp_path, "b", "c")
    store = ModelStore(tmp_path / "agent", LOG)
    held = store.receive(delivery(folder, manifest, manifest.model("c"), "pi-01"), available=10_000)
    good = delivery(folder, manifest, manifest.model("b"), "pi-01")
    altered = replace(good, weights={**good.weights, "b/model.onnx": np.frombuffer(b"graph B", dtype=np.uint8)})
    extra = replace(good, weights={**good.weights, "b/other.bin": np.zeros(1, dtype=np.uint8)})
    two = replace(good, manifest={**good.manifest, "models": good.manifest["models"] * 2})
    for bad, match in ((altered, "does not match its digest"), (extra, "came with files"),
                       (two, "name model 'b' alone|names a model twice"), (replace(good, name="c"), "alone")):
        with pytest.raises(ManifestError, match=match):
            store.receive(bad, available=10_000)
    with pytest.raises(ManifestError, match="needs 0.0 MiB to run and 0.0 MiB are available"):
        store.receive(good, available=999)
    assert store.held == held and read_manifest(tmp_path / "agent" / CURRENT).models[0].name == "c"
    with pytest.raises(ManifestError, match="keeps no state"):
        ModelStore(None, LOG).receive(good, available=10_000)


def test_the_report_names_the_model_held_and_the_last_refusal_only_to_a_coordinator_that_reads_them(
        tmp_path: Path) -> None:
    folder, manifest = folder_of(tmp_path, "b", "c")
    store = ModelStore(tmp_path / "agent", LOG)
    store.take(delivery(folder, manifest, manifest.model("c"), "pi-01"), "pi-01", available=10_000)
    held = store.held
    assert held.startswith("c@") and store.refused == ""
    store.take(delivery(folder, manifest, manifest.model("b"), "pi-01"), "pi-01", available=999)  # too large now
    assert store.held == held and store.refused.startswith(f"b@{manifest.model('b').onnx.sha256}: model 'b' needs")
    with pytest.raises(ProtocolError, match="addressed to 'pi-01' arrived at 'pi-02'"):
        store.take(delivery(folder, manifest, manifest.model("b"), "pi-01"), "pi-02", available=10_000)
    for state, revision, reads in (("online", MODEL_DELIVERY_REVISION, True),
                                   ("online", MODEL_DELIVERY_REVISION - 1, False),
                                   ("offline", MODEL_DELIVERY_REVISION, False)):
        store.note_coordinator(CoordinatorStatus("fed", state, 3, 0.0, revision=revision))
        report = AgentReport(since=0.0)
        store.fill(report)
        assert (report.model, report.model_refused) == ((held, store.refused) if reads else ("", ""))

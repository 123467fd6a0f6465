"""The model this device holds to run: the one its coordinator delivered at the end of a federation
(:class:`~protocol.ModelDelivery`), kept beside the agent's state as a model folder (:mod:`common.model_package`)
that ``fedfit predict --model STATE_DIR/AGENT/model`` runs.

A delivery is stored only when its manifest names the one model it carries, every file it carries is one the
manifest names with the same size and sha256, and the model fits the memory the device has now. It is written into
a folder of its own under ``models/`` and then ``model`` (a symbolic link) is switched to it in one rename: an
interrupted transfer or write leaves the model held before, whole. Nothing is unpickled: JSON, ONNX, safetensors.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common.durable import sync_directory
from common.logs import Logger
from common.model_package import (
    Manifest,
    ManifestError,
    manifest_from_dict,
    read_manifest,
    sha256_of,
    write_file,
    write_manifest,
)
from protocol import MODEL_DELIVERY_REVISION, AgentReport, CoordinatorStatus, ModelDelivery, ProtocolError

__all__ = ["CURRENT", "ModelStore"]

#: The link to the folder of the model held, in the agent's own state directory.
CURRENT = "model"
#: The folders of the models received, in the agent's own state directory.
FOLDERS = "models"


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


class ModelStore:
    """The model held in ``own_dir`` (None: an agent without a state directory, which keeps none)."""

    def __init__(self, own_dir: Path | None, log: Logger) -> None:
        self.root = own_dir
        self.log = log
        self.held = self._read_held()
        #: The last delivery refused, ``name@sha256: reason`` (empty: none since the agent started).
        self.refused = ""
        #: The coordinator's retained status says it reads the model held (protocol.MODEL_DELIVERY_REVISION).
        self.coordinator_reads = False

    def note_coordinator(self, status: CoordinatorStatus) -> None:
        """Whether the agent's reports name the model it holds, as the coordinator's status says."""
        self.coordinator_reads = status.state == "online" and status.revision >= MODEL_DELIVERY_REVISION

    def fill(self, report: AgentReport) -> None:
        """Name the model held and the last refusal in ``report`` when the coordinator reads them."""
        if self.coordinator_reads:
            report.model, report.model_refused = self.held, self.refused

    def take(self, delivery: ModelDelivery, agent_id: str, available: int) -> None:
        """Store ``delivery`` addressed to ``agent_id`` when it checks out and fits ``available`` bytes (logged);
        a refusal is kept for the report, which says so: the coordinator does not wait for it. ProtocolError when
        it is addressed to another agent."""
        if delivery.agent_id != agent_id:
            raise ProtocolError(f"model addressed to {delivery.agent_id!r} arrived at {agent_id!r}")
        try:
            held = self.receive(delivery, available)
        except (ManifestError, OSError) as exc:
            self.refused = f"{self.offered(delivery)}: {exc}"
            self.log.warning("model_refused", model=delivery.name, round=delivery.round, reason=str(exc))
            return
        self.log.info("model_stored", model=held, folder=str(self.folder))

    @property
    def folder(self) -> Path | None:
        """The model folder held (None when none is)."""
        return self.root / CURRENT if self.root is not None and self.held else None

    def _read_held(self) -> str:
        """``name@sha256`` of the model the link points to, empty when there is none (or it cannot be read)."""
        if self.root is None or not (self.root / CURRENT).exists():
            return ""
        try:
            entry = read_manifest(self.root / CURRENT).models[0]
        except ManifestError as exc:
            self.log.warning("held_model_unreadable", reason=str(exc))
            return ""
        return f"{entry.name}@{entry.onnx.sha256}"

    @staticmethod
    def offered(delivery: ModelDelivery) -> str:
        """``name@sha256`` of the ONNX graph ``delivery`` says it carries (its name alone where its manifest does not
        say)."""
        try:
            return f"{delivery.name}@{delivery.manifest['models'][0]['onnx']['sha256']}"
        except (KeyError, IndexError, TypeError):
            return delivery.name

    def receive(self, delivery: ModelDelivery, available: int) -> str:
        """Check and store ``delivery`` (see the module docstring), ``available`` bytes of memory free now; returns
        ``name@sha256`` of the model now held. ManifestError (one sentence) when it is refused: the model held before
        stays."""
        if self.root is None:
            raise ManifestError("this agent keeps no state (no state_dir), so it keeps no model")
        manifest = manifest_from_dict(delivery.manifest, "the delivered manifest")
        if len(manifest.models) != 1 or manifest.models[0].name != delivery.name:
            raise ManifestError(f"the delivered manifest must name model {delivery.name!r} alone, it names "
                                f"{', '.join(entry.name for entry in manifest.models)}")
        entry = manifest.models[0]
        files = {file.path: file for file in (entry.onnx, entry.state, *entry.stages)}
        if set(files) != set(delivery.weights):
            raise ManifestError(f"model {entry.name!r} came with files {sorted(delivery.weights)}, its manifest names "
                                f"{sorted(files)}")
        contents = {path: delivery.weights[path].tobytes() for path in files}
        for path, data in contents.items():
            if sha256_of(data) != files[path].sha256 or len(data) != files[path].bytes:
                raise ManifestError(f"file {path} of model {entry.name!r} does not match its digest: it was altered "
                                    f"or cut short")
        if entry.inference_bytes > available:
            raise ManifestError(f"model {entry.name!r} needs {_mib(entry.inference_bytes)} to run and "
                                f"{_mib(available)} are available")
        held = f"{entry.name}@{entry.onnx.sha256}"
        if held == self.held:
            return held
        self._store(f"{entry.onnx.sha256[:16]}", contents, manifest)
        self.held = held
        return held

    def _store(self, name: str, contents: dict[str, bytes], manifest: Manifest) -> None:
        assert self.root is not None
        folders = self.root / FOLDERS
        target = folders / name
        partial = folders / f".{name}.partial"
        if folders.is_dir():  # what an interrupted write left
            for left in folders.glob(".*.partial"):
                shutil.rmtree(left, ignore_errors=True)
        for path, data in contents.items():
            write_file(partial, path, data)
        write_manifest(partial, manifest)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        sync_directory(folders)
        link = self.root / f".{CURRENT}.new"
        link.unlink(missing_ok=True)
        link.symlink_to(Path(FOLDERS) / name)
        os.replace(link, self.root / CURRENT)  # the switch: the link names the new folder, or still the old one
        sync_directory(self.root)  # on disk before the old folder goes
        for other in folders.iterdir():
            if other.name != name and not other.name.startswith("."):
                shutil.rmtree(other, ignore_errors=True)

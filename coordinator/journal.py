"""The round in flight, on disk: what a coordinator restarted after a crash needs to finish that same round.

``state_dir/round/`` holds ``round.json`` (the round, its deadline, the skipped agents and, per task, its id,
level and group) and one ``task-<digest>.msgpack`` per task (the task message without weights: spec, plan,
adaptation, and its own round and deadline: a buffered round's tasks carried from earlier rounds keep theirs),
written before the first task goes out, with ``base-<round>.safetensors``, the states each earlier round's carried
tasks were cut from (what their updates are rebased from), and one ``update-<digest>.msgpack`` per update stored
for aggregation (the update message as it arrived), written before that update is acked. Everything is msgpack or
JSON, each file written atomically. The journal is cleared once the round's checkpoint is written (a buffered
round's is replaced by what the next round carries, marked unplanned); a journal of a round the checkpoint already
holds is stale and ignored.

A kill may come at any moment, so the journal is never seen half-written or half-removed: a new one writes its task
and base files first, then replaces ``round.json`` at once, and only then removes what the new index no longer
names; clearing removes ``round.json`` first. What a buffered round's next round carries is written
(``next.json``, with the base of the round's own tasks) before the round's checkpoint, so that a kill between the
checkpoint and the new index loses no carried task (:meth:`RoundJournal.carry_on`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.durable import sync_directory, write_atomic
from coordinator.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from coordinator.round import DispatchedTask
from coordinator.tasks import Skip, State, TaskPlan
from models import SubmodelSpec
from protocol import ModelRef, ProtocolError, Task, Update, decode, encode

__all__ = ["JournaledRound", "RoundJournal"]


@dataclass
class JournaledRound:
    """A round read back from the journal: its tasks by id, the skipped agents, the tasks it carried from earlier
    rounds and the states those were cut from, by round (its stored updates are read one at a time:
    :meth:`RoundJournal.stored`)."""

    round: int
    deadline: float
    tasks: dict[str, TaskPlan]
    skipped: list[Skip]
    carried: list[DispatchedTask] = field(default_factory=list)
    bases: dict[int, dict[str, State]] = field(default_factory=dict)
    #: False for what a buffered round leaves once checkpointed: the tasks the next round carries, before that
    #: round is planned (a coordinator restarted then plans it, carrying them).
    planned: bool = True


def _digest(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()[:24]  # a task id is wire data: never a file name


def _entries(dispatched_tasks: Sequence[DispatchedTask]) -> list[dict[str, str]]:
    """An index's entries of ``dispatched_tasks``: id, level and group (the rest is in each task's file)."""
    return [{"task_id": dispatched.task_id, "level": dispatched.task.level, "group": dispatched.task.group}
            for dispatched in dispatched_tasks]


class RoundJournal:
    """Writes and reads the journal of the round in flight in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, model: ModelRef) -> None:
        self.directory = directory
        self.model = model

    def begin(self, round_number: int, deadline: float, tasks: dict[str, TaskPlan], skipped: list[Skip],
              carried: Sequence[DispatchedTask] = (), bases: Mapping[int, Mapping[str, State]] | None = None, *,
              planned: bool = True) -> None:
        """Record a round's plan (replacing any earlier journal) before its tasks go out: its own tasks, those it
        carries from earlier rounds and the states those were cut from (``bases``, by round). ``planned`` False:
        only what the next round will carry, recorded with the last round's checkpoint (see
        :attr:`JournaledRound.planned`)."""
        every = [DispatchedTask(task_id, round_number, task, deadline) for task_id, task in tasks.items()]
        written = self._write_tasks([*every, *carried], carried, bases)
        index = {"round": round_number, "deadline": deadline, "planned": planned,
                 "tasks": _entries([*every, *carried]),
                 "skipped": [{"agent_id": skip.agent_id, "reason": skip.reason} for skip in skipped]}
        write_atomic(self.directory / "round.json", json.dumps(index).encode())
        self._prune(keep=written | {"round.json"})

    def carry_on(self, next_round: int, carried: Sequence[DispatchedTask],
                 bases: Mapping[int, Mapping[str, State]]) -> None:
        """Record, before a buffered round's checkpoint, what the next round carries (``next.json``) and the states
        its tasks were cut from, beside the round's own journal (untouched: until the checkpoint is written, the
        round is the one to resume; :meth:`load_next` reads it once the checkpoint exists). :meth:`begin` with
        ``planned=False`` then replaces the journal with it; a buffered round that carries nothing records that too,
        so that no earlier record of it is read instead."""
        self._write_tasks(carried, carried, bases)
        index = {"round": next_round, "tasks": _entries(carried)}
        write_atomic(self.directory / "next.json", json.dumps(index).encode())

    def _write_tasks(self, dispatched_tasks: Sequence[DispatchedTask], carried: Sequence[DispatchedTask],
                     bases: Mapping[int, Mapping[str, State]] | None) -> set[str]:
        """Write each task's file and the base of every round a ``carried`` task was cut from (one written already
        is kept as written: a round's states never change); the names of the files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        names = set()
        for dispatched in dispatched_tasks:
            task = dispatched.task
            message = Task(dispatched.task_id, dispatched.round, task.agent_id, dispatched.deadline, self.model,
                           task.spec.to_dict(), None, {}, adaptation=task.adaptation, plan=task.plan,
                           secure=task.secure)
            name = f"task-{_digest(dispatched.task_id)}.msgpack"
            write_atomic(self.directory / name, encode(message))
            names.add(name)
        for number in sorted({dispatched.round for dispatched in carried}):
            name = f"base-{number}.safetensors"
            if not (self.directory / name).exists():
                save_checkpoint(self.directory / name, (bases or {})[number], {"round": number})
            names.add(name)
        return names

    def store(self, update: Update, payload: bytes | bytearray | memoryview) -> None:
        """Keep an update (its message as it arrived) before it is acked."""
        write_atomic(self.directory / f"update-{_digest(update.task_id)}.msgpack", payload)

    def load(self) -> JournaledRound | None:
        """The round in the journal, or None when there is none. Raises ValueError for a journal that cannot be
        read (the message names the file)."""
        index_path = self.directory / "round.json"
        if not index_path.exists():
            return None
        try:
            index = json.loads(index_path.read_text())
            round_number, deadline = int(index["round"]), float(index["deadline"])
            tasks: dict[str, TaskPlan] = {}
            carried: list[DispatchedTask] = []
            for entry in index["tasks"]:
                dispatched = self._read_task(entry)
                if dispatched.round == round_number:
                    tasks[dispatched.task_id] = dispatched.task
                else:
                    carried.append(dispatched)
            skipped = [Skip(str(entry["agent_id"]), str(entry["reason"])) for entry in index["skipped"]]
            bases = self._bases(carried)
        except (OSError, KeyError, TypeError, ValueError, ProtocolError, CheckpointError) as exc:
            raise self._unreadable(exc) from exc
        return JournaledRound(round_number, deadline, tasks, skipped, carried, bases, bool(index.get("planned", True)))

    def load_next(self) -> JournaledRound | None:
        """What the next round carries, as :meth:`carry_on` recorded it beside the round's own journal (unplanned;
        None when it recorded nothing): read only once the round's checkpoint is known to exist. ValueError for one
        that cannot be read."""
        path = self.directory / "next.json"
        if not path.exists():
            return None
        try:
            index = json.loads(path.read_text())
            carried = [self._read_task(entry) for entry in index["tasks"]]
            return JournaledRound(int(index["round"]), 0.0, {}, [], carried, self._bases(carried), planned=False)
        except (OSError, KeyError, TypeError, ValueError, ProtocolError, CheckpointError) as exc:
            raise self._unreadable(exc) from exc

    def _read_task(self, entry: Mapping[str, object]) -> DispatchedTask:
        """The task an index entry (its id, level and group) names, read from its file."""
        task_id = str(entry["task_id"])
        message = decode((self.directory / f"task-{_digest(task_id)}.msgpack").read_bytes(), expected=Task)
        assert isinstance(message, Task)
        plan = TaskPlan(message.agent_id, str(entry["level"]), SubmodelSpec.from_dict(message.spec),
                        message.training_plan(), str(entry["group"]), message.adaptation, message.secure)
        return DispatchedTask(task_id, message.round, plan, message.deadline)

    def _bases(self, carried: Sequence[DispatchedTask]) -> dict[int, dict[str, State]]:
        return {number: load_checkpoint(self.directory / f"base-{number}.safetensors")[0]
                for number in sorted({dispatched.round for dispatched in carried})}

    def stored(self, tasks: Container[str]) -> Iterator[tuple[Update, bytes]]:
        """The updates stored for the round's ``tasks`` (ids: its own and those it carries), one at a time, each with
        its message as it arrived (so that no more than one is in memory at once). Raises ValueError for one that
        cannot be read."""
        for path in sorted(self.directory.glob("update-*.msgpack")):
            payload = self._read(path)
            if payload is not None:
                update = self._decoded(path, payload)
                if update.task_id in tasks:
                    yield update, payload

    def read_update(self, task_id: str) -> Update:
        """The stored update of ``task_id`` (ValueError when there is none, or it cannot be read)."""
        path = self.directory / f"update-{_digest(task_id)}.msgpack"
        payload = self._read(path)
        if payload is None:
            raise ValueError(f"the round journal in {self.directory} holds no update of task {task_id!r}")
        return self._decoded(path, payload)

    def _read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._unreadable(exc) from exc

    def _decoded(self, path: Path, payload: bytes) -> Update:
        try:
            update = decode(payload, expected=Update)
        except ProtocolError as exc:
            raise self._unreadable(f"{path.name}: {exc}") from exc
        assert isinstance(update, Update)
        return update

    def _unreadable(self, why: object) -> ValueError:
        return ValueError(f"the round journal in {self.directory} cannot be read ({why}); move it away to start the "
                          f"round afresh")

    def clear(self) -> None:
        """Remove the journal (the round is checkpointed): its indexes first, so that a kill meanwhile leaves no
        journal rather than one that names files already gone."""
        if not self.directory.exists():
            return
        (self.directory / "round.json").unlink(missing_ok=True)
        (self.directory / "next.json").unlink(missing_ok=True)
        sync_directory(self.directory)
        shutil.rmtree(self.directory)
        sync_directory(self.directory.parent)

    def _prune(self, keep: Container[str]) -> None:
        """Remove every file but those named in ``keep`` (once the index that names them is written): ``next.json``
        first, which may name files that go."""
        if "next.json" not in keep:
            (self.directory / "next.json").unlink(missing_ok=True)
        for path in self.directory.iterdir():
            if path.name not in keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        sync_directory(self.directory)

"""Many synthetic agents in one process: each its own MQTT client and agent id, all driven by one event loop.

A synthetic agent speaks the agents' protocol (``edge_agent.daemon``): a retained status with capabilities and a
Last Will, its task chunks in (put together by a :class:`protocol.Reassembler`), its update out in chunks
(``protocol.encode`` and ``protocol.split_payload``, transfer ``<task id>.<attempt>``), sent again every
``ack_timeout_s`` until the coordinator acks it, as the agents' uplink does (asking first, and sending once granted,
when its task says :attr:`protocol.Task.ask_to_upload`); "busy" while it answers a task. It
answers with a SYNTHETIC update (:mod:`loadrig.synthetic`) at once: no training. It skips the start-up
check for a second process of its id.

One paho thread per client would be a thousand threads fighting for the interpreter, so a worker drives all of its
clients from one thread through paho's external-loop hooks (socket open/close, register/unregister write) and a
selector. ``python -m loadrig.agents SPEC.json RESULT.json`` runs one worker: it prints ``ready N`` once its
N agents are online (or ``error ...``), runs until its standard input closes, says "offline" for every agent, and
writes what it saw to RESULT.json (:class:`WorkerResult`).
"""

from __future__ import annotations

import json
import os
import random
import resource
import selectors
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from loadrig.synthetic import UpdateMaker
from protocol import (
    Ack,
    AgentStatus,
    Capabilities,
    ProtocolError,
    Reassembler,
    Task,
    Topics,
    TransferRefused,
    UploadGrant,
    UploadRequest,
    UploadWait,
    decode,
    encode,
    split_payload,
)

__all__ = ["AgentSlot", "LoadWorker", "RoundSeen", "WorkerResult", "WorkerSpec", "main"]

#: Seconds between the loop's timer passes (keepalive, resends, status heartbeats, reconnects).
_TICK_S = 0.5
#: Seconds between reconnection attempts of an agent whose connection dropped.
_RECONNECT_S = 5.0
#: The memory a synthetic agent reports (it trains nothing, so any figure that admits every task will do).
_MEMORY_TOTAL = 2 * 2**30
_MEMORY_AVAILABLE = 3 * 2**29
#: Largest task a synthetic agent buffers (the agents' default ``limits.max_task_bytes``).
_MAX_TASK_BYTES = 512 * 2**20


@dataclass
class AgentSlot:
    """One synthetic agent of a worker: its id and the broker it connects to."""

    agent_id: str
    host: str
    port: int


@dataclass
class WorkerSpec:
    """What one worker process runs (JSON in SPEC.json)."""

    federation: str
    agents: list[AgentSlot]
    num_samples: int
    num_classes: int
    sample_shape: list[int]
    protocol: str = "3.1.1"
    ack_timeout_s: float = 10.0
    update_attempts: int = 30
    status_interval_s: float = 30.0
    keepalive: int = 60
    connect_timeout_s: float = 120.0
    seed: int = 0
    #: The protocol revision the agents announce (1: as agents that predate version 2; tasks then come in version 1,
    #: and no agent asks before it uploads, which revision 6 does; from 7 a request that waits its turn is told so).
    revision: int = 1

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        data["agents"] = [AgentSlot(**slot) for slot in data["agents"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class RoundSeen:
    """One round as this worker's agents saw it (wall-clock times, ``time.time()``)."""

    tasks: int = 0
    first_task_at: float = 0.0
    last_task_at: float = 0.0
    first_ack_at: float = 0.0
    last_ack_at: float = 0.0
    acked: int = 0
    make_seconds: float = 0.0
    #: Seconds from each task's last chunk to its update's ack.
    latencies: list[float] = field(default_factory=list)

    def task_in(self, now: float) -> None:
        self.tasks += 1
        self.first_task_at = min(self.first_task_at or now, now)
        self.last_task_at = max(self.last_task_at, now)

    def ack_in(self, now: float, latency: float) -> None:
        self.acked += 1
        self.first_ack_at = min(self.first_ack_at or now, now)
        self.last_ack_at = max(self.last_ack_at, now)
        self.latencies.append(latency)


@dataclass
class WorkerResult:
    """What a worker's agents did (RESULT.json)."""

    agents: int
    online: int = 0
    tasks: int = 0
    duplicate_tasks: int = 0
    updates: int = 0
    resends: int = 0
    asks: int = 0
    grants: int = 0
    waits: int = 0
    abandoned: int = 0
    acked: int = 0
    refused: int = 0
    aggregated: int = 0
    rejected: int = 0
    failed_updates: int = 0
    protocol_errors: int = 0
    disconnects: int = 0
    reconnects: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    cpu_seconds: float = 0.0
    peak_rss: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, RoundSeen] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> WorkerResult:
        data = json.loads(text)
        data["rounds"] = {key: RoundSeen(**value) for key, value in data["rounds"].items()}
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class _Pending:
    """An update waiting for its ack."""

    round: int
    payload: bytes
    task_at: float
    attempt: int = 1
    sent_at: float = 0.0  # when it was last sent, or asked for
    ask: bool = False  # it asks before each send (its task said so)
    asking: bool = False  # asked, no grant yet
    told_to_wait: bool = False  # its last ask was answered with an UploadWait: asking again spends no attempt


class _Agent:
    """One synthetic agent: its MQTT client and protocol state (driven by :class:`LoadWorker`'s thread)."""

    def __init__(self, worker: LoadWorker, slot: AgentSlot) -> None:
        self.worker = worker
        self.slot = slot
        self.agent_id = slot.agent_id
        self.instance = uuid.uuid4().hex[:12]
        spec = worker.spec
        topics = worker.topics
        self.status_topic = topics.agent_status(self.agent_id)
        self.task_topic = topics.agent_task(self.agent_id)
        self.ack_topic = topics.agent_ack(self.agent_id)
        self.update_topic = topics.agent_update(self.agent_id)
        self.labels = list(range(spec.num_classes))
        self.factor = 0.5 + random.Random(f"{spec.seed}:{self.agent_id}").random()  # the update's change: 0.5..1.5
        self.reassembler = Reassembler(max_total_bytes=_MAX_TASK_BYTES, max_transfers=4)
        self.seen: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        self.online = False
        self.down_since: float | None = None
        self.next_status = time.monotonic() + spec.status_interval_s * (0.5 + random.random())
        client_id = f"fedfit-agent-{self.agent_id}"
        if spec.protocol == "5":
            client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                                 userdata=self)
        else:
            client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                                 clean_session=True, userdata=self)
        client.max_queued_messages_set(0)
        client.will_set(self.status_topic, encode(self._status("offline")), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        client.on_socket_open = worker.socket_open
        client.on_socket_close = worker.socket_close
        client.on_socket_register_write = worker.want_write
        client.on_socket_unregister_write = worker.done_writing
        self.client = client

    # ----------------------------------------------------------------- status
    def _status(self, state: str) -> AgentStatus:
        if state == "offline":
            return AgentStatus(self.agent_id, state, None, time.time(), self.instance)
        spec = self.worker.spec
        capabilities = Capabilities("synthetic", _MEMORY_TOTAL, _MEMORY_AVAILABLE, None, spec.num_samples,
                                    self.labels, tuple(spec.sample_shape), spec.revision)
        return AgentStatus(self.agent_id, state, capabilities, time.time(), self.instance)

    def publish_status(self, state: str | None = None) -> None:
        state = state or ("busy" if self.pending else "online")
        self.publish(self.status_topic, encode(self._status(state)), retain=True)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain)
        self.worker.result.bytes_out += len(payload)

    # -------------------------------------------------------------- callbacks
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            self.worker.count_reason(f"connect refused: {reason}")
            return
        client.subscribe([(self.task_topic, 1), (self.ack_topic, 1)])

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, properties: Any) -> None:
        self.publish_status()
        if self.down_since is not None:
            self.worker.result.reconnects += 1
            self.down_since = None
            for pending in self.pending.values():  # resent on the next tick
                pending.sent_at = 0.0
        if not self.online:
            self.online = True
            self.worker.online += 1

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if self.worker.stopping:
            return
        self.worker.result.disconnects += 1
        self.down_since = time.monotonic()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        payload = message.payload
        self.worker.result.bytes_in += len(payload)
        try:
            if message.topic == self.task_topic:
                self._on_task_chunk(payload)
            elif message.topic == self.ack_topic:
                self._on_ack(payload)
        except ProtocolError as exc:
            self.worker.count_reason(f"protocol error: {str(exc)[:80]}")
            self.worker.result.protocol_errors += 1

    def _on_task_chunk(self, payload: bytes | bytearray) -> None:
        try:
            complete = self.reassembler.feed(payload, source="coordinator")
        except TransferRefused as refused:
            self.worker.count_reason(f"task refused: {refused.reason[:80]}")
            return
        if complete is None:
            return
        now = time.time()
        task = decode(complete, expected=Task)
        assert isinstance(task, Task)
        if task.agent_id != self.agent_id:
            raise ProtocolError(f"task addressed to {task.agent_id!r} arrived at {self.agent_id!r}")
        if task.task_id in self.seen:
            self.worker.result.duplicate_tasks += 1
            return
        self.seen.add(task.task_id)
        result = self.worker.result
        result.tasks += 1
        seen = self.worker.round(task.round)
        seen.task_in(now)
        self.pending[task.task_id] = _Pending(task.round, b"", now, ask=task.ask_to_upload)
        self.publish_status("busy")
        spec = self.worker.spec
        update = self.worker.maker.make(task, self.agent_id, spec.num_samples, self.labels, self.factor)
        seen.make_seconds += update.metrics.get("make_seconds", 0.0)
        if update.status == "failed":
            result.failed_updates += 1
            self.worker.count_reason(update.reason or "failed")
        self.pending[task.task_id].payload = encode(update)
        result.updates += 1
        self._send(task.task_id)
        self.publish_status()

    def _send(self, task_id: str) -> None:
        """Send the update of ``task_id``, or ask to when it must."""
        pending = self.pending[task_id]
        pending.sent_at = time.monotonic()
        if pending.ask:
            pending.asking = True
            self.worker.result.asks += 1
            self.publish(self.update_topic, encode(UploadRequest(task_id, pending.round, self.agent_id,
                                                                 len(pending.payload))))
            return
        self._send_chunks(task_id, pending)

    def _send_chunks(self, task_id: str, pending: _Pending) -> None:
        for chunk in split_payload(pending.payload, f"{task_id}.{pending.attempt}"):
            self.publish(self.update_topic, chunk)
        pending.sent_at = time.monotonic()

    def _on_ack(self, payload: bytes | bytearray) -> None:
        ack = decode(payload, expected=(Ack, UploadGrant, UploadWait))
        if isinstance(ack, UploadWait):
            waiting = self.pending.get(ack.task_id)
            if waiting is not None and waiting.asking:
                waiting.told_to_wait = True
                self.worker.result.waits += 1
            return
        if isinstance(ack, UploadGrant):
            granted = self.pending.get(ack.task_id)
            if granted is not None and granted.asking:
                granted.asking = granted.told_to_wait = False
                self.worker.result.grants += 1
                self._send_chunks(ack.task_id, granted)
            return
        assert isinstance(ack, Ack)
        result = self.worker.result
        if ack.verdict is not None:
            if ack.verdict == "aggregated":
                result.aggregated += 1
            else:
                result.rejected += 1
                self.worker.count_reason(f"rejected: {(ack.reason or '')[:80]}")
        pending = self.pending.pop(ack.task_id, None)
        if pending is None:
            return
        now = time.time()
        if ack.reason is None or ack.verdict == "aggregated":
            result.acked += 1
        else:
            result.refused += 1
            self.worker.count_reason(f"refused: {ack.reason[:80]}")
        self.worker.round(pending.round).ack_in(now, now - pending.task_at)
        if not self.pending:
            self.publish_status()

    # ------------------------------------------------------------------ timer
    def tick(self, now: float) -> None:
        """Keepalive, resends after ``ack_timeout_s``, the status heartbeat, a reconnect after a drop."""
        spec = self.worker.spec
        if self.down_since is not None:
            if now - self.down_since >= _RECONNECT_S:
                self.down_since = now
                try:
                    self.client.reconnect()
                except OSError:
                    pass
            return
        self.client.loop_misc()
        for task_id, pending in list(self.pending.items()):
            if pending.payload and now - pending.sent_at >= spec.ack_timeout_s:
                if pending.told_to_wait:  # waiting its turn: ask again to keep its place, no attempt spent
                    pending.told_to_wait = False
                    self._send(task_id)
                    continue
                if pending.attempt >= spec.update_attempts:
                    del self.pending[task_id]
                    self.worker.result.abandoned += 1
                    continue
                pending.attempt += 1
                self.worker.result.resends += 1
                self._send(task_id)
        if now >= self.next_status:
            self.next_status = now + spec.status_interval_s
            self.publish_status()


class LoadWorker:
    """Drives the synthetic agents of one :class:`WorkerSpec` from one thread."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.topics = Topics(spec.federation)
        self.selector = selectors.DefaultSelector()
        self.maker = UpdateMaker(spec.seed)
        self.result = WorkerResult(agents=len(spec.agents))
        self.online = 0
        self.stopping = False
        self._control: Any = None
        self._stop_requested = False
        self.agents = [_Agent(self, slot) for slot in spec.agents]

    # paho's external-loop hooks -----------------------------------------------
    def socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.selector.register(sock, selectors.EVENT_READ, client)

    def socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def want_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    def done_writing(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        try:
            self.selector.modify(sock, selectors.EVENT_READ, client)
        except (KeyError, ValueError):
            pass

    # ----------------------------------------------------------------- helpers
    def round(self, number: int) -> RoundSeen:
        return self.result.rounds.setdefault(str(number), RoundSeen())

    def count_reason(self, reason: str) -> None:
        self.result.reasons[reason] = self.result.reasons.get(reason, 0) + 1

    def watch(self, stream: Any) -> None:
        """Stop once ``stream`` (a readable file, e.g. standard input) reaches its end."""
        self._control = stream
        self.selector.register(stream, selectors.EVENT_READ, None)

    def request_stop(self) -> None:
        self._stop_requested = True

    # -------------------------------------------------------------------- loop
    def connect(self) -> None:
        """Open every agent's connection (the loop then finishes the handshakes)."""
        for agent in self.agents:
            try:
                agent.client.connect(agent.slot.host, agent.slot.port, keepalive=self.spec.keepalive)
            except OSError as exc:
                self.count_reason(f"connect failed: {exc}")
                agent.down_since = time.monotonic()

    def run_until(self, condition: Any, timeout: float | None = None) -> bool:
        """Serve the agents until ``condition()`` holds (True), the control stream closes or ``timeout`` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_tick = time.monotonic()
        while not condition():
            now = time.monotonic()
            if self._stop_requested or (deadline is not None and now >= deadline):
                return False
            for key, mask in self.selector.select(timeout=_TICK_S):
                client = key.data
                if client is None:
                    if not os.read(key.fd, 4096):
                        self.selector.unregister(key.fileobj)
                        self._stop_requested = True
                    continue
                if mask & selectors.EVENT_READ:
                    client.loop_read(max_packets=16)
                if mask & selectors.EVENT_WRITE and client.want_write():
                    client.loop_write()
            now = time.monotonic()
            if now - last_tick >= _TICK_S:
                last_tick = now
                for agent in self.agents:
                    agent.tick(now)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Say "offline" (retained) for every agent, let it go out, and disconnect."""
        self.stopping = True
        for agent in self.agents:
            if agent.client.is_connected():
                agent.publish_status("offline")
        self.run_until(lambda: not any(agent.client.want_write() for agent in self.agents if
                                       agent.client.is_connected()), timeout)
        for agent in self.agents:
            if agent.client.is_connected():
                agent.client.disconnect()
                agent.client.loop_write()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.result.cpu_seconds = usage.ru_utime + usage.ru_stime
        self.result.peak_rss = usage.ru_maxrss * 1024
        self.result.online = self.online


def main(argv: list[str] | None = None) -> int:
    """``python -m loadrig.agents SPEC.json RESULT.json`` (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m loadrig.agents SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = WorkerSpec.from_json(Path(args[0]).read_text())
    import models  # noqa: F401 - torch, imported now rather than when the first task arrives
    worker = LoadWorker(spec)
    worker.watch(sys.stdin)
    worker.connect()
    total = len(worker.agents)
    if worker.run_until(lambda: worker.online >= total, spec.connect_timeout_s):
        print(f"ready {total}", flush=True)
        worker.run_until(lambda: False)
    else:
        print(f"error: {worker.online} of {total} agents online after {spec.connect_timeout_s:g} s "
              f"({dict(Counter(worker.result.reasons).most_common(3))})", flush=True)
    worker.shutdown()
    Path(args[1]).write_text(worker.result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

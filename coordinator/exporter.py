"""The coordinator's Prometheus metrics (``metrics_port`` in its configuration; off by default), served over HTTP by
``prometheus-client`` from a thread of its own, bound to loopback unless ``metrics_host`` says otherwise.

What an operator watches: rounds done and the one in progress (answers in of expected), updates received by
verdict and their bytes, each round's tasks by status, traffic, phases' seconds and accuracy, agents online, the
MQTT inbox's backlog, the upload window (bytes granted and not yet in, requests waiting), and the process's own
figures (``process_resident_memory_bytes`` and the rest of
prometheus-client's process collector). Every metric is named ``fedfit_*`` and carries no label but the ones below;
``fedfit_info`` names the federation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordinator.metrics import RoundResult, TaskStatus
from coordinator.round import Verdict

__all__ = ["CoordinatorMetrics"]


class CoordinatorMetrics:
    """The metrics of one coordinator, in a registry of their own (``registry``, for tests and the HTTP server)."""

    def __init__(self, federation: str, algorithm: str, inbox_backlog: Callable[[], float] = lambda: 0.0,
                 agents_online: Callable[[], float] = lambda: 0.0,
                 uploads: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)) -> None:
        """``inbox_backlog``, ``agents_online`` and ``uploads`` (the upload window's bytes granted and requests
        waiting) are read when the metrics are scraped (a fleet's statuses come in bursts: counting the agents
        online for each would cost the message thread O(fleet) a status)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector

        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        Info("fedfit", "The federation this coordinator runs", registry=self.registry).info(
            {"federation": federation, "algorithm": algorithm})
        gauge: Callable[..., Any] = lambda name, text, *labels: Gauge(name, text, labels, registry=self.registry)
        counter: Callable[..., Any] = lambda name, text, *labels: Counter(name, text, labels, registry=self.registry)
        self.rounds = counter("fedfit_rounds", "Rounds completed by this process")
        self.round = gauge("fedfit_round", "The round in progress, else the last one completed")
        self.round_expected = gauge("fedfit_round_expected_answers", "Tasks of the round in progress (0 between rounds)")
        self.round_received = gauge("fedfit_round_received_answers", "Answers the round in progress has taken")
        self.updates = counter("fedfit_updates_received", "Updates received, by how the round took them", "verdict")
        self.update_bytes = counter("fedfit_update_bytes_received", "Bytes of the updates received")
        self.tasks = counter("fedfit_tasks", "Tasks of completed rounds, by how they ended", "status")
        self.last_tasks = gauge("fedfit_last_round_tasks", "The last round's tasks, by how they ended", "status")
        self.participants = gauge("fedfit_last_round_participants", "Updates the last round aggregated")
        self.selected = gauge("fedfit_last_round_selected", "Devices the last round selected")
        self.traffic = gauge("fedfit_last_round_bytes", "The last round's traffic", "direction")
        self.seconds = gauge("fedfit_last_round_seconds", "The last round's wall time")
        self.phases = gauge("fedfit_last_round_phase_seconds", "Where the last round's time went", "phase")
        self.accuracy = gauge("fedfit_global_accuracy", "The global model's test accuracy after the last round")
        self.agents_online = gauge("fedfit_agents_online", "Agents whose status says online or busy")
        self.inbox = gauge("fedfit_mqtt_inbox_messages", "Messages received and not yet handled")
        self.inbox.set_function(inbox_backlog)
        self.upload_bytes = gauge("fedfit_upload_window_bytes", "Update bytes granted and not yet in")
        self.upload_waiting = gauge("fedfit_upload_requests_waiting", "Agents waiting for leave to upload")
        self.upload_bytes.set_function(lambda: uploads()[0])
        self.upload_waiting.set_function(lambda: uploads()[1])
        self.agents_online.set_function(agents_online)
        for status in TaskStatus:  # every series from the start: a rate of zero is a figure too
            self.tasks.labels(status.value)
            self.last_tasks.labels(status.value).set(0)
        for verdict in Verdict:
            self.updates.labels(verdict.value)
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host``:``port`` (0: a free port) from a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving (nothing when not serving)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def round_opened(self, number: int, expected: int, received: int = 0) -> None:
        """Round ``number`` sent its ``expected`` tasks (a resumed round has ``received`` answers already)."""
        self.round.set(number)
        self.round_expected.set(expected)
        self.round_received.set(received)

    def update_received(self, verdict: str, size: int, received: int | None = None) -> None:
        """An update the round took (``verdict``, a :class:`coordinator.round.Verdict` value), ``size`` bytes;
        ``received``: the answers the round has now."""
        self.updates.labels(verdict).inc()
        self.update_bytes.inc(size)
        if received is not None:
            self.round_received.set(received)

    def round_done(self, result: RoundResult) -> None:
        self.rounds.inc()
        self.round.set(result.round)
        self.round_expected.set(0)
        self.round_received.set(0)
        counts = {status.value: 0 for status in TaskStatus}
        for task in result.tasks:
            counts[task.status.value] += 1
        for status, count in counts.items():
            self.tasks.labels(status).inc(count)
            self.last_tasks.labels(status).set(count)
        self.participants.set(result.participants)
        self.selected.set(result.selected)
        self.traffic.labels("down").set(result.bytes_down)
        self.traffic.labels("up").set(result.bytes_up)
        self.seconds.set(result.seconds)
        for phase, seconds in result.timing.items():
            self.phases.labels(phase).set(seconds)
        self.accuracy.set(result.global_accuracy)


"""The coordinator's Prometheus metrics (``metrics_port`` in its configuration; off by default), served over HTTP by
``prometheus-client`` from a thread of its own, bound to loopback unless ``metrics_host`` says otherwise.

What an operator watches: rounds done and the one in progress (answers in of expected), updates received by
verdict and their bytes, each round's tasks by status, traffic, phases' seconds and accuracy, agents online, the
MQTT inbox's backlog, the upload window (bytes granted and not yet in, requests waiting), and the process's own
figures (``process_resident_memory_bytes`` and the rest of
prometheus-client's process collector). Every metric is named ``fedfit_*`` and carries no label but the ones below;
``fedfit_info`` names the federation.

A figure that has no value yet is absent, not 0: ``fedfit_round`` until a round opens, ``fedfit_global_accuracy``
and every ``fedfit_last_round_*`` until a round is done (a 0 there would read as a round 0, or an accuracy of 0).
And the last state is served until it has been read: :meth:`CoordinatorMetrics.stop` waits, up to a ``linger``,
for a scrape that began after the last change (a coordinator that stopped right after its last round was gone
before Prometheus's next scrape: a 6-round run scraped every 2 s recorded 5 rounds and not the final accuracy),
and not at all when nothing ever scraped it. The server counts the scrapes it has sent in full: it waits on them,
not on a clock.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from common.logs import Logger
from coordinator.metrics import RoundResult, TaskStatus
from coordinator.round import Verdict

__all__ = ["CoordinatorMetrics", "LateGauge", "Scrapes"]


class _QuietHandler(WSGIRequestHandler):
    """Logs no request (as prometheus-client's own server)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LateGauge:
    """A gauge, labelled or not, that is absent from the exposition until it has a value (prometheus-client's
    ``Gauge`` shows an unlabelled one as 0 from the start). Registered in ``registry``; set from any thread."""

    def __init__(self, name: str, documentation: str, labels: Iterable[str] = (), *, registry: Any) -> None:
        self.name, self.documentation, self.labels = name, documentation, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def set(self, value: float, *labels: str) -> None:
        """The value of the series with these label values (as many as the gauge has labels)."""
        if len(labels) != len(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}, got {labels}")
        with self._lock:
            self._values[labels] = float(value)

    def replace(self, values: Mapping[str, float]) -> None:
        """Every series of a gauge with one label at once: those of ``values`` (label value -> value), no other (a
        series not in them is absent from then on)."""
        if len(self.labels) != 1:
            raise ValueError(f"{self.name} has the labels {self.labels}: replace() takes a gauge of one label")
        with self._lock:
            self._values = {(label,): float(value) for label, value in values.items()}

    def value(self, *labels: str) -> float | None:
        """The series' value, None while it has none."""
        with self._lock:
            return self._values.get(labels)

    def describe(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labels)]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            values = dict(self._values)
        if values:
            family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
            for labels, value in values.items():
                family.add_metric(list(labels), value)
            yield family


class Scrapes:
    """Which state of the metrics has been scraped: a version counted up at each change, and the version the
    latest scrape sent in full began at (a scrape that began before a change may have read part of it)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._version = 0  # changes so far
        self._begun = 0  # scrapes begun
        self._served = -1  # the version the latest scrape sent in full began at (-1: none yet)

    def changed(self) -> None:
        """The metrics changed."""
        with self._changed:
            self._version += 1

    def began(self) -> int:
        """A scrape begins: the version it reads (at least)."""
        with self._changed:
            self._begun += 1
            return self._version

    def served(self, version: int) -> None:
        """A scrape that began at ``version`` was sent in full."""
        with self._changed:
            self._served = max(self._served, version)
            self._changed.notify_all()

    def wait_read(self, timeout: float) -> bool:
        """Wait until a scrape that began after the last change was sent, at most ``timeout`` seconds; True at
        once when one was, or when nothing has ever scraped (nobody is watching)."""
        with self._changed:
            if self._begun == 0:
                return True
            return self._changed.wait_for(lambda: self._served >= self._version, timeout)


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
        late: Callable[..., LateGauge] = lambda name, text, *labels: LateGauge(name, text, labels,
                                                                               registry=self.registry)
        counter: Callable[..., Any] = lambda name, text, *labels: Counter(name, text, labels, registry=self.registry)
        self.rounds = counter("fedfit_rounds", "Rounds completed by this process")
        self.round = late("fedfit_round", "The round in progress, else the last one completed")
        self.round_expected = gauge("fedfit_round_expected_answers", "Tasks of the round in progress (0 between rounds)")
        self.round_received = gauge("fedfit_round_received_answers", "Answers the round in progress has taken")
        self.updates = counter("fedfit_updates_received", "Updates received, by how the round took them", "verdict")
        self.update_bytes = counter("fedfit_update_bytes_received", "Bytes of the updates received")
        self.tasks = counter("fedfit_tasks", "Tasks of completed rounds, by how they ended", "status")
        self.last_tasks = late("fedfit_last_round_tasks", "The last round's tasks, by how they ended", "status")
        self.participants = late("fedfit_last_round_participants", "Updates the last round aggregated")
        self.selected = late("fedfit_last_round_selected", "Devices the last round selected")
        self.traffic = late("fedfit_last_round_bytes", "The last round's traffic", "direction")
        self.seconds = late("fedfit_last_round_seconds", "The last round's wall time")
        self.phases = late("fedfit_last_round_phase_seconds", "Where the last round's time went", "phase")
        self.accuracy = late("fedfit_global_accuracy", "The test accuracy after the last round of the model a user "
                             "would deploy (the largest level trained, or the ensemble of the trained classifiers)")
        self.epsilon = late("fedfit_privacy_epsilon", "The privacy a private run has spent after its last round: "
                            "epsilon at the configured delta (absent when the run is not private)")
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
        for verdict in Verdict:
            self.updates.labels(verdict.value)
        self.scrapes = Scrapes()
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host``:``port`` (0: a free port) from a daemon thread; returns the port."""
        from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

        # (the address family of the host, as prometheus-client's own server finds it: IPv6 addresses too)
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        family, address = found[0], str(found[4][0])

        class Server(ThreadingWSGIServer):
            address_family = family

        metrics_app = make_wsgi_app(self.registry)
        scrapes = self.scrapes

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("REQUEST_METHOD") != "GET" or environ.get("PATH_INFO") == "/favicon.ico":
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            version = scrapes.began()
            answer: list[tuple[str, list[tuple[str, str]]]] = []
            body = b"".join(metrics_app(environ, lambda status, headers, *_: answer.append((status, headers))))
            status, headers = answer[0]
            start_response(status, [*headers, ("Content-Length", str(len(body)))])
            return _sent(body, lambda: scrapes.served(version))

        self._server = make_server(address, port, app, Server, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="metrics-server", daemon=True).start()
        return int(self._server.server_port)

    def start(self, host: str, port: int, log: Logger) -> None:
        """:meth:`serve`, said in ``log``; an OSError names the settings to change."""
        try:
            self.serve(host, port)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on metrics_host {host}, metrics_port {port}: "
                                     f"{exc.strerror}") from None
        log.info("metrics_served", url=f"http://{host}:{self.port}/metrics")

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on, None while not serving."""
        return int(self._server.server_port) if self._server is not None else None

    def stop(self, linger: float = 0.0) -> bool:
        """Stop serving (nothing when not serving), once a scrape that began after the last change was sent, or
        after ``linger`` seconds; at once when nothing ever scraped. Whether the last state was sent (True when
        nobody was watching)."""
        if self._server is None:
            return True
        read = self.scrapes.wait_read(linger)
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        return read

    def round_opened(self, number: int, expected: int, received: int = 0) -> None:
        """Round ``number`` sent its ``expected`` tasks (a resumed round has ``received`` answers already)."""
        self.round.set(number)
        self.round_expected.set(expected)
        self.round_received.set(received)
        self.scrapes.changed()

    def update_received(self, verdict: str, size: int, received: int | None = None) -> None:
        """An update the round took (``verdict``, a :class:`coordinator.round.Verdict` value), ``size`` bytes;
        ``received``: the answers the round has now."""
        self.updates.labels(verdict).inc()
        self.update_bytes.inc(size)
        if received is not None:
            self.round_received.set(received)
        self.scrapes.changed()

    def round_done(self, result: RoundResult, *, counted: bool = True) -> None:
        """A round is done: its figures (``fedfit_last_round_*``, the accuracy) replace the last round's.
        ``counted`` False: a round done before this process started (a resumed coordinator's last, shown until its
        next round is done), not added to the counters."""
        if counted:
            self.rounds.inc()
        self.round.set(result.round)
        self.round_expected.set(0)
        self.round_received.set(0)
        counts = {status.value: 0 for status in TaskStatus}
        for task in result.tasks:
            counts[task.status.value] += 1
        for status, count in counts.items():
            if counted:
                self.tasks.labels(status).inc(count)
            self.last_tasks.set(count, status)
        self.participants.set(result.participants)
        self.selected.set(result.selected)
        self.traffic.set(result.bytes_down, "down")
        self.traffic.set(result.bytes_up, "up")
        self.seconds.set(result.seconds)
        self.phases.replace(result.timing)  # (a phase this round did not go through is not left from an earlier one)
        self.accuracy.set(result.headline)
        if result.privacy:
            self.epsilon.set(result.privacy["epsilon"])
        self.scrapes.changed()


def _sent(body: bytes, done: Callable[[], None]) -> Iterator[bytes]:
    """The response's body, then ``done()``: the WSGI server asks for the next chunk once it has written the last
    one, so ``done`` runs only for a response sent in full (not for one whose client went away)."""
    yield body
    done()


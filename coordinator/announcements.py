"""The coordinator's retained status: what it publishes about itself (online or offline, the round it is at, and
to agents that read it the round in progress's progress), and when.

Published from three threads (the round loop, the message thread as updates come, a timer for a re-publication
that is due): one at a time, so that the last status published is the one the last to publish built, and none
after :meth:`StatusAnnouncer.stop`'s 'offline'. While a round collects, updates re-publish it at most once a
second (`PROGRESS_INTERVAL_S`), at once at the round's last answer.
"""

from __future__ import annotations

import threading
import time

from common.mqtt_link import MqttLink, Will
from coordinator.in_flight import InFlight
from coordinator.registry import FleetRegistry
from coordinator.run_files import RunFiles
from protocol import (
    MODEL_DELIVERY_REVISION,
    PRIVACY_REVISION,
    STATUS_REPORT_REVISION,
    CoordinatorStatus,
    PrivacySpent,
    RoundProgress,
    Topics,
    encode,
)

__all__ = ["PROGRESS_INTERVAL_S", "StatusAnnouncer"]

#: Seconds between the re-publications of the status (the round's progress) that updates cause, at most.
PROGRESS_INTERVAL_S = 1.0


class StatusAnnouncer:
    """Builds and publishes the coordinator's retained status (see the module docstring)."""

    def __init__(self, federation: str, link: MqttLink, topics: Topics, registry: FleetRegistry,
                 in_flight: InFlight, files: RunFiles) -> None:
        self.federation = federation
        self._link = link
        self._topics = topics
        self._registry = registry
        self._in_flight = in_flight
        self._files = files  # the rounds completed
        self._opened_at = 0.0  # wall clock: when the round in progress sent its tasks
        self._outage_at_open = 0.0  # the link's outage seconds then
        self._reports_announced = False  # whether the last status said this coordinator reads agents' reports
        self._privacy_announced = False  # whether it carried a private run's spending (agents of revision 9 only)
        self._progress_announced = 0.0  # monotonic: when an update last re-published the status
        self._progress_pending = False  # a re-publication is scheduled
        self._progress_lock = threading.Lock()
        self._announce_lock = threading.Lock()
        self._stopped = False

    def status(self, state: str, reports: bool | None = None) -> CoordinatorStatus:
        """The retained status: its ``round`` is the round in progress, else the last one completed. With
        ``reports`` (default: while every agent online reads them, `protocol.STATUS_REPORT_REVISION`) it says this
        coordinator reads agents' reports and carries the round in progress; the Last Will never does (an agent of
        any revision must read it)."""
        current = self._in_flight.current()
        number = current.number if current is not None else self._files.completed_rounds
        if reports is None:
            reports = self.fleet_reads_reports()
        if not reports:
            return CoordinatorStatus(self.federation, state, number, time.time())
        progress = None
        if current is not None and state == "online" and self._opened_at:
            # The deadline as the round keeps it: moved out by the broker outages seen since it opened.
            deadline = current.deadline + self._link.outage_seconds() - self._outage_at_open
            progress = RoundProgress(current.number, len(current.tasks), len(current.answers), self._opened_at,
                                     deadline)
        # (the newest revision of the reports it reads: with MODEL_DELIVERY_REVISION, the model an agent holds)
        return CoordinatorStatus(self.federation, state, number, time.time(), MODEL_DELIVERY_REVISION, progress,
                                 self._privacy_spent())

    def _privacy_spent(self) -> PrivacySpent | None:
        """What a private run has spent after its last round, for agents that all read it (None otherwise)."""
        record = self._files.last_record
        oldest = self._registry.oldest_revision()
        if record is None or not record.privacy or oldest is None or oldest < PRIVACY_REVISION:
            return None
        spent = record.privacy
        return PrivacySpent(float(spent["epsilon"]), float(spent["delta"]), float(spent.get("max_epsilon") or 0.0))

    def offline(self) -> tuple[str, bytes, bool]:
        """The 'offline' status as published (topic, payload, retained); plain, as the Last Will: an agent of any
        revision may read it when it starts."""
        return self._topics.coordinator_status(), encode(self.status("offline", reports=False)), True

    def last_will(self) -> Will:
        """The Last Will the broker publishes if this coordinator vanishes (made as the link's start() connects: it
        names the round of then)."""
        return Will(*self.offline())

    def fleet_reads_reports(self) -> bool:
        """Whether agents are online and every one reads reports (none online: an agent of any revision may come
        first, and must read the status it finds retained)."""
        oldest = self._registry.oldest_revision()
        return oldest is not None and oldest >= STATUS_REPORT_REVISION

    def round_opened(self) -> None:
        """The round in progress sends its tasks now: its progress counts from here."""
        self._opened_at = time.time()
        self._outage_at_open = self._link.outage_seconds()

    def announce(self) -> None:
        """Publish the status now (retained)."""
        with self._announce_lock:
            if self._stopped:
                return
            status = self.status("online")
            self._reports_announced = status.revision >= STATUS_REPORT_REVISION
            self._privacy_announced = status.privacy is not None
            self._link.publish(self._topics.coordinator_status(), encode(status), retain=True)

    def announce_if_readers_changed(self) -> None:
        """Publish again when whether the fleet reads reports, or a private run's spending, changed (an older agent
        came, or the last went)."""
        if (self.fleet_reads_reports() != self._reports_announced
                or (self._privacy_spent() is not None) != self._privacy_announced):
            self.announce()

    def announce_progress(self, current_answers: int, tasks: int) -> None:
        """Re-publish the status for an update taken: at once at the round's last answer, else at most once a
        second (an answer within the second is published when it is over)."""
        if not self._reports_announced:
            return
        last = current_answers >= tasks
        with self._progress_lock:
            if self._progress_pending and not last:
                return  # a publication is due within the second: it will say this answer too
            wait = PROGRESS_INTERVAL_S - (time.monotonic() - self._progress_announced)
            if wait > 0 and not last:
                self._progress_pending = True
                timer = threading.Timer(wait, self._announce_due)
                timer.daemon = True
                timer.start()
                return
            self._progress_announced = time.monotonic()
        self.announce()

    def _announce_due(self) -> None:
        with self._progress_lock:
            self._progress_pending = False
            self._progress_announced = time.monotonic()
        self.announce()

    def stop(self) -> None:
        """No status after this (a re-publication due within the second); the caller publishes :meth:`offline`."""
        with self._announce_lock:
            self._stopped = True

    def restart(self) -> None:
        """Announce again after :meth:`stop` (the coordinator started again)."""
        with self._announce_lock:
            self._stopped = False

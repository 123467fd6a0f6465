"""coordinator.exporter: the Prometheus metrics, as prometheus-client renders them and as its HTTP server serves
them (gauges without a value absent; the final state served until a scrape has read it); and the Grafana dashboard
in docs/ against the Grafana dashboard model and the metrics exported."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.exporter import CoordinatorMetrics
from coordinator.metrics import RoundResult, TaskRecord

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def samples(metrics: CoordinatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def task(agent: str, status: str) -> TaskRecord:
    return TaskRecord(agent, "a", status, "width=1")  # type: ignore[arg-type]


def a_round(number: int = 1, accuracy: float = 0.91) -> RoundResult:
    return RoundResult(number, accuracy, {}, 2, 3, 5000, 2500, 12.5,
                       [task("a", "ok"), task("b", "adapted"), task("c", "missing")],
                       timing={"collecting": 10.0, "evaluation": 1.5})


def test_a_figure_without_a_value_is_absent_not_zero() -> None:
    metrics = CoordinatorMetrics("lab", "heterofl")
    names = {name for name, _ in samples(metrics)}
    text = generate_latest(metrics.registry).decode()
    late = {"fedfit_round", "fedfit_global_accuracy", "fedfit_last_round_tasks", "fedfit_last_round_participants",
            "fedfit_last_round_selected", "fedfit_last_round_bytes", "fedfit_last_round_seconds",
            "fedfit_last_round_phase_seconds"}
    assert not late & names and not any(f" {name} " in text for name in late), text  # no HELP or TYPE either
    assert {"fedfit_round_expected_answers", "fedfit_rounds_total", "fedfit_info"} <= names  # 0 is their value
    metrics.round_opened(1, 3)
    assert samples(metrics)[("fedfit_round", ())] == 1 and "fedfit_global_accuracy" not in {
        name for name, _ in samples(metrics)}
    metrics.round_done(a_round())
    assert late <= {name for name, _ in samples(metrics)}


def test_a_round_as_the_metrics_tell_it() -> None:
    metrics = CoordinatorMetrics("lab", "heterofl", inbox_backlog=lambda: 7, agents_online=lambda: 3)
    metrics.round_opened(1, 3)
    metrics.update_received("accepted", 1000, received=1)
    metrics.update_received("accepted", 1500, received=2)
    metrics.update_received("late", 900)
    seen = samples(metrics)
    assert seen[("fedfit_round", ())] == 1 and seen[("fedfit_round_expected_answers", ())] == 3
    assert seen[("fedfit_round_received_answers", ())] == 2
    assert seen[("fedfit_updates_received_total", (("verdict", "accepted"),))] == 2
    assert seen[("fedfit_updates_received_total", (("verdict", "late"),))] == 1
    assert seen[("fedfit_update_bytes_received_total", ())] == 3400
    assert seen[("fedfit_agents_online", ())] == 3 and seen[("fedfit_mqtt_inbox_messages", ())] == 7
    assert seen[("fedfit_info", (("algorithm", "heterofl"), ("federation", "lab")))] == 1
    assert seen[("process_resident_memory_bytes", ())] > 0
    assert seen[("fedfit_tasks_total", (("status", "ok"),))] == 0  # every status from the start

    metrics.round_done(a_round())
    seen = samples(metrics)
    assert seen[("fedfit_rounds_total", ())] == 1 and seen[("fedfit_round", ())] == 1
    assert seen[("fedfit_round_expected_answers", ())] == 0
    assert seen[("fedfit_global_accuracy", ())] == 0.91 and seen[("fedfit_last_round_seconds", ())] == 12.5
    assert seen[("fedfit_last_round_tasks", (("status", "adapted"),))] == 1
    assert seen[("fedfit_last_round_tasks", (("status", "declined"),))] == 0
    assert seen[("fedfit_tasks_total", (("status", "missing"),))] == 1
    assert seen[("fedfit_last_round_bytes", (("direction", "down"),))] == 5000
    assert seen[("fedfit_last_round_phase_seconds", (("phase", "collecting"),))] == 10.0
    assert seen[("fedfit_last_round_participants", ())] == 2 and seen[("fedfit_last_round_selected", ())] == 3
    phases = {labels[0][1] for name, labels in seen if name == "fedfit_last_round_phase_seconds"}
    later = a_round()
    later.timing = {"collecting": 3.0}  # a round that went through fewer phases: none is left from the last
    metrics.round_done(later)
    assert len(phases) > 1 and {labels[0][1] for name, labels in samples(metrics)
                                if name == "fedfit_last_round_phase_seconds"} == {"collecting"}


def test_the_accuracy_is_the_deployed_models() -> None:
    metrics = CoordinatorMetrics("lab", "scalefl")
    result = a_round(2, 0.10)
    result.deployed, result.deployed_accuracy = "2", 0.85  # the top level's head: trained by no device
    metrics.round_done(result)
    assert samples(metrics)[("fedfit_global_accuracy", ())] == 0.85


def test_a_round_done_before_the_process_started_is_shown_not_counted() -> None:
    """A resumed coordinator shows the round it resumes after (its accuracy, its last-round figures) without
    counting it again: its counters start at 0, as a restarted process's counters do."""
    metrics = CoordinatorMetrics("lab", "heterofl")
    metrics.round_done(a_round(4, 0.93), counted=False)
    seen = samples(metrics)
    assert seen[("fedfit_round", ())] == 4 and seen[("fedfit_global_accuracy", ())] == 0.93
    assert seen[("fedfit_last_round_tasks", (("status", "ok"),))] == 1
    assert seen[("fedfit_rounds_total", ())] == 0 and seen[("fedfit_tasks_total", (("status", "ok"),))] == 0


def test_served_over_http_on_loopback() -> None:
    metrics = CoordinatorMetrics("lab", "fedavg")
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.round_opened(4, 8)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert "fedfit_round 4.0" in body and 'fedfit_info{algorithm="fedavg",federation="lab"} 1.0' in body
    finally:
        metrics.stop()
    metrics.stop()  # twice: nothing


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def stopping(metrics: CoordinatorMetrics, linger: float) -> tuple[threading.Thread, list[bool]]:
    """``metrics.stop(linger)`` on a thread of its own, started; what it returns goes in the list."""
    said: list[bool] = []
    thread = threading.Thread(target=lambda: said.append(metrics.stop(linger)), daemon=True)
    thread.start()
    return thread, said


def test_the_final_state_is_served_until_a_scrape_has_read_it() -> None:
    metrics = CoordinatorMetrics("lab", "fedavg")
    port = metrics.serve("127.0.0.1", 0)
    metrics.round_opened(6, 4)
    assert "fedfit_round 6.0" in scrape(port).splitlines()  # watched from here on
    metrics.round_done(a_round(6, 0.93))  # the final state, after that scrape
    thread, said = stopping(metrics, linger=600)
    final = scrape(port)  # what the stop waits for (True below says it waited: only this scrape came after)
    thread.join(60)
    assert said == [True] and not thread.is_alive()
    assert {"fedfit_rounds_total 1.0", "fedfit_global_accuracy 0.93"} <= set(final.splitlines()), final
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # stopped


def test_a_stop_waits_no_longer_than_its_linger_and_not_at_all_unwatched() -> None:
    watched = CoordinatorMetrics("lab", "fedavg")
    port = watched.serve("127.0.0.1", 0)
    scrape(port)
    watched.round_done(a_round())  # never scraped since
    assert watched.stop(linger=0.05) is False

    unwatched = CoordinatorMetrics("lab", "fedavg")
    unwatched.serve("127.0.0.1", 0)
    unwatched.round_done(a_round())
    thread, said = stopping(unwatched, linger=600)  # nobody ever scraped: no wait at all
    thread.join(60)
    assert said == [True]

    read = CoordinatorMetrics("lab", "fedavg")
    port = read.serve("127.0.0.1", 0)
    read.round_done(a_round())
    scrape(port)  # the final state, read before the stop
    thread, said = stopping(read, linger=600)
    thread.join(60)
    assert said == [True]


def test_the_grafana_dashboard_is_a_dashboard_of_these_metrics() -> None:
    """The Grafana dashboard model's essentials (what its import needs) and every metric a query names exported."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["title"], str) and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    assert [entry["pluginId"] for entry in dashboard["__inputs"]] == ["prometheus"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and ids
    metrics = CoordinatorMetrics("lab", "fedavg")
    metrics.round_opened(1, 3)
    metrics.round_done(a_round())  # (before, the round's figures are absent: they have no value yet)
    exported = {name for name, _ in samples(metrics)} | {family.name for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    for panel in dashboard["panels"]:
        assert panel["type"] in ("stat", "timeseries", "gauge", "table") and panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"] and len({target["refId"] for target in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            names = set(re.findall(r"\b(?:fedfit|process)_[a-z_]+", target["expr"]))
            assert names and names <= exported, (panel["title"], names - exported)
            # one coordinator's series: every metric filtered by the dashboard's job and instance
            assert target["expr"].count('{job=~"$job", instance=~"$instance"}') == len(
                re.findall(r"\b(?:fedfit|process)_[a-z_]+", target["expr"])), target["expr"]
    assert [variable["name"] for variable in dashboard["templating"]["list"]] == ["job", "instance"]


def test_a_private_run_exports_the_epsilon_it_has_spent_and_another_none() -> None:
    metrics = CoordinatorMetrics("lab", "heterofl")
    metrics.round_done(a_round())
    assert "fedfit_privacy_epsilon" not in {name for name, _ in samples(metrics)}
    private = a_round()
    private.privacy = {"epsilon": 3.5, "delta": 1e-5}
    metrics.round_done(private)
    assert samples(metrics)[("fedfit_privacy_epsilon", ())] == 3.5

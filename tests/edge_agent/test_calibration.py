"""Calibration of the memory estimator: initial factor, learning from peaks and kills, persistence."""

from __future__ import annotations

import json
import threading
import time

import pytest

from edge_agent import calibration as calibration_module
from edge_agent.calibration import Calibration


def test_initial_factor():
    calibration = Calibration()
    assert calibration.factor == 1.10
    assert calibration.corrected(1000) == 1100
    assert (calibration.ratios, calibration.floor) == ([], 0.0)
    assert Calibration(initial=2.0).factor == 2.0


def test_corrected_scales_only_the_model_dependent_part():
    calibration = Calibration()
    assert calibration.corrected(1000, overhead=400) == 400 + int(600 * 1.10)
    assert calibration.corrected(1000, overhead=1000) == 1000
    assert Calibration(initial=1.5).corrected(3) == 4  # an int, truncated
    assert isinstance(Calibration().corrected(1001), int)


def test_observe_moves_the_factor_to_the_worst_recent_ratio_times_the_margin():
    calibration = Calibration()
    calibration.observe(1000, 2000)
    assert calibration.factor == pytest.approx(2.0 * 1.05)
    calibration.observe(1000, 1500)  # a better run does not lower the envelope
    assert calibration.factor == pytest.approx(2.0 * 1.05)
    calibration.observe(1000, 2500)
    assert calibration.factor == pytest.approx(2.5 * 1.05)
    assert calibration.ratios == [2.0, 1.5, 2.5]


def test_observe_compares_the_parts_above_the_overhead():
    calibration = Calibration()
    calibration.observe(1000, 1300, overhead=400)  # (1300 - 400) / (1000 - 400)
    assert calibration.ratios == [pytest.approx(1.5)]


def test_one_measurement_moves_the_ratio_only_within_bounds():
    calibration = Calibration()
    calibration.observe(1000, 100_000)
    calibration.observe(1000, 1)
    assert calibration.ratios == [calibration_module.MAX_RATIO, calibration_module.MIN_RATIO]
    assert calibration.factor == pytest.approx(calibration_module.MAX_RATIO * 1.05)


def test_observe_can_bring_the_factor_below_the_initial_one():
    calibration = Calibration(margin=1.1)
    calibration.observe(2000, 1200)
    assert calibration.factor == pytest.approx(0.6 * 1.1)
    assert calibration.corrected(1000) == 660


def test_a_run_whose_model_part_is_too_small_to_measure_teaches_nothing(tmp_path):
    path = tmp_path / "calibration.json"
    calibration = Calibration(path)
    calibration.observe(1000, 5000, overhead=950)  # 50 bytes of model against 950 of fixed overhead
    assert calibration.ratios == [] and calibration.factor == 1.10
    assert not path.exists()


def test_a_run_small_against_the_measurement_resolution_teaches_nothing():
    calibration = Calibration(resolution=200)
    calibration.observe(1900, 5000)  # 1900 bytes of model, measured to within 200: mostly noise
    assert calibration.ratios == [] and calibration.factor == 1.10
    calibration.observe(2000, 3000)  # ten times the resolution: learnt
    assert calibration.ratios == [1.5]


def test_only_the_last_window_ratios_count():
    calibration = Calibration(window=3)
    calibration.observe(100, 250)  # ratio 2.5, pushed out by three later runs
    for _ in range(3):
        calibration.observe(100, 100)
    assert calibration.ratios == [1.0, 1.0, 1.0]
    assert calibration.factor == pytest.approx(1.05)


def test_observe_failure_raises_a_floor_the_factor_never_goes_below():
    calibration = Calibration(window=2)
    calibration.observe_failure(1000, 4000)  # the run needed more than 4000 bytes: ratio > 4 (x margin 4.2)
    assert calibration.floor == pytest.approx(2 * 1.10)  # ... but one failure at most doubles the factor
    assert calibration.factor == pytest.approx(2.2)
    calibration.observe_failure(1000, 4000)  # a second one reaches what the failure implies
    assert calibration.floor == pytest.approx(4.0 * 1.05)
    assert calibration.corrected(1000) > 4000  # the same run would now be declined at that availability
    calibration.observe(1000, 1000)
    assert calibration.factor == pytest.approx(4.2)  # learnt 1.05, held up by the floor
    calibration.observe(1000, 1000)
    calibration.observe(1000, 1000)
    assert calibration.factor == pytest.approx(4.2)  # whatever the window holds, the floor stays


def test_observe_failure_with_overhead_scales_the_model_part():
    calibration = Calibration()
    calibration.observe(1000, 1700, overhead=400)  # ratio 1300 / 600
    calibration.observe_failure(1000, 1900, overhead=400)  # implies (1900 - 400) / 600 * 1.05 = 2.625
    assert calibration.floor == pytest.approx(2.625)
    assert calibration.corrected(1000, overhead=400) == 400 + int(600 * 2.625)


def test_observe_failure_is_bounded_by_what_the_failure_implies():
    calibration = Calibration()
    calibration.observe(1000, 3000)  # factor 3.15
    calibration.observe_failure(1000, 2000)  # implies 2.1, below the current factor: nothing to raise
    assert calibration.floor == pytest.approx(2.1)
    assert calibration.factor == pytest.approx(3.15)


def test_a_smaller_failure_does_not_lower_the_floor():
    calibration = Calibration()
    calibration.observe_failure(1000, 2000)
    assert calibration.floor == pytest.approx(2.1)
    calibration.observe_failure(1000, 1000)
    assert calibration.floor == pytest.approx(2.1)


def test_persistence_round_trip(tmp_path):
    path = tmp_path / "state" / "nested" / "calibration.json"  # parents are created on save
    calibration = Calibration(path)
    assert not path.exists()  # nothing learnt, nothing written
    calibration.observe(1000, 2000)
    calibration.observe(1000, 2500)
    calibration.observe_failure(1000, 3000)  # implies 3.15; the current factor 2.625 may double
    assert json.loads(path.read_text()) == {"ratios": [2.0, 2.5], "floor": pytest.approx(3.15)}
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temporary file left

    reloaded = Calibration(path)
    assert reloaded.ratios == [2.0, 2.5]
    assert reloaded.floor == pytest.approx(3.15)
    assert reloaded.factor == pytest.approx(calibration.factor) == pytest.approx(3.15)


def test_reload_keeps_only_the_last_window_ratios(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"ratios": [9.0] + [1.0] * 5, "floor": 0.0}))
    assert Calibration(path, window=5).ratios == [1.0] * 5


def test_reload_drops_non_positive_ratios_and_negative_floor(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"ratios": [-1.0, 0.0, 2.0], "floor": -3.0}))
    calibration = Calibration(path)
    assert calibration.ratios == [2.0] and calibration.floor == 0.0


@pytest.mark.parametrize("content", [
    "", "not json", "[1, 2]", '"text"', '{"ratios": "abc"}', '{"ratios": 5}',
    '{"ratios": [1.0], "floor": "x"}',
    '{"ratios": [null]}',
], ids=repr)
def test_a_damaged_file_is_ignored(tmp_path, content):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    calibration = Calibration(path)
    assert (calibration.ratios, calibration.floor, calibration.factor) == ([], 0.0, 1.10)
    calibration.observe(1000, 2000)  # and is overwritten by what is learnt next
    assert json.loads(path.read_text()) == {"ratios": [2.0], "floor": 0.0}


@pytest.mark.parametrize(("raw", "peak"), [(0, 1000), (1000, 0), (-5, 1000), (1000, -1)])
def test_observe_ignores_non_positive_inputs(tmp_path, raw, peak):
    path = tmp_path / "calibration.json"
    calibration = Calibration(path)
    calibration.observe(raw, peak)
    assert calibration.ratios == [] and calibration.factor == 1.10
    assert not path.exists()


@pytest.mark.parametrize(("raw", "overhead"), [(0, 0), (-1000, 0), (1000, 1000), (1000, 2000)])
def test_observe_failure_ignores_estimates_without_a_model_part(tmp_path, raw, overhead):
    path = tmp_path / "calibration.json"
    calibration = Calibration(path)
    calibration.observe_failure(raw, 4000, overhead=overhead)
    assert calibration.floor == 0.0 and calibration.factor == 1.10
    assert not path.exists()


@pytest.mark.parametrize("available", [0, 300])
def test_observe_failure_with_nothing_left_above_the_overhead_does_not_change_the_floor(available):
    calibration = Calibration()
    calibration.observe_failure(1000, available, overhead=300)
    assert calibration.floor == 0.0 and calibration.factor == 1.10


def test_without_a_path_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calibration = Calibration()
    calibration.observe(1000, 2000)
    calibration.observe_failure(1000, 3000)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_observes_do_not_fail(tmp_path, monkeypatch):
    """The class says it is thread-safe: widen the window between writing the temp file and renaming it, so
    that unsynchronised saves would rename one temp file twice (FileNotFoundError)."""
    from common import durable  # where the calibration's atomic write renames

    real_replace = durable.os.replace

    def replace_together(src, dst):
        time.sleep(0.2)
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "replace", replace_together)
    calibration = Calibration(tmp_path / "calibration.json")
    errors: list[BaseException] = []

    def observe() -> None:
        try:
            calibration.observe(1000, 2000)
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=observe) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    if errors:
        raise errors[0]
    assert calibration.ratios == [2.0, 2.0]

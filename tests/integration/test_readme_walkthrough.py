"""The walkthrough of a secured fleet on one machine (docs/deployment.md, linked from the README), run as written:
its bash block, taken from that page, in a real shell, with separate processes for mosquitto, three agents and the
coordinator. Only the port is changed (to a free one), and the test kills whatever the block leaves running should
it fail half-way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from fedfit.sim.broker import find_mosquitto, free_port

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deployment.md"
HEADING = "## A secured fleet on one machine"


def walkthrough() -> str:
    """The first bash block after the walkthrough's heading in docs/deployment.md."""
    text = PAGE.read_text()
    assert HEADING in text, "docs/deployment.md lost its walkthrough"
    block = re.search(r"```bash\n(.*?)```", text.split(HEADING, 1)[1], re.DOTALL)
    assert block is not None
    return block.group(1)


def test_the_readme_walkthrough_runs_a_secured_fleet_to_the_end(tmp_path) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    script = walkthrough()
    assert script.count("--port 8883") == 1
    port = free_port()
    script = script.replace("--port 8883", f"--port {port}")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    guarded = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    # Its own process group: should the block hang, the test ends the broker, agents and coordinator with it.
    shell = subprocess.Popen(["bash", "-c", guarded], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = shell.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        stdout, stderr = shell.communicate()
        pytest.fail(f"the walkthrough did not finish within 480 s: {(stdout + stderr)[-3000:]}")
    result = subprocess.CompletedProcess(shell.args, shell.returncode, stdout, stderr)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert result.stdout.count('"global_accuracy"') >= 3  # the reader sees the rounds (interleaved with logs)
    (metrics,) = tmp_path.glob("tmp.*/runs/coordinator/metrics.jsonl")  # what `tail` showed
    rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [entry["round"] for entry in rounds] == [1, 2, 3], output[-3000:]
    for entry in rounds:
        assert entry["participants"] == 3
        assert sorted(task["agent"] for task in entry["tasks"]) == ["pi-0", "pi-1", "pi-2"]
        assert all(task["status"] == "ok" for task in entry["tasks"])
    assert rounds[-1]["global_accuracy"] > 0.1  # better than guessing one of the 10 digits
    assert "mqtt_insecure" not in output  # TLS and a login everywhere

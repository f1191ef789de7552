"""The soak benchmark (demos/soak.py), short: WebRTC clients with churn against a served
tiny-random model for ~45 s. Memory must stay flat and every thread, fd and peer socket a client
brought must be gone once it left. The long run's figures are in docs/security.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_short_soak_is_flat_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "demos" / "soak.py"), "--model", "tiny-random", "--clients", "2", "--minutes", "0.5",
         "--warmup-s", "10", "--min-stay-s", "8", "--max-stay-s", "16", "--interval", "2", "--settle-s", "2",
         "--segments", "1",
         "--port", str(free_port()), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    report = json.loads(out.read_text())
    run = [s for s in report["samples"] if s["phase"] == "run"]
    assert len(run) >= 10 and max(s["streams"] for s in run) == 2
    assert report["sessions_opened"] >= 4  # clients left and came back during the run
    assert report["leaks"] == {"threads": 0, "fds": 0, "udp_sockets": 0, "tcp_sockets": 0, "streams": 0}, report["leaks"]
    assert report["server_streams_opened"] == report["sessions_opened"]
    assert report["rss_growth"] < 0.05
    assert report["on_time_mean"] is not None and report["on_time_mean"] > 0.3
    assert result.returncode == 0, result.stdout[-2000:]

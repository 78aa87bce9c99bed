"""`linkpass coordinator` as a user runs it (a module of its own: its Ray instance must not
overlap another module's)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from linkpass.coordinator.client import Unreachable

from helpers import coordinator_client, free_port

pytestmark = pytest.mark.service


def test_linkpass_coordinator_command_runs_and_stops_on_sigterm(tmp_path):
    """The embedded default as a user runs it: a local Ray, the actor, the endpoint; SIGTERM stops
    all of it and exits 0."""
    port = free_port()
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "linkpass.cli", "coordinator", "--state-dir", str(tmp_path / "s"),
                             "--listen", f"127.0.0.1:{port}", "--max-seconds", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("running"):
                break
        assert any(f"coordinator up: https://127.0.0.1:{port}" in x for x in lines), lines
        reader = coordinator_client(f"https://127.0.0.1:{port}", (tmp_path / "s" / "reader.token").read_text().strip(),
                                    tmp_path / "s")
        assert reader.get("/v1/status")["health"] == "ok"
        reader.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(Unreachable):
            coordinator_client(f"https://127.0.0.1:{port}", None, tmp_path / "s").get("/v1/healthz")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""`linkpass coordinator` as a user runs it (a module of its own: its Ray instance must not
overlap another module's)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from linkpass.control.client import Unreachable

from support.coordinator import coordinator_client
from support.ports import free_port
from support.processes import LogDrain
from support.waiting import wait_until


def test_linkpass_coordinator_command_runs_and_stops_on_sigterm(tmp_path):
    """The embedded default as a user runs it: a local Ray, the actor, the endpoint; SIGTERM stops
    all of it and exits 0. Under systemd: the actor's log lines reach the command's stderr, with
    the journal's priority prefix, from the actor's file in the state directory."""
    port = free_port()
    # its stdout and stderr: one pipe standing in for the journal's stream, which JOURNAL_STREAM
    # names as systemd does for StandardError=journal
    r, w = os.pipe()
    st = os.fstat(w)
    env = {**os.environ, "NO_COLOR": "1", "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    proc = subprocess.Popen([sys.executable, "-m", "linkpass.cli", "coordinator", "--state-dir", str(tmp_path / "s"),
                             "--listen", f"127.0.0.1:{port}", "--max-seconds", "120"],
                            stdout=w, stderr=w, env=env)
    os.close(w)
    out = os.fdopen(r)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = out.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("running"):
                break
        assert any(f"coordinator up: https://127.0.0.1:{port}" in x for x in lines), lines
        rest = LogDrain(out)
        reader = coordinator_client(f"https://127.0.0.1:{port}", (tmp_path / "s" / "reader.token").read_text().strip(),
                                    tmp_path / "s")
        assert reader.get("/v1/status")["health"] == "ok"
        reader.close()
        wait_until(lambda: any('"event": "started"' in x for x in lines + rest.lines), 30,
                   "the actor's started line copied", lambda: lines + rest.lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        copied = [x for x in lines + rest.text().splitlines(keepends=True) if '"component": "coordinator"' in x]
        assert [x[:3] for x in copied] == ["<6>", "<6>"], copied  # info: started, then stopped
        assert [json.loads(x[3:])["event"] for x in copied] == ["started", "stopped"]
        # the file itself holds bare JSON (the actor's stderr is not the journal)
        logged = [json.loads(x) for x in (tmp_path / "s" / "coordinator.log").read_text().splitlines()]
        assert [e["event"] for e in logged] == ["started", "stopped"]
        with pytest.raises(Unreachable):
            coordinator_client(f"https://127.0.0.1:{port}", None, tmp_path / "s").get("/v1/healthz")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()

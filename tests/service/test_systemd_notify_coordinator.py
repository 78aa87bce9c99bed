"""The real `linkpass coordinator` against a real $NOTIFY_SOCKET, as systemd runs it
(docs/systemd.md), under its own unit's filter, with no capabilities: ready when its endpoint
answers, and pinging the watchdog while it does (the agent: tests/root/test_systemd_notify.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support.coordinator import coordinator_client
from support.ports import free_port
from support.processes import LogDrain
from support.systemd import EMULATE, LINKPASS, SANDBOX, NotifyListener, sandbox_spec


@pytest.mark.skipif(not EMULATE, reason="needs libseccomp and systemd-analyze")
def test_the_coordinator_is_ready_when_its_endpoint_answers_and_pings_while_it_does(tmp_path):
    """The embedded default (a local Ray instance and the actor) under its unit's system call
    filter, address families and W^X, without capabilities: READY=1 only once /v1/healthz
    answers, WATCHDOG=1 every half timeout, STOPPING=1 on SIGTERM, exit 0."""
    port = free_port()
    spec = tmp_path / "sandbox.json"
    spec.write_text(json.dumps(sandbox_spec("linkpass-coordinator")))
    listener = NotifyListener(str(tmp_path / "notify"))
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []  # as the unit: none
    env = {**os.environ, "NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "4000000", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([*drop, sys.executable, "-c", SANDBOX, str(spec), sys.executable, *LINKPASS, "coordinator",
                             "--state-dir", str(tmp_path / "s"), "--listen", f"127.0.0.1:{port}", "--max-seconds",
                             "150"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = LogDrain(proc.stdout)
    try:
        ready = listener.wait_for(rf"^READY=1\nSTATUS=serving https://127.0.0.1:{port}$", 120)
        client = coordinator_client(f"https://127.0.0.1:{port}", None, tmp_path / "s")
        assert client.get("/v1/healthz") == {"ok": True}  # it answered before READY=1; it still does
        client.close()
        listener.wait_count("WATCHDOG=1", 2, 10, after=ready)  # every 2 s: half of WATCHDOG_USEC
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, out.text()[-3000:]
        listener.wait_for(r"^STOPPING=1", 5)
    finally:
        if proc.poll() is None:  # SIGTERM first: the command stops the actor and its Ray instance
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        listener.close()

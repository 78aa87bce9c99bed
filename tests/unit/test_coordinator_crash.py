"""A coordinator process SIGKILLed in the middle of what one request writes to its store: the
request's client retries it against the restarted coordinator (a new process on the same SQLite
file) and gets an answer; what that answer promises must then be in the store, whole. The kill
is real (the writer's own process, at a chosen write), so is the database file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from linkpass.coordinator.coordinator import Coordinator
from linkpass.coordinator.store import Store

from support.fleet import MODEL, identity, table_of


# the child: a coordinator on the database that dies by SIGKILL at the chosen write of one call
CHILD = """
import json, os, signal, sys
from linkpass.coordinator.coordinator import Coordinator
from linkpass.coordinator.store import Store
from linkpass.core.fabric import FabricModel

db, model, method, key, call, args = sys.argv[1:7]
store = Store(db)
c = Coordinator(store, FabricModel.from_dict(json.load(open(model))), wall_s=2000.0)
real = getattr(Store, method)

def die(self, *a, **kw):
    if key in ("", str(a[0])):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **kw)

setattr(Store, method, die)
getattr(c, call)(*json.loads(args))
print("the call returned: the kill point was never reached", flush=True)
"""


def crash_during(tmp_path, method: str, key: str, call: str, args: list) -> None:
    model = tmp_path / "fabric.json"
    model.write_text(json.dumps(MODEL.to_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "c.db"), str(model), method, key, call,
                           json.dumps(args)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


@pytest.fixture
def registered(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, wall_s=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    versions = c.drain_version
    store.close()
    return versions


def restarted(tmp_path) -> Coordinator:
    return Coordinator(Store(str(tmp_path / "c.db")), MODEL, wall_s=3000.0)


def test_a_report_killed_before_its_event_is_written_leaves_the_event_to_its_retry(tmp_path, registered):
    report = {"name": "h0", "changes": [{"id": 3, "state": "down", "reason": "hard_failure"}]}
    crash_during(tmp_path, "add_events", "", "report", [report, 2000.0])
    c = restarted(tmp_path)
    c.report(report, 3001.0)  # the agent's retry, answered
    events = [e for e in c.store.events(kinds=["detection"]) if e["subject"] == "h0/3"]
    assert len(events) == 1 and events[0]["detail"]["state"] == "down"
    assert c.paths["h0/3"].state == "down"


def test_a_drain_killed_before_its_version_is_written_reaches_agents_after_its_retry(tmp_path, registered):
    before = registered
    crash_during(tmp_path, "set_meta", "drain_version", "drain", ["p0l0-p0s1", "bad optics", "op", 2000.0])
    c = restarted(tmp_path)
    c.drain("p0l0-p0s1", "bad optics", "op", 3001.0)  # the operator's retry, answered
    # an agent holding the drains as they were before gets the new one
    answer = c.report({"name": "h1", "changes": [], "drain_version": before}, 3002.0)
    assert [d["link"] for d in answer.get("drains", [])] == ["p0l0-p0s1"]
    assert [e["subject"] for e in c.store.events(kinds=["drain"])] == ["p0l0-p0s1"]


def test_an_undrain_killed_before_its_event_is_written_is_in_the_history_after_its_retry(tmp_path, registered):
    c = restarted(tmp_path)
    c.drain("p0l0-p0s1", "bad optics", "op", 1500.0)
    version = c.drain_version
    c.store.close()
    crash_during(tmp_path, "add_events", "", "undrain", ["p0l0-p0s1", "op", 2000.0])
    c = restarted(tmp_path)
    c.undrain("p0l0-p0s1", "op", 3001.0)  # the operator's retry, answered
    assert [e["subject"] for e in c.store.events(kinds=["undrain"])] == ["p0l0-p0s1"]
    answer = c.report({"name": "h1", "changes": [], "drain_version": version}, 3002.0)
    assert answer.get("drains") == []

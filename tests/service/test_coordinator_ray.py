"""The coordinator as a real detached Ray actor: one bootstrap path (get-if-exists), and a killed
actor process comes back on the same endpoint with everything it knew, from either store: SQLite
in its state directory and PostgreSQL (a real server, started and removed here); and the actors'
internal methods refuse a driver without their credential. A sharded coordinator's:
test_coordinator_ray_shards.py."""
from __future__ import annotations

import json
import os
import signal

import pytest

from linkpass.coordinator import ray_actor

from support.coordinator import agent_tokens, coordinator_client, ray_coordinator, role_token as token, wait_answering
from support.fleet import identity, table_of
from support.ports import free_port


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def actor(request, tmp_path_factory):
    with ray_coordinator(tmp_path_factory.mktemp("coord"), request.param) as running:
        yield running


def actor_log(settings) -> list[dict]:
    """The actor's log lines, from its file in the state directory (not Ray's worker files)."""
    with open(os.path.join(settings["state_dir"], "coordinator.log")) as f:
        return [json.loads(line) for line in f]


def test_ensure_returns_the_running_actor(actor):
    handle, url, settings = actor
    again, url2 = ray_actor.ensure({**settings, "listen": "127.0.0.1:1"})  # settings of a second call are ignored
    assert url2 == url
    assert ray_actor.actor_pid(again) == ray_actor.actor_pid(handle)
    started = [e for e in actor_log(settings) if e["event"] == "started"]
    assert [(e["component"], e["level"], e["url"], e["pid"], e["store"]) for e in started] == \
        [("coordinator", "info", url, ray_actor.actor_pid(handle), "postgresql" if "store" in settings else "sqlite")]


def test_killed_actor_restarts_and_loses_nothing(actor):
    handle, url, settings = actor
    agents = {h: coordinator_client(url, t, settings["state_dir"]) for h, t in agent_tokens(settings["state_dir"]).items()}
    op = coordinator_client(url, token(settings, "operator"), settings["state_dir"])
    for i in range(4):
        agents[f"h{i}"].post("/v1/register", {**identity(i), "paths": table_of(i)})
    op.post("/v1/drain", {"link": "p1l1-p1s1", "reason": "before the crash"})
    down = [{"id": k, "state": "down", "reason": "hard_failure"} for k in (1, 2)]
    agents["h0"].post("/v1/report", {"name": "h0", "changes": down})
    before = wait_answering(op)
    events_before = op.get("/v1/events", since=0)

    old = ray_actor.actor_pid(handle)
    os.kill(old, signal.SIGKILL)
    new = ray_actor.wait_restarted(handle, old, timeout_s=90)
    assert new != old
    after = wait_answering(op)
    for k in ("agents", "paths", "paths_by_state", "drains", "drain_version", "fabric"):
        assert after[k] == before[k], k
    events_after = op.get("/v1/events", since=0)
    assert events_after[:len(events_before)] == events_before
    # the new process logs into the same file, after the old one's lines
    assert [e["pid"] for e in actor_log(settings) if e["event"] == "started"][-2:] == [old, new]
    assert events_after[-1]["kind"] == "coordinator" and events_after[-1]["detail"]["recovered_paths"] == 40
    if "store" in settings:  # nothing of it was in the state directory: the actor could have come back on any node
        assert not os.path.exists(os.path.join(settings["state_dir"], "coordinator.db"))
    # agents carry on against the new process
    answer = agents["h0"].post("/v1/report", {"name": "h0", "drain_version": None})
    assert answer["drains"] == [{"link": "p1l1-p1s1", "addrs": answer["drains"][0]["addrs"]}]
    for a in agents.values():
        a.close()
    op.close()




def test_the_roots_internal_methods_refuse_a_driver_without_the_actors_credential(actor):
    """Any driver of the Ray cluster (this test process is one) finds the root by name. What only
    its shards may call (their agents' registrations and reports, history events) is refused
    without the credential the actors derive from the agent secret, or with another one; with
    it, the calls are taken. Ray's token authentication keeps unknown drivers off the cluster;
    this keeps a driver that got on from speaking for agents."""
    import ray

    from linkpass.control.bodies import parse_register, parse_report

    _, url, settings = actor
    root = ray.get_actor(ray_actor.ACTOR_NAME, namespace=ray_actor.NAMESPACE)  # no LinkPass code needed
    down = parse_report({"name": "h1", "changes": [{"id": 2, "state": "down", "reason": "hard_failure"}]})
    calls = {"shard_register": (parse_register({**identity(1), "paths": table_of(1)}),),
             "shard_report": (down,), "shard_reports": ([down],), "heard": (0, ["h1"]),
             "add_events": ([(1.0, "agent", "intruder", "h1", {"what": "lost"})],)}
    for method, args in calls.items():
        with pytest.raises(PermissionError, match=f"{method}: refused: no credential"):
            ray.get(getattr(root, method).remote(*args), timeout=60)
        with pytest.raises(PermissionError, match=f"{method}: refused: the credential is not"):
            ray.get(getattr(root, method).remote(*args, credential="0" * 64), timeout=60)
    op = coordinator_client(url, token(settings, "operator"), settings["state_dir"])
    assert not [e for e in op.get("/v1/events", since=0) if e.get("actor") == "intruder"]  # none of it arrived
    op.close()
    credential = ray_actor.actor_credential(settings)
    assert ray.get(root.shard_reports.remote([], credential=credential), timeout=60) == []
    assert ray.get(root.add_events.remote([], credential=credential), timeout=60) is None


def test_a_shards_part_refuses_a_driver_without_the_actors_credential(actor):
    """A shard's localize_part (the root's rounds of localization) takes the same credential: a
    shard of a two-shard coordinator of the same state directory, beside the running root."""
    import ray

    _, _, settings = actor
    two = {**settings, "shards": 2, "shard_listen": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    shard = ray_actor.ShardActor.options(name="credential-check-shard", namespace=ray_actor.NAMESPACE).remote(two, 0)
    try:
        ray_actor.endpoint(shard)
        fresh = ("a-session", None, 1, [], "count", ())  # start the part afresh, and count its paths
        with pytest.raises(PermissionError, match="localize_part: refused: no credential"):
            ray.get(shard.localize_part.remote(*fresh), timeout=60)
        with pytest.raises(PermissionError, match="localize_part: refused: the credential is not"):
            ray.get(shard.localize_part.remote(*fresh, credential="0" * 64), timeout=60)
        assert ray.get(shard.localize_part.remote(*fresh, credential=ray_actor.actor_credential(two)), timeout=60) == 0
    finally:
        ray_actor.stop(shard)

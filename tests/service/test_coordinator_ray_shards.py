"""A sharded coordinator as real detached Ray actors, a root and two shards: agents given the root's
address are sent to their shards, and a killed root or shard comes back with nothing lost, with
either store (SQLite in the state directory, PostgreSQL: a real server, started and removed here)."""
from __future__ import annotations

import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from linkpass.coordinator import ray_actor
from linkpass.control.client import Moved, Refusal, Unreachable
from linkpass.core.shards import ShardMap

from support.coordinator import agent_tokens, coordinator_client, ray_coordinator, role_token, wait_answering
from support.fleet import MODEL, identity, table_of
from support.ports import free_port
from support.waiting import wait_until


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def sharded(request, tmp_path_factory):
    shard_listen = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with ray_coordinator(tmp_path_factory.mktemp("sharded"), request.param, shards=2,
                         shard_listen=shard_listen) as running:
        yield running


def register_through_root(url, settings) -> dict:
    """Each agent posts to the root, is sent to its shard and registers there; host -> its shard's client."""
    out = {}
    for h, t in agent_tokens(settings["state_dir"]).items():
        i = int(h[1:])
        with coordinator_client(url, t, settings["state_dir"]) as root, pytest.raises(Moved) as moved:
            root.post("/v1/register", {**identity(i), "paths": table_of(i)})
        out[h] = coordinator_client(moved.value.url, t, settings["state_dir"])
        out[h].post("/v1/register", {**identity(i), "paths": table_of(i)})
    return out


@pytest.mark.parametrize("victim", ["shard", "root"])
def test_a_killed_shard_or_root_restarts_and_loses_nothing(sharded, victim):
    handle, url, settings = sharded
    shards = ray_actor.shards()
    assert len(shards) == 2 and {ray_actor.endpoint(h) for h in shards} == \
        {f"https://{a}" for a in settings["shard_listen"]}
    agents = register_through_root(url, settings)
    op = coordinator_client(url, role_token(settings, "operator"), settings["state_dir"])
    agents["h2"].post("/v1/report", {"name": "h2", "changes": [{"id": 3, "state": "down", "reason": "hard_failure"}]})
    before = wait_answering(op)
    assert before["agents"] == 4 and before["paths_by_state"].get("down", 0) >= 1

    target = shards[1] if victim == "shard" else handle
    old = ray_actor.actor_pid(target)
    os.kill(old, signal.SIGKILL)
    assert ray_actor.wait_restarted(target, old, timeout_s=90) != old
    after = wait_answering(op)
    for k in ("agents", "paths", "paths_by_state", "fabric"):
        assert after[k] == before[k], k
    # the agents of the shard carry on: a report that brings news reaches the root again
    deadline = time.monotonic() + 60
    while True:
        try:
            agents["h3"].post("/v1/report", {"name": "h3", "changes": [{"id": 1, "state": "down",
                                                                          "reason": "hard_failure"}]})
            break
        except (Unreachable, Refusal):  # the shard's endpoint, or its root, is not back yet
            assert time.monotonic() < deadline, "h3's shard never took its report again"
            time.sleep(0.5)
    wait_until(lambda: wait_answering(op)["paths_by_state"].get("down", 0) == before["paths_by_state"]["down"] + 1,
               30, "h3's change reached the root through its shard")
    agents["h3"].post("/v1/report", {"name": "h3", "changes": [{"id": 1, "state": "up", "reason": None}]})
    for a in agents.values():
        a.close()
    op.close()


def cut_changes(host: str, state: str) -> list[dict]:
    """`host`'s changes setting every path of its table over the cut link to `state`."""
    i = int(host[1:])
    out = []
    for row in table_of(i):
        if CUT & set(MODEL.links_of_path(host, row["plane"], row["hops"], row["peer_addr"])):
            out.append({"id": row["id"], "state": state, "reason": "hard_failure" if state == "down" else None})
    return out


CUT = {"p0l0-p0s1:up", "p0l0-p0s1:down"}


def test_the_shard_actors_localize_and_a_killed_ones_part_is_sent_again(sharded):
    handle, url, settings = sharded
    agents = register_through_root(url, settings)
    op = coordinator_client(url, role_token(settings, "operator"), settings["state_dir"])

    def localized():
        doc = wait_answering(op)
        return {f["directed"] for f in doc["findings"]}, {x["localized_by"] for x in doc["shards"]}

    def report(state):
        for h, a in agents.items():
            deadline = time.monotonic() + 60
            while True:
                try:
                    a.post("/v1/report", {"name": h, "changes": cut_changes(h, state)})
                    break
                except (Unreachable, Refusal):  # a restarted shard, or its root, not back yet
                    assert time.monotonic() < deadline, f"{h}'s shard never took its report"
                    time.sleep(0.5)

    report("down")
    wait_until(lambda: localized() == (CUT, {"shard"}), 30, "the shards localize the cut")
    whole = sent_whole(url, settings)
    owner = ShardMap(MODEL, 2).owner("p0l0-p0s1:up")
    victim = ray_actor.shards()[owner]
    old = ray_actor.actor_pid(victim)
    os.kill(old, signal.SIGKILL)
    assert ray_actor.wait_restarted(victim, old, timeout_s=90) != old
    report("up")  # the restarted shard's part is asked with nothing in it: the root sends it again
    wait_until(lambda: localized() == (set(), {"shard"}), 60, "the cut cleared, localized by the shards again")
    assert sent_whole(url, settings) > whole
    for a in agents.values():
        a.close()
    op.close()


def sent_whole(url, settings) -> float:
    with coordinator_client(url, None, settings["state_dir"]) as c:
        text = c.get("/metrics").decode()
    return next(x.value for f in text_string_to_metric_families(text) for x in f.samples
                if x.name == "linkpass_coordinator_localization_parts_sent_whole_total")

"""The coordinator as a plain class (no Ray, no sockets): reports in, localization, drains with
the blast-radius guard and what-if, persistence across a restart (a real SQLite file)."""
from __future__ import annotations

import pytest

from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig, CoordinatorError, NotFound, Refused
from linkpass.coordinator.store import Store

from helpers import FAB, MODEL, bare, fail_paths, identity, table_of

pytestmark = pytest.mark.unit


@pytest.fixture
def coord(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=0.05), now=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    yield c
    store.close()


def test_registration_maps_every_path_onto_fabric_links(coord):
    assert len(coord.paths) == 4 * (2 + 8)  # per host: 1 same-leaf peer x 2 planes, 2 others x 2 planes x 2 spines
    rec = next(r for r in coord.paths.values() if r.reporter == "h0" and r.peer == "h3" and r.plane == 0)
    assert rec.links[0] == "h0-p0l0:up" and rec.links[-1] == "h3-p0l1:down" and len(rec.links) == 4
    assert coord.counters["paths_unmapped"] == 0
    st = coord.status(1001.0)
    assert st["health"] == "ok" and st["agents"] == 4 and st["paths_by_state"] == {"up": 40}


def test_a_cut_spine_link_is_localized_with_both_directions(coord):
    link = "p0l0-p0s1"
    n = fail_paths(coord, 1001.0, {f"{link}:up", f"{link}:down"})
    assert n > 0
    found = coord.relocalize(1001.0)
    assert {f["directed"] for f in found} == {f"{link}:up", f"{link}:down"}
    assert coord.status(1001.0)["health"] == "critical"
    rows = {r["link"]: r for r in coord.links()}
    assert rows[link]["health"] == "faulty" and rows["p0l0-p0s0"]["health"] == "ok"
    kinds = [e["kind"] for e in coord.store.events()]
    assert kinds.count("localization") == 2 and "detection" in kinds
    # recovering (hold-down) keeps the finding; up clears it, and that is recorded
    for state, still in (("recovering", 2), ("up", 0)):
        for i in range(4):
            coord.report({"name": f"h{i}", "changes": [{"id": int(k.split("/")[1]), "state": state, "reason": None}
                                                        for k, r in coord.paths.items() if r.reporter == f"h{i}"]},
                         1002.0)
        coord.tick(1002.0)
        assert len(coord.findings) == still, state
    assert [e["kind"] for e in coord.store.events()].count("cleared") == 2


def test_one_direction_gray_loss_names_the_direction(coord):
    target = "p1l1-p1s0:down"  # spine -> leaf 1 in plane 1: forward for probes towards h2, h3
    fail_paths(coord, 1001.0, {target}, reason="gray_loss_fwd", state="degraded")
    found = coord.relocalize(1001.0)
    # with two leaves per plane, leaf 0 -> spine 0 is crossed by exactly the same probes as
    # spine 0 -> leaf 1: the evidence cannot choose, and the finding must say so
    assert len(found) == 1
    named = {found[0]["directed"], *found[0]["alternatives"]}
    assert named == {target, "p1l0-p1s0:up"}
    assert found[0]["confidence"] <= 0.5


def test_a_lone_lying_agent_produces_no_finding(coord):
    changes = [{"id": int(k.split("/")[1]), "state": "down", "reason": "hard_failure"}
               for k, r in coord.paths.items() if r.reporter == "h1"]
    coord.report({"name": "h1", "changes": changes}, 1001.0)
    assert coord.relocalize(1001.0) == []
    assert coord.status(1001.0)["health"] == "warning"


def test_restart_recovers_agents_paths_drains_and_history(tmp_path):
    path = str(tmp_path / "c.db")
    store = Store(path)
    c = Coordinator(store, MODEL, now=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    c.drain("p0l0-p0s1", "optic flapping, ticket 42", "alice", 1001.0)
    fail_paths(c, 1002.0, {"p1l0-p1s0:up", "p1l0-p1s0:down"})
    c.relocalize(1002.0)
    before = (c.status(1003.0), c.links(), c.path_rows(), c.drain_addresses())
    store.close()  # the actor process dies; a new one opens the same file

    store2 = Store(path)
    c2 = Coordinator(store2, MODEL, now=2000.0)
    c2.relocalize(2000.0)
    after = (c2.status(1003.0), c2.links(), c2.path_rows(), c2.drain_addresses())
    for a, b in zip(before, after):
        if isinstance(a, dict):
            a, b = {k: v for k, v in a.items() if k != "uptime_s"}, {k: v for k, v in b.items() if k != "uptime_s"}
        assert a == b
    assert c2.drain_version == c.drain_version
    assert any(e["kind"] == "drain" and e["actor"] == "alice" for e in store2.events())
    store2.close()


def test_drain_what_if_moves_exactly_the_crossing_paths(coord):
    out = coord.drain("h3-p0l1", "replace optic", "alice", 1001.0, dry_run=True)
    imp = out["impact"]
    # h3's own plane-0 paths, and every other host's plane-0 paths to h3
    assert imp["hosts"] == ["h0", "h1", "h2", "h3"]
    assert imp["paths_moved"] == 5 + 5 and imp["stranded"] == []
    assert coord.drains == {}  # a dry run changes nothing
    assert not [e for e in coord.store.events() if e["kind"] == "drain"]


def test_drain_publishes_link_addresses_and_undrain_withdraws(coord):
    v0 = coord.drain_version
    coord.drain("p0l1-p0s0", "maintenance", "alice", 1001.0)
    assert coord.drain_version == v0 + 1
    lk = FAB.links["p0l1-p0s0"]
    assert coord.drain_addresses() == [{"link": "p0l1-p0s0", "addrs": [bare(lk.a_addr), bare(lk.b_addr)]}]
    answer = coord.report({"name": "h0", "drain_version": v0}, 1001.5)
    assert answer["drains"][0]["link"] == "p0l1-p0s0"
    assert "drains" not in coord.report({"name": "h0", "drain_version": coord.drain_version}, 1001.6)
    assert coord.drain("p0s0-p0l1", "again", "bob", 1002.0)["changed"] is False  # either order names it
    coord.undrain("p0l1-p0s0", "bob", 1003.0)
    assert coord.drain_addresses() == [] and coord.drain_version == v0 + 2
    ev = [e for e in coord.store.events() if e["kind"] == "undrain"][0]
    assert ev["actor"] == "bob" and ev["detail"]["drained_by"] == "alice"


def test_blast_radius_guard_refuses_and_logs(coord):
    coord.drain("p0l0-p0s0", "first", "alice", 1001.0)
    with pytest.raises(Refused, match="blast-radius guard: 1 of 4 leaf-spine links in plane 0"):
        coord.drain("p0l1-p0s1", "second", "alice", 1002.0)
    assert "p0l1-p0s1" not in coord.drains
    refused = [e for e in coord.store.events() if e["kind"] == "refused"]
    assert refused and refused[0]["actor"] == "alice" and "blast-radius" in refused[0]["detail"]["why"]
    # a dry run says it would be refused instead of raising
    assert "blast-radius" in coord.drain("p0l1-p0s1", "second", "alice", 1002.0, dry_run=True)["refused"]
    # another plane or tier has its own budget
    assert coord.drain("p1l1-p1s1", "other plane", "alice", 1003.0)["changed"]


def test_drain_refuses_to_strand_a_host_pair(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=1.0), now=0.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 0.0)
    c.drain("h0-p0l0", "a", "alice", 1.0)
    with pytest.raises(Refused, match="h0 -> h1"):
        c.drain("h0-p1l0", "b", "alice", 2.0)
    assert c.drain("h0-p1l0", "b", "alice", 2.0, force=True)["changed"]
    store.close()


def test_bad_requests_name_the_field(coord):
    with pytest.raises(CoordinatorError, match="name: required"):
        coord.report({}, 1.0)
    with pytest.raises(NotFound, match="has not registered"):
        coord.report({"name": "h9"}, 1.0)
    with pytest.raises(CoordinatorError, match="state: 'sideways'"):
        coord.report({"name": "h0", "changes": [{"id": 1, "state": "sideways"}]}, 1.0)
    with pytest.raises(CoordinatorError, match="nics: expected plane number"):
        coord.register({**identity(0), "nics": {"zero": "198.18.64.1"}, "paths": []}, 1.0)
    with pytest.raises(NotFound, match="no link named 'p9l9-p9s9'"):
        coord.drain("p9l9-p9s9", "x", "alice", 1.0)
    with pytest.raises(CoordinatorError, match="needs --reason"):
        coord.drain("p0l0-p0s0", " ", "alice", 1.0)
    for hops in (5, [1, 2], {"a": 1}):
        with pytest.raises(CoordinatorError, match="hops: expected a list of router addresses"):
            coord.report({"name": "h0", "paths": [{"id": 99, "peer": "h1", "plane": 0, "hops": hops, "state": "up"}]},
                         1.0)
    # a non-text reason was an HTTP 500 (found by the property test below: sqlite cannot bind a list)
    for body in ({"name": "h0", "paths": [{"id": 99, "peer": "h1", "plane": 0, "state": "up", "reason": [1]}]},
                 {"name": "h0", "changes": [{"id": 1, "state": "down", "reason": {"a": 1}}]}):
        with pytest.raises(CoordinatorError, match="reason: expected a string or null"):
            coord.report(body, 1.0)
    # unknown path ids in changes are counted, not fatal (the next summary brings them)
    coord.report({"name": "h0", "changes": [{"id": 999, "state": "down"}]}, 1.0)
    assert coord.counters["changes_unknown_path"] == 1


def test_lost_agent_is_reported_and_returns(coord):
    for i in range(3):
        coord.report({"name": f"h{i}"}, 1015.0)
    coord.tick(1015.0)
    assert coord.status(1015.0)["agents_lost"] == ["h3"]
    coord.report({"name": "h3"}, 1016.0)
    assert coord.status(1016.0)["agents_lost"] == []
    whats = [e["detail"]["what"] for e in coord.store.events() if e["kind"] == "agent" and e["subject"] == "h3"]
    assert whats[-2:] == ["lost", "returned"]


def test_plan_names_every_peer_in_a_small_fleet_and_follows_leavers(coord):
    coord.tick(1001.0)  # joins since the last revision are planned
    plan = coord.plan_for("h0", 1001.0)
    assert [p["name"] for p in plan["peers"]] == ["h1", "h2", "h3"]
    assert plan["peers"][0]["nics"] == {"0": FAB.nic_addr(1, 0), "1": FAB.nic_addr(1, 1)}
    v = plan["version"]
    for i in range(3):
        coord.report({"name": f"h{i}"}, 1015.0)
    coord.tick(1015.0)  # h3 lost: the plan is revised without it
    plan = coord.plan_for("h0", 1015.0)
    assert plan["version"] > v and [p["name"] for p in plan["peers"]] == ["h1", "h2"]


def test_without_a_fabric_model_reports_still_work(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, None, now=0.0)
    c.register({**identity(0), "paths": table_of(0)}, 0.0)
    c.register({**identity(1), "paths": []}, 0.0)
    assert c.status(1.0)["paths"] == 10 and c.relocalize(1.0) == []
    c.tick(2.0)
    assert [p["name"] for p in c.plan_for("h0", 2.0)["peers"]] == ["h1"]
    with pytest.raises(CoordinatorError, match="no fabric model"):
        c.links()
    store.close()


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 70000) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)
# mostly well-formed paths with one field at a time going wrong, so deep checks are reached too
_path = st.fixed_dictionaries({"id": st.integers(1, 40), "peer": st.just("h1"), "plane": st.integers(0, 1),
                               "state": st.sampled_from(["up", "down"])},
                              optional={"hops": _json | st.lists(st.sampled_from(["198.18.64.0", "1.2.3.4"]) | _json),
                                        "peer_addr": _json, "sport": _json, "reason": _json}) | \
    st.fixed_dictionaries({}, optional={"id": _json, "peer": _json, "plane": _json, "state": _json, "hops": _json})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({"name": st.just("h0") | _json},
                                  optional={"changes": st.lists(_path, max_size=3) | _json,
                                            "paths": st.lists(_path, max_size=3) | _json,
                                            "agent_id": _json, "service": _json, "nics": _json}))
def test_garbage_reports_are_refused_cleanly(coord, body):
    """Whatever an agent (or an attacker with an agent token) sends: an answer or a
    CoordinatorError naming the problem, never another exception, and the coordinator goes on."""
    for call in (coord.report, coord.register):
        try:
            call(body, 1001.0)
        except CoordinatorError:
            pass
    coord.tick(1001.0)
    assert coord.status(1001.0)["agents"] >= 4

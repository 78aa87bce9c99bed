"""The coordinator as a plain class (no Ray, no sockets): reports in, localization, drains with
the blast-radius guard and what-if, persistence across a restart (a real SQLite file)."""
from __future__ import annotations

import pytest

from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig, CoordinatorError, NotFound, Refused
from linkpass.coordinator.store import Store

from support.fleet import FAB, MODEL, bare, fail_paths, identity, table_of


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
    c = Coordinator(store, MODEL, wall_s=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    c.drain("p0l0-p0s1", "optic flapping, ticket 42", "alice", 1001.0)
    fail_paths(c, 1002.0, {"p1l0-p1s0:up", "p1l0-p1s0:down"})
    c.relocalize(1002.0)
    before = (c.status(1003.0), c.links(), c.path_rows(), c.drain_addresses())
    store.close()  # the actor process dies; a new one opens the same file

    store2 = Store(path)
    c2 = Coordinator(store2, MODEL, wall_s=2000.0)
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
    c = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=1.0), wall_s=0.0)
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
    for hops, words in ((5, r"paths\[0\]\.hops: expected a list of router addresses"), ({"a": 1}, "hops: expected a list"),
                        ([1, 2], r"paths\[0\]\.hops\[0\]: expected an IP address")):
        with pytest.raises(CoordinatorError, match=words):
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


def test_probe_budgets_cap_the_plan_and_a_changed_budget_revises_it(coord):
    coord.tick(1001.0)
    assert coord._plan.full_mesh and len(coord._plan.paths["h0"]) == 10  # 1 rack mate + 2 others x 2 spines, x 2 planes
    v = coord.plan_version
    # 100 pps at 100 ms idle: half affords 5 planned paths
    coord.report({"name": "h0", "probe_budget": {"pps": 100, "idle_interval_ms": 100}}, 1002.0)
    coord.tick(1002.0)
    assert coord.plan_version == v + 1 and len(coord._plan.paths["h0"]) <= 5
    assert coord._plan.under_covered == [] and not coord._plan.full_mesh
    assert coord.store.agents()["h0"]["probe_budget"] == {"pps": 100.0, "idle_interval_ms": 100.0}
    # budgets too small for 2 reporters on every link: the plan says which, once, in the history
    for i in range(4):
        coord.report({"name": f"h{i}", "probe_budget": {"pps": 20, "idle_interval_ms": 100}}, 1003.0)
    coord.tick(1005.0)  # the first report's answer revised the plan at once; the rest wait PLAN_REVISE_S
    assert all(len(ps) <= 1 for ps in coord._plan.paths.values()) and coord._plan.under_covered
    [ev] = [e for e in coord.store.events(kinds=["coordinator"]) if e["subject"] == "plan"]
    assert ev["detail"]["what"] == "under_covered" and ev["detail"]["count"] == len(coord._plan.under_covered)
    # the same budget again is no change; 0 (no ceiling) lifts the caps and the event says so
    v = coord.plan_version
    coord.report({"name": "h0", "probe_budget": {"pps": 20, "idle_interval_ms": 100}}, 1007.0)
    coord.tick(1007.0)
    assert coord.plan_version == v
    for i in range(4):
        coord.report({"name": f"h{i}", "probe_budget": {"pps": 0, "idle_interval_ms": 100}}, 1008.0)
    coord.tick(1010.0)
    assert coord.plan_version == v + 2 and coord._plan.full_mesh and coord._plan.under_covered == []
    assert [e["detail"]["what"] for e in coord.store.events(kinds=["coordinator"])
            if e["subject"] == "plan"] == ["under_covered", "covered"]


def test_the_agent_link_sends_its_budget_at_registration_and_when_a_reload_changes_it(coord, tmp_path):
    import threading
    import time

    from linkpass.control.answers import AnswerRules
    from linkpass.agent.config import AgentConfig, CoordinatorLinkConfig
    from linkpass.agent.coordinator_link import CoordinatorLink, probe_budget

    token = tmp_path / "t"
    token.write_text("lpa1.h0.x\n")
    cfg = AgentConfig(agent_id=1, name="h0", fleet_key_file="/k", service="198.18.0.1", nics=(), peers=(),
                      budget_pps=100.0, idle_interval_ms=100.0, idle_rates=True)
    current = {"cfg": cfg}  # what a reload replaces
    sent, lock = [], threading.Lock()

    class Fake:  # the coordinator in-process instead of over HTTP
        token = "lpa1.h0.x"

        def post(self, path, body):
            with lock:
                sent.append((path, body))
                call = coord.register if path == "/v1/register" else coord.report
                return call(body, 1001.0)

        def close(self):
            pass

    link = CoordinatorLink(CoordinatorLinkConfig("http://127.0.0.1:9", str(token), insecure_http=True, report_ms=10),
                           lambda: identity(0), lambda: table_of(0), lambda d: None, lambda p: None,
                           lambda *a, **k: None, rules=AnswerRules("h0", 1, 1024),
                           budget=lambda: probe_budget(current["cfg"]))
    link.client = Fake()

    def wait_for(pred):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with lock:
                if pred():
                    return True
            time.sleep(0.01)
        return False
    link.start()
    try:
        assert wait_for(lambda: sent and sent[0][0] == "/v1/register")
        assert sent[0][1]["probe_budget"] == {"pps": 100.0, "idle_interval_ms": 100.0}
        assert coord.agents["h0"].info["probe_budget"] == {"pps": 100.0, "idle_interval_ms": 100.0}
        current["cfg"] = AgentConfig(**{**cfg.__dict__, "budget_pps": 50.0})  # SIGHUP with a new budget
        assert wait_for(lambda: any(b.get("probe_budget") == {"pps": 50.0, "idle_interval_ms": 100.0}
                                    for p, b in sent if p == "/v1/report"))
        n = len(sent)
        assert wait_for(lambda: len(sent) > n + 2)  # later reports do not repeat it
        with lock:
            assert [b for p, b in sent[n:] if "probe_budget" in b] == []
        assert coord.agents["h0"].info["probe_budget"]["pps"] == 50.0
    finally:
        link.stop()


def test_without_a_fabric_model_reports_still_work(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, None, wall_s=0.0)
    c.register({**identity(0), "paths": table_of(0)}, 0.0)
    c.register({**identity(1), "paths": []}, 0.0)
    assert c.status(1.0)["paths"] == 10 and c.relocalize(1.0) == []
    c.tick(2.0)
    assert [p["name"] for p in c.plan_for("h0", 2.0)["peers"]] == ["h1"]
    with pytest.raises(CoordinatorError, match="no fabric model"):
        c.links()
    store.close()


def snapshot(c: Coordinator) -> tuple:
    """Everything a request could change, in memory and in the store."""
    return ({k: (r.state, r.reason, r.hops, r.updated) for k, r in c.paths.items()},
            {n: (a.agent_id, a.info, a.last_seen, a.lost) for n, a in c.agents.items()},
            sorted(map(str, c.store.paths())), sorted(map(str, c.store.agents().items())),
            len(c.store.events(limit=10**6)),
            {n: set(v) for n, v in c.by_reporter.items() if v})


def test_a_refused_request_changes_nothing(coord):
    """A bad path halfway through `paths` is refused before the good ones before it are taken."""
    before = snapshot(coord)
    good = dict(table_of(0)[0], state="down", reason="hard_failure")
    for call, body in ((coord.report, {"name": "h0", "paths": [good, dict(good, id=77, hops=["198.18.64.0", "x"])]}),
                       (coord.register, {**identity(0), "paths": [good, dict(good, id=78, sport=70000)]}),
                       (coord.report, {"name": "h0", "changes": [{"id": 1, "state": "down"}, {"id": 2, "state": "?"}]}),
                       (coord.report, {"name": "h0", "changes": [{"id": 1, "state": "down"}], "paths": 5})):
        with pytest.raises(CoordinatorError, match=r"paths\[1\]|changes\[1\]|paths: expected a list"):
            call(body, 1001.0)
        assert snapshot(coord) == before, body


@pytest.mark.parametrize("body,field", [
    ({**identity(0), "agent_id": 2**70, "paths": []}, "agent_id: expected an integer 1..4294967295"),
    ({**identity(0), "agent_id": 0, "paths": []}, "agent_id"),
    ({**identity(0), "service": "not-an-address", "paths": []}, "service: expected an IP address"),
    ({**identity(0), "nics": {"0": "198.18.64.300"}, "paths": []}, "nics.0: expected an IP address"),
    ({**identity(0), "api_port": 70000, "paths": []}, "api_port"),
    ({**identity(0), "name": "h0/../h1", "paths": []}, "name: expected a host name"),
    ({**identity(0), "version": "v" * 5000, "paths": []}, "version: expected a string of at most"),
    ({**identity(0), "paths": [dict(table_of(0)[0]), dict(table_of(0)[0])]}, r"paths\[1\]\.id: 1 appears twice"),
    ({**identity(0), "paths": [dict(table_of(0)[0], plane=-1)]}, r"paths\[0\]\.plane"),
    ({**identity(0), "paths": [dict(table_of(0)[0], peer_addr="h1")]}, r"paths\[0\]\.peer_addr: expected an IP"),
    ({**identity(0), "paths": [dict(table_of(0)[0], id=2**40)]}, r"paths\[0\]\.id"),
    ({**identity(0), "paths": [dict(table_of(0)[0], hops=["198.18.64.0"] * 100)]}, r"paths\[0\]\.hops: .*at most"),
    ({**identity(0), "paths": [], "drain_version": "3"}, "drain_version"),
    ({**identity(0), "paths": [], "probe_budget": {"pps": -5, "idle_interval_ms": 100}},
     r"probe_budget\.pps: expected a number"),
    ({**identity(0), "paths": [], "probe_budget": {"pps": 1000}}, r"probe_budget\.idle_interval_ms: required"),
])
def test_every_registration_field_is_checked(coord, body, field):
    before = snapshot(coord)
    with pytest.raises(CoordinatorError, match=field):
        coord.register(body, 1001.0)
    assert snapshot(coord) == before


@pytest.mark.parametrize("body,field", [
    ({"name": "h0", "changes": 5}, "changes: expected a list"),
    ({"name": "h0", "changes": [5]}, r"changes\[0\]: expected a JSON object"),
    ({"name": "h0", "changes": [{"id": 2**70, "state": "up"}]}, r"changes\[0\]\.id"),
    ({"name": "h0", "changes": [{"id": 1, "state": "up", "reason": "r" * 1000}]}, r"changes\[0\]\.reason"),
    ({"name": "h0", "plan_version": -1}, "plan_version"),
    ({"name": 7}, "name: expected a string"),
    ({"name": "h0", "probe_budget": {"pps": 1e12, "idle_interval_ms": 100}}, r"probe_budget\.pps"),
    ({"name": "h0", "probe_budget": "lots"}, "probe_budget: expected a JSON object"),
])
def test_every_report_field_is_checked(coord, body, field):
    before = snapshot(coord)
    with pytest.raises(CoordinatorError, match=field):
        coord.report(body, 1001.0)
    assert snapshot(coord) == before


@pytest.mark.parametrize("query,field", [
    ({"limit": "nan"}, "limit"), ({"limit": "inf"}, "limit"), ({"limit": "-1"}, "limit"), ({"limit": "0"}, "limit"),
    ({"limit": "10001"}, "limit: expected 1..10000"), ({"after": "1e30"}, "after"), ({"after": "-3"}, "after"),
    ({"after": str(2**70)}, "after"), ({"since": "nan"}, "since"), ({"since": "-inf"}, "since"),
    ({"since": "1e400"}, "since"), ({"kind": "drain,bogus"}, "kind: 'bogus' is not an event kind"),
])
def test_events_queries_are_checked(query, field):
    from linkpass.control.bodies import parse_events_query
    from linkpass.coordinator.store import EVENT_KINDS

    with pytest.raises(CoordinatorError, match=field):
        parse_events_query(query, EVENT_KINDS, 10_000)


def test_events_query_defaults_and_cap():
    from linkpass.control.bodies import parse_events_query
    from linkpass.coordinator.store import EVENT_KINDS

    q = parse_events_query({}, EVENT_KINDS, 500)
    assert (q.since, q.after_id, q.limit, q.kinds) == (0.0, 0, 500, ())
    assert parse_events_query({"limit": "500", "after": "12", "kind": "drain"}, EVENT_KINDS, 500).limit == 500


def test_decommission_forgets_an_agent_and_its_paths(coord, tmp_path):
    coord.tick(1001.0)
    fail_paths(coord, 1001.0, {"h3-p0l1:up", "h3-p0l1:down"})
    assert coord.relocalize(1001.0)  # h3's reports count in a finding
    dry = coord.decommission("h3", "host retired", "alice", 1002.0, dry_run=True)
    assert dry == {"host": "h3", "paths": 10, "was_lost": False, "dry_run": True, "changed": False}
    assert "h3" in coord.agents
    out = coord.decommission("h3", "host retired", "alice", 1002.0)
    assert out["changed"] and "h3" not in coord.agents and not coord.by_reporter.get("h3")
    assert not [k for k in coord.paths if k.startswith("h3/")]
    assert not [p for p in coord.store.paths() if p["reporter"] == "h3"] and "h3" not in coord.store.agents()
    ev = [e for e in coord.store.events() if e["kind"] == "agent" and e["subject"] == "h3"][-1]
    assert ev["actor"] == "alice" and ev["detail"]["what"] == "decommissioned"
    coord.tick(1003.0)
    assert "h3" not in [p["name"] for p in coord.plan_for("h0", 1003.0)["peers"]]
    with pytest.raises(NotFound, match="no agent named 'h3'"):
        coord.decommission("h3", "again", "alice", 1004.0)
    # a restarted coordinator does not bring it back
    c2 = Coordinator(Store(coord.store.path), MODEL, wall_s=1005.0)
    assert "h3" not in c2.agents and not [k for k in c2.paths if k.startswith("h3/")]
    c2.store.close()


def test_a_silent_agent_expires_and_the_fleet_is_healthy_again(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, CoordinatorConfig(agent_timeout_s=10, agent_expire_s=100), wall_s=0.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 0.0)
    # a name registered once and never heard from again (a spoofed or a dead host)
    c.register({**identity(0), "name": "ghost", "paths": []}, 0.0)
    for t in (50.0, 99.0, 101.0):
        for i in range(4):
            c.report({"name": f"h{i}"}, t)
        c.tick(t)
        assert c.status(t)["health"] == ("critical" if t < 100 else "ok"), t
    assert "ghost" not in c.agents and "ghost" not in store.agents()
    assert [e["detail"]["what"] for e in store.events() if e["subject"] == "ghost"] == ["registered", "lost", "expired"]
    store.close()


def test_path_churn_never_pushes_operators_actions_out_of_the_history(tmp_path):
    """Retention by count keeps the newest detections and recoveries and, apart, the newest of the
    rest: a flood of path changes after a drain leaves the drain and the refusals in the history."""
    store = Store(str(tmp_path / "c.db"))
    store.add_events([(1.0, "drain", "alice", "p0l0-p0s0", {}), (2.0, "refused", "mallory", "drain", {})])
    store.add_events([(3.0 + i, "detection" if i % 2 else "recovery", "h0", f"h0/{i % 7}", {}) for i in range(500)])
    store.prune_events(before_ts=0.0, keep=20)
    kept = store.events(limit=10**6)
    assert [e["kind"] for e in kept[:2]] == ["drain", "refused"]
    assert sum(e["kind"] in ("detection", "recovery") for e in kept) == 20 and len(kept) == 22
    store.close()


def test_events_are_kept_by_age_and_by_count(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    store.add_events([(float(t), "agent", "x", "h0", {"n": t}) for t in range(1000)])
    assert store.prune_events(before_ts=100.0, keep=10**6) == 100 and len(store.events(limit=10**6)) == 900
    assert store.prune_events(before_ts=0.0, keep=50) == 850
    assert [e["detail"]["n"] for e in store.events(limit=1000)] == list(range(950, 1000))
    # the coordinator prunes by its settings on its tick
    c = Coordinator(store, MODEL, CoordinatorConfig(event_retention_s=60, event_retention_count=20), wall_s=5000.0)
    store.add_events([(4900.0 + t, "agent", "x", "h0", {"n": t}) for t in range(100)])
    c.tick(5000.0)
    ts = [e["ts"] for e in store.events(limit=1000)]
    assert len(ts) <= 20 and min(ts) >= 4940.0
    store.close()

from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 70000) | st.integers() | st.floats() |
                     st.text(max_size=8) | st.sampled_from(["198.18.64.0", "::1", "h1", "up", "down"]),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)
# mostly well-formed paths with one field at a time going wrong, so deep checks are reached too
_path = st.fixed_dictionaries({"id": st.integers(1, 40), "peer": st.just("h1"), "plane": st.integers(0, 1),
                               "state": st.sampled_from(["up", "down"])},
                              optional={"hops": _json | st.lists(st.sampled_from(["198.18.64.0", "1.2.3.4"]) | _json),
                                        "peer_addr": _json, "sport": _json, "reason": _json}) | \
    st.fixed_dictionaries({}, optional={"id": _json, "peer": _json, "plane": _json, "state": _json, "hops": _json})


_nasty = st.sampled_from([2**70, -1, 0, 65536, float("nan"), float("inf"), 1e30, "", "x", "h0/../h1", "999.1.1.1",
                          [], {}, None, True, [[[[]]]], "r" * 300]) | _json
_good_path = st.builds(lambda row, state: dict(row, state=state), st.sampled_from(table_of(0)),
                       st.sampled_from(["up", "down", "degraded", "suspect"]))


@st.composite
def _mutated(draw):
    """A well-formed register or report of h0 with a few fields, anywhere in it, made wrong: the
    refusal then comes after the good part of the body, where a half-applied request shows."""
    kind = draw(st.sampled_from(["register", "report-paths", "report-changes"]))
    paths = draw(st.lists(_good_path, min_size=1, max_size=4, unique_by=lambda p: p["id"]))
    if kind == "register":
        body = {**identity(0), "paths": paths}
    elif kind == "report-paths":
        body = {"name": "h0", "paths": paths}
    else:
        body = {"name": "h0", "changes": [{"id": p["id"], "state": p["state"], "reason": None} for p in paths]}
    for _ in range(draw(st.integers(1, 2))):
        section = "changes" if kind == "report-changes" else "paths"
        where = draw(st.sampled_from(["top", "item"]))
        value = draw(_nasty)
        if where == "top":
            body[draw(st.sampled_from(sorted(body) + ["agent_id", "service", "api_port", "plan_version"]))] = value
        elif isinstance(body.get(section), list) and body[section]:
            item = body[section][draw(st.integers(0, len(body[section]) - 1))]
            if isinstance(item, dict) and item:
                item[draw(st.sampled_from(sorted(item)))] = value
    return kind, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_mutated())
def test_a_mutated_request_is_taken_whole_or_not_at_all(coord, case):
    kind, body = case
    call = coord.register if kind == "register" else coord.report
    before = snapshot(coord)
    try:
        call(body, 1001.0)
    except CoordinatorError:
        assert snapshot(coord) == before, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({"name": st.just("h0") | _json},
                                  optional={"changes": st.lists(_path, max_size=3) | _json,
                                            "paths": st.lists(_path, max_size=3) | _json,
                                            "agent_id": _json | st.integers(), "service": _json, "nics": _json,
                                            "api_port": _json, "version": _json, "drain_version": _json}))
@example(body={"name": "h0", "nics": {"²": None}})  # a Unicode digit str.isdigit() accepts and int() refuses
def test_garbage_reports_are_refused_cleanly(coord, body):
    """Whatever an agent (or an attacker with an agent token) sends: an answer or a
    CoordinatorError naming the problem, never another exception; a refused request changes
    nothing, and the coordinator goes on."""
    for call in (coord.report, coord.register):
        before = snapshot(coord)
        try:
            call(body, 1001.0)
        except CoordinatorError:
            assert snapshot(coord) == before
    coord.tick(1001.0)
    assert coord.status(1001.0)["agents"] >= 4


def _fleet_without_model(tmp_path, n: int):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, None, wall_s=0.0)
    for i in range(n):
        c.register(_ident(i), 0.0)
    c.tick(2.0)
    return c, store


def _ident(i: int, nic: str | None = None) -> dict:
    return {"name": f"h{i}", "agent_id": i + 1, "service": f"198.18.0.{i + 1}",
            "nics": {"0": nic or f"198.18.64.{i + 1}"}, "paths": []}


def test_plan_answers_after_a_change_carry_only_the_change(tmp_path):
    """Without a fabric model every agent probes every other: a join must not send each agent
    the whole fleet again (N agents x N peers per round), only the joiner."""
    c, store = _fleet_without_model(tmp_path, 50)
    held = {f"h{i}": c.report({"name": f"h{i}", "plan_deltas": True}, 2.0) for i in range(50)}
    assert all(len(a["plan"]["peers"]) == 49 for a in held.values())  # a first plan is whole
    c.register(_ident(50), 3.0)
    c.tick(5.0)
    for i in range(50):
        a = c.report({"name": f"h{i}", "plan_version": held[f"h{i}"]["plan_version"], "plan_deltas": True}, 5.0)
        assert "plan" not in a and a["plan_delta"]["from"] == held[f"h{i}"]["plan_version"]
        assert [p["name"] for p in a["plan_delta"]["peers"]] == ["h50"] and a["plan_delta"]["remove"] == []
    v = c.plan_version
    c.decommission("h7", "gone", "alice", 6.0)
    c.register(_ident(3, nic="198.18.65.4"), 6.0)  # h3's NIC changed: its peers must hear of it
    c.tick(8.0)
    d = c.report({"name": "h0", "plan_version": v, "plan_deltas": True}, 8.0)["plan_delta"]
    assert d["remove"] == ["h7"] and [(p["name"], p["nics"]) for p in d["peers"]] == [("h3", {"0": "198.18.65.4"})]
    # an agent that does not take deltas, or holds a version too old or unknown, gets it whole
    assert len(c.report({"name": "h0", "plan_version": v}, 8.0)["plan"]["peers"]) == 49
    assert len(c.report({"name": "h0", "plan_version": 0, "plan_deltas": True}, 8.0)["plan"]["peers"]) == 49
    store.close()


@pytest.mark.parametrize("seed", range(8))
def test_an_agent_applying_deltas_holds_the_coordinators_plan(tmp_path, seed):
    """The agent's side (CoordinatorLink) applies each answer to the plan it holds; after any
    sequence of joins, leaves, returns and address changes it probes exactly the peers the
    coordinator's whole plan names, with their current addresses."""
    import random

    from linkpass.control.answers import AnswerRules
    from linkpass.agent.config import CoordinatorLinkConfig
    from linkpass.agent.coordinator_link import CoordinatorLink

    token = tmp_path / "t"
    token.write_text("lpa1.h0.x\n")
    got = []
    link = CoordinatorLink(CoordinatorLinkConfig("http://127.0.0.1:9", str(token), insecure_http=True),
                           lambda: {"name": "h0"}, lambda: [], lambda d: None, got.append, lambda *a, **k: None,
                           rules=AnswerRules("h0", 1, 1024))

    def peers(plan) -> dict:  # the agent's typed plan, as the coordinator's documents name peers
        return {p.name: {"name": p.name, "agent_id": p.agent_id, "service": p.service,
                         "nics": {str(k): v for k, v in p.nics.items()}} for p in plan.peers}
    c, store = _fleet_without_model(tmp_path, 20)
    rng = random.Random(seed)
    now, present = 2.0, set(range(20))
    link._answer(c.report({"name": "h0", "plan_deltas": True}, now))
    for step in range(60):
        i = rng.randrange(1, 30)
        if i in present and rng.random() < 0.4:
            c.decommission(f"h{i}", "test", "alice", now)
            present.discard(i)
        else:
            c.register(_ident(i, nic=f"198.18.{64 + rng.randrange(3)}.{i + 1}"), now)
            present.add(i)
        now += 1.5
        c.tick(now)
        if rng.random() < 0.7:  # some answers are missed: the next delta spans several versions
            link._answer(c.report({**link._versions(), "name": "h0"}, now))
    now += 1.5
    c.tick(now)
    link._answer(c.report({**link._versions(), "name": "h0"}, now))
    want = {p["name"]: p for p in c.plan_for("h0", now)["peers"]}
    assert peers(got[-1]) == want
    assert link.plan_version == c.plan_version
    # a delta that does not start where the agent is, is dropped and the whole plan asked for
    link._answer({"plan_version": 999, "drain_version": 0, "plan_delta": {"from": 3, "version": 999, "peers": [],
                                                                        "remove": ["h1"]}})
    assert link.plan_version is None and set(peers(got[-1])) == set(want)
    assert link.stats["plan_deltas_dropped"] == 1
    link.client.close()
    store.close()


@pytest.mark.parametrize("settings,words", [
    ({"retention_days": 3}, "settings.retention_days: not a coordinator setting"),
    ({"event_retention_s": -1}, "settings.event_retention_s: expected a number"),
    ({"event_retention_count": 1.5}, "settings.event_retention_count: expected an integer"),
    ({"max_body_bytes": float("inf")}, "settings.max_body_bytes"),
    ({"max_connections": True}, "settings.max_connections"),
    ({"agent_timeout_s": 60, "agent_expire_s": 30}, "settings.agent_expire_s: 30 s must be longer than agent_timeout_s"),
    ({"state_dir": "state"}, "settings.state_dir: 'state' is not an absolute path"),
    ({"fabric": "./fabric.json"}, r"settings.fabric: './fabric.json' is not an absolute path"),
    ({"tls_key_file": "tls/c.key"}, "settings.tls_key_file: 'tls/c.key' is not an absolute path"),
    ({"store": "postgresql://lp@db/lp", "store_password_file": "pw"}, "settings.store_password_file: 'pw' is not"),
])
def test_coordinator_settings_are_checked_by_name(settings, words):
    from linkpass.coordinator.startup import check_settings

    with pytest.raises(CoordinatorError, match=words):
        check_settings(settings)


def test_coordinator_settings_reach_the_coordinator_and_the_endpoint():
    from linkpass.coordinator.startup import check_settings

    config, limits = check_settings({"event_retention_s": 3600, "event_retention_count": 500, "agent_expire_s": 600,
                                     "max_body_bytes": 65536, "read_timeout_s": 2, "state_dir": "/x"})
    assert (config.event_retention_s, config.event_retention_count, config.agent_expire_s) == (3600.0, 500, 600.0)
    assert (limits.max_body_bytes, limits.read_timeout_s) == (65536, 2.0)


def test_digests_are_answered_only_to_agents_that_take_them_and_a_mismatch_asks_for_the_table(tmp_path):
    from linkpass.core.report_digest import table_digest

    coord = Coordinator(Store(str(tmp_path / "c.db")), MODEL, wall_s=1000.0)
    coord.register({**identity(1), "paths": table_of(1)}, 1000.0)
    rows = [(r["id"], r["state"], r["reason"]) for r in table_of(1)]
    old = coord.report({"name": "h1", "digest": table_digest(rows)}, 1001.0)  # an agent that does not say it takes them
    assert "digests" not in old and "send_paths" not in old
    same = coord.report({"name": "h1", "digests": True, "digest": table_digest(reversed(rows))}, 1002.0)
    assert same["digests"] is True and "send_paths" not in same
    rows[0] = (rows[0][0], "down", "hard_failure")  # the agent's verdict the coordinator never heard
    off = coord.report({"name": "h1", "digests": True, "digest": table_digest(rows)}, 1003.0)
    assert off["send_paths"] is True and coord.counters["digest_mismatches"] == 1
    # with the change reported, the digest matches again
    ok = coord.report({"name": "h1", "digests": True, "changes": [{"id": rows[0][0], "state": "down",
                                                                   "reason": "hard_failure"}],
                       "digest": table_digest(rows)}, 1004.0)
    assert "send_paths" not in ok
    # a change of a path the coordinator does not hold: the table at once, not at the next summary
    unknown = coord.report({"name": "h1", "digests": True, "changes": [{"id": 999, "state": "up", "reason": None}]},
                           1005.0)
    assert unknown["send_paths"] is True
    for bad in ("ABC", "0" * 31, 7, "g" * 32):
        with pytest.raises(CoordinatorError, match="digest: expected 32 lowercase hex"):
            coord.report({"name": "h1", "digests": True, "digest": bad}, 1006.0)


def test_a_three_tier_fleet_maps_5_router_paths_and_localizes_a_core_link(tmp_path):
    from linkpass.core.fabric import three_tier
    from linkpass.core.plan import plan_probes

    model = three_tier(16, 1, 2, 2, 2, 2, addressed=True)  # 8 leaves, 4 pods, 4 cores
    plan = plan_probes(model, full_mesh_max=4)
    store = Store(str(tmp_path / "c.db"))
    try:
        c = Coordinator(store, model, CoordinatorConfig(), wall_s=1000.0)
        for i, host in enumerate(model.hosts):
            rows = []
            for pid, p in enumerate(plan.paths[host], 1):
                hops, addr = model.hops_of(host, p.peer, p.plane, p.spine, p.core)
                rows.append({"id": pid, "peer": p.peer, "plane": p.plane, "sport": 49152 + pid, "hops": hops,
                             "peer_addr": addr, "state": "up", "reason": None})
            nic = model.uplink(host, 0).a_addr
            c.register({"name": host, "agent_id": i + 1, "service": nic, "nics": {"0": nic}, "version": "test",
                        "paths": rows}, 1000.0)
        assert c.counters["paths_unmapped"] == 0
        between = [r for r in c.paths.values() if len(r.links) == 6]
        assert between and all(":up" in r.links[2] and "-p0c" in r.links[2] for r in between)
        target = next(r.links[2] for r in between)  # a spine -> core link some probes climb
        changes: dict[str, list] = {}
        for k, rec in c.paths.items():
            if target in rec.links:
                changes.setdefault(rec.reporter, []).append(
                    {"id": int(k.split("/")[1]), "state": "degraded", "reason": "gray_loss_fwd"})
        assert len(changes) >= 2
        for name, ch in changes.items():
            c.report({"name": name, "changes": ch}, 1001.0)
        found = c.relocalize(1001.0)
        assert [f["directed"] for f in found] == [target], found
    finally:
        store.close()


def test_a_running_digest_is_the_digest_of_its_rows_whatever_the_order_of_changes():
    """RunningDigest (kept by shards and, as sums, by the coordinator) equals the digest of its
    rows made from scratch after any sequence of changes, and digest_after foretells it exactly,
    a repeated id in one report included."""
    import random

    from linkpass.core.report_digest import RunningDigest, table_digest

    rng = random.Random(11)
    states = ["up", "down", "suspect", "degraded"]
    rows = {i: (rng.choice(states), rng.choice([None, "loss", "hard_failure"])) for i in range(200)}
    d = RunningDigest((i, s, r) for i, (s, r) in rows.items())
    assert d.digest() == table_digest((i, s, r) for i, (s, r) in reversed(list(rows.items())))
    for _ in range(300):
        changes = [(rng.randrange(200), rng.choice(states), rng.choice([None, "loss"])) for _ in range(rng.randrange(1, 5))]
        foretold = d.digest_after(changes)
        for pid, s, r in changes:
            d.set(pid, s, r)
            rows[pid] = (s, r)
        assert d.digest() == foretold == table_digest((i, s, r) for i, (s, r) in rows.items())
    assert d.digest() != table_digest((i, s, r) for i, (s, r) in list(rows.items())[1:])  # a row less: another


def test_one_reporter_s_flapping_table_reaches_the_history_in_a_bounded_number_of_events(tmp_path):
    """A reporter's detections and recoveries are written one by one up to the window's budget,
    the rest as one summary when the window ends; another reporter's are not held back, and every
    path's state is current all the same."""
    from linkpass.coordinator import coordinator as C
    from support.fleet import four_agents_registered

    c, store = four_agents_registered(str(tmp_path / "c.db"))
    try:
        t = 1001.0
        for rnd in range(5):  # 5 x 10 paths down, then up: 100 changes from h0 in one window
            for state in ("down", "up"):
                c.report({"name": "h0", "changes": [{"id": r["id"], "state": state, "reason": None}
                                                    for r in table_of(0)]}, t)
                t += 0.1
        c.report({"name": "h1", "changes": [{"id": 1, "state": "down", "reason": "loss"}]}, t)
        assert c.paths["h0/1"].state == "up" and c.paths["h1/1"].state == "down"
        ev = store.events(kinds=["detection", "recovery"], limit=10_000)
        assert sum(e["actor"] == "h0" for e in ev) == C.DETECTION_EVENTS_PER_WINDOW
        assert sum(e["actor"] == "h1" for e in ev) == 1
        c.tick(t + C.DETECTION_WINDOW_S)
        summary = [e for e in store.events(kinds=["detection"], limit=10_000) if e["detail"].get("summary")]
        assert len(summary) == 1 and summary[0]["actor"] == "h0"
        d = summary[0]["detail"]
        assert d["detections"] + d["recoveries"] == 100 - C.DETECTION_EVENTS_PER_WINDOW
    finally:
        store.close()

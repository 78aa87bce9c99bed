"""The whole loop on the testbed: real `linkpass agent` daemons on all four hosts report to the
coordinator running as a real Ray actor; injected faults are localized to the right link (and
direction where the evidence can tell); a drain moves the routes of every affected host and an
undrain restores them; with the coordinator gone, agents still fail over and resynchronize when
it returns.

Agents probe every 10 ms here (not 1 ms): four agents at 1 kHz plus the software fabric would
saturate this 2-core machine. Timing is the benchmarks' business; this checks behaviour.
"""
from __future__ import annotations

import time

import pytest

from linkpass.coordinator import ray_actor
from linkpass.control.client import Client
from linkpass.control.tls import lab_dir
from linkpass.testbed import faults
from linkpass.testbed.agents import Agents
from linkpass.testbed.faults import FaultSpec

from support.coordinator import coordinator_client, coordinator_on_testbed
from support.ports import free_port
from support.testbed import routes_of
from support.waiting import wait_until

HOSTS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def fleet(fabric, tmp_path_factory):
    faults.clear(fabric.prefix)
    d = tmp_path_factory.mktemp("fleet")
    settings, link = coordinator_on_testbed(fabric, str(d / "state"), free_port())
    ray_actor.connect(num_cpus=2)
    agents = None
    try:
        ray_actor.ensure(settings)
        url = link["url"]
        agents = Agents(fabric, str(d / "agents"), HOSTS, interval_ms=10.0, coordinator=link,
                        detect={"flap_half_life_ms": 2000}, tls_dir=lab_dir(settings["state_dir"]))
        agents.start()
        tokens = {r: (d / "state" / f"{r}.token").read_text().strip() for r in ("reader", "operator")}
        yield fabric, agents, settings, url, tokens
    finally:
        codes = agents.stop() if agents is not None else {}
        faults.clear(fabric.prefix)
        if agents is not None:
            agents.remove_routes()  # the shared fabric's other tests expect hosts without LinkPass routes
        h = ray_actor.existing()
        if h is not None:
            ray_actor.stop(h)
        ray_actor.shutdown()
        assert all(c == 0 for c in codes.values()), codes


def client(fleet, role="reader") -> Client:
    return coordinator_client(fleet[3], fleet[4][role], fleet[2]["state_dir"], client_cert="cli")


def healthy(fleet) -> None:
    fab, agents = fleet[0], fleet[1]
    assert agents.wait_healthy(timeout_s=60), agents.not_up()
    c = client(fleet)
    wait_until(lambda: (lambda s: s["paths"] == 40 and s["paths_by_state"].get("up") == 40 and not s["findings"])(
        c.get("/v1/status")), 60, "the coordinator to see 40 healthy paths and no findings",
        lambda: c.get("/v1/status"))
    for h in HOSTS:
        wait_until(lambda h=h: set(routes_of(fab, h).values()) == {(0, 1)}, 30, f"h{h} routes on both planes")
    c.close()


def test_agents_register_and_report(fleet):
    healthy(fleet)
    c = client(fleet)
    agents = c.get("/v1/agents")
    assert [a["name"] for a in agents] == ["h0", "h1", "h2", "h3"] and all(a["paths"] == 10 for a in agents)
    rows = c.get("/v1/paths", host="h0", peer="h3")
    assert len(rows) == 4 and all(len(r["links"]) == 4 for r in rows)  # every hop mapped onto a fabric link
    assert all(r["health"] == "ok" for r in c.get("/v1/links"))  # the full mesh watches every link both ways
    c.close()


def test_uplink_cut_is_localized_to_that_link(fleet):
    healthy(fleet)
    fab = fleet[0]
    c = client(fleet)
    faults.apply(fab.prefix, FaultSpec("down", "h1-p0l0"))
    try:
        st = wait_until(lambda: (lambda s: s if s["findings"] else None)(c.get("/v1/status")), 30,
                        "a localized fault", lambda: c.get("/v1/status"))
        assert {f["link"] for f in st["findings"]} == {"h1-p0l0"}, st["findings"]
        assert st["health"] == "critical"
        ev = c.get("/v1/events", kind="localization")
        assert ev and ev[-1]["subject"].startswith("h1-p0l0:")
    finally:
        faults.clear(fab.prefix)
    wait_until(lambda: not c.get("/v1/status")["findings"], 60, "the finding to clear",
               lambda: (c.get("/v1/status")["findings"], fleet[1].not_up()))
    assert c.get("/v1/events", kind="cleared")
    c.close()


def test_one_direction_loss_is_localized_with_its_direction(fleet):
    healthy(fleet)
    fab = fleet[0]
    c = client(fleet)
    # 30 % loss on what leaves spine p1s0 towards leaf p1l1 only
    faults.apply(fab.prefix, FaultSpec("loss", "p1l1-p1s0", direction="p1s0", params={"pct": 30}))
    seen = []  # each distinct list of findings, for the failure message

    def named() -> bool:
        fs = c.get("/v1/status")["findings"]
        if not seen or seen[-1] != fs:
            seen.append(fs)
        # two leaves per plane: leaf p1l0 -> spine p1s0 is crossed by the very same probes, so the
        # coordinator may name either, but must then list the other as the alternative
        return bool(fs) and "p1l1-p1s0:down" in {fs[0]["directed"], *fs[0].get("alternatives", [])}

    try:
        # hard failures (runs of misses) carry no direction and may come first; the direction
        # settles as the agents' per-direction loss verdicts arrive (docs/coordinator.md)
        wait_until(named, 60, "the most confident finding to name p1l1-p1s0:down", lambda: seen[-6:])
    finally:
        faults.clear(fab.prefix)
    wait_until(lambda: not c.get("/v1/status")["findings"], 60, "the finding to clear",
               lambda: (c.get("/v1/status")["findings"], fleet[1].not_up()))
    c.close()


def test_drain_moves_every_affected_host_and_undrain_restores(fleet):
    healthy(fleet)
    fab = fleet[0]
    op = client(fleet, "operator")
    h3 = fab.service_addr(3)
    out = op.post("/v1/drain", {"link": "h3-p1l1", "reason": "test: replace optic", "dry_run": True})
    assert out["impact"]["hosts"] == ["h0", "h1", "h2", "h3"] and not out["impact"]["stranded"]
    op.post("/v1/drain", {"link": "h3-p1l1", "reason": "test: replace optic"})
    try:
        for h in (0, 1, 2):  # everyone's route to h3 leaves plane 1 ...
            wait_until(lambda h=h: routes_of(fab, h).get(h3) == (0,), 10, f"h{h}'s route to h3 on plane 0 only",
                       lambda h=h: routes_of(fab, h))
        # ... and h3's routes to everyone too; routes to others are untouched
        wait_until(lambda: set(routes_of(fab, 3).values()) == {(0,)}, 10, "h3's routes on plane 0 only",
                   lambda: routes_of(fab, 3))
        assert routes_of(fab, 0).get(fab.service_addr(1)) == (0, 1)
        # drained paths are still probed and healthy (the link itself is fine)
        assert all(s in ("up", "suspect") for s in fleet[1].path_states(0).values())
    finally:
        op.post("/v1/undrain", {"link": "h3-p1l1"})
    for h in HOSTS:
        wait_until(lambda h=h: set(routes_of(fab, h).values()) == {(0, 1)}, 10, f"h{h} back on both planes")
    kinds = [e["kind"] for e in op.get("/v1/events", kind="drain,undrain")]
    assert kinds[-2:] == ["drain", "undrain"]
    op.close()


def test_coordinator_gone_agents_fail_over_alone_and_resync(fleet):
    healthy(fleet)
    fab, agents, settings = fleet[0], fleet[1], fleet[2]
    # the whole coordinator goes: the actor and the Ray instance under it
    ray_actor.stop(ray_actor.existing())
    ray_actor.shutdown()
    for h in HOSTS:
        agents.wait_for(h, "coordinator_unreachable", timeout_s=15)
    t0 = time.time()
    faults.apply(fab.prefix, FaultSpec("down", "h0-p1l0"))
    try:
        # local failover: h2's route to h0 leaves plane 1 without any coordinator
        wait_until(lambda: routes_of(fab, 2).get(fab.service_addr(0)) == (0,), 10, "h2 to reroute alone")
        changed = agents.wait_for(2, "route_change", lambda e: e["ts"] >= t0 and e["peer"] == "h0", timeout_s=5)
        assert changed is not None
        registrations = {h: len(agents.events(h, "coordinator_registered")) for h in HOSTS}
        ray_actor.connect(num_cpus=2)
        ray_actor.ensure(settings)  # back (a new Ray, a new actor), with the same database
        for h in HOSTS:
            wait_until(lambda h=h: len(agents.events(h, "coordinator_registered")) > registrations[h], 30,
                       f"h{h} to register again")
        c = client(fleet)
        st = wait_until(lambda: (lambda s: s if s["findings"] else None)(c.get("/v1/status")), 30,
                        "the fault the agents saw while it was away", lambda: c.get("/v1/status"))
        assert {f["link"] for f in st["findings"]} == {"h0-p1l0"}
        c.close()
    finally:
        faults.clear(fab.prefix)

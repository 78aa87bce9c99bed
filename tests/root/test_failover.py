"""Detection and failover end to end: real `linkpass agent` daemons on h0 and h2 of the testbed,
real faults, the kernel's routes and the entropy table read back.

Each fault kind is detected with the right reason (and direction), routed around, and the path
returns once the fault clears and the hold-down passes; the entropy table follows single paths;
the last path is never removed. (SIGKILL and --dry-run: test_failover_lifecycle.py. Timings are
the benchmark's business: bench/failover.py.)
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from linkpass.core import entropy_table
from linkpass_rdma import entropy
from linkpass.testbed import faults, traffic
from linkpass.testbed.agents import Agents
from linkpass.testbed.faults import FaultSpec

from support.testbed import A, B, routes_of
from support.waiting import wait_until


def _recovered(fabric, agents):
    """Both planes back in A's route once the fault is gone (hold-down, or flap damping fading)."""
    wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1), 30, "both planes again",
               lambda: {"routes": routes_of(fabric, A), "states": {h: agents.path_states(h) for h in (A, B)},
                        "recent": agents.events(A, "path_state")[-6:]})


@pytest.fixture(scope="module")
def agents(fabric, tmp_path_factory):
    faults.clear(fabric.prefix)
    # flap penalties fade in seconds here, so one test's faults do not keep paths damped in the next
    ag = Agents(fabric, str(tmp_path_factory.mktemp("agents")), [A, B], detect={"flap_half_life_ms": 2000}).start()
    time.sleep(2)  # past start-up: every path answered, RTT learned
    try:
        yield ag
    finally:
        codes = ag.stop()
        faults.clear(fabric.prefix)
        assert codes == {A: 0, B: 0}, codes
        # a clean stop leaves the routes as decided: every peer keeps at least one plane
        assert all(routes_of(fabric, A).values()), routes_of(fabric, A)


def settle(fabric, agents):
    """Each test starts from a healthy fabric: every path up at both ends, both routes on both
    planes (a previous test's fault may still be in its hold-down or flap damping)."""
    assert agents.wait_healthy(timeout_s=40), {h: agents.path_states(h) for h in (A, B)}
    wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1)
               and routes_of(fabric, B).get(fabric.service_addr(A)) == (0, 1), 20, "both routes on both planes")


def _transitions_since(ag, host, t0, **match):
    return [e for e in ag.events(host, "path_state")
            if e["mono_ns"] >= t0 and all(e.get(k) == v for k, v in match.items())]


def _logged_since(ag, host, t0, enough, timeout_s=5.0, **match):
    """The transitions since t0 once `enough(them)` holds: the agent changes routes first and
    logs after, so a route already moved can be read before its line is written."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = _transitions_since(ag, host, t0, **match)
        if enough(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


# ---- every fault kind ---------------------------------------------------------------------------

GRAY = [
    # (fault, reasons accepted at A for its paths to B)
    (FaultSpec("loss", f"h{A}-p0l0", params={"pct": 5.0}), {"gray_loss_fwd", "gray_loss_rev"}),
    (FaultSpec("loss", f"h{A}-p0l0", f"h{A}", {"pct": 10.0}), {"gray_loss_fwd"}),  # leaving A: forward for A
    (FaultSpec("loss", f"h{A}-p0l0", "p0l0", {"pct": 10.0}), {"gray_loss_rev"}),  # towards A: A's replies
    (FaultSpec("mtu", f"h{A}-p0l0", params={"bytes": 1400}), {"mtu_blackhole"}),
    # a 4 Mbit/s bottleneck leaving A, filled by probes plus a 2.4 Mbit/s flow: queueing and drops
    (FaultSpec("congest", f"h{A}-p0l0", f"h{A}", {"rate": "4mbit", "queue": "20ms"}),
     {"latency_fwd", "gray_loss_fwd"}),
]


@pytest.mark.parametrize("spec,reasons", GRAY, ids=["loss", "loss-from-a", "loss-to-a", "mtu", "congest"])
def test_gray_fault_is_detected_with_its_reason_routed_around_and_recovered(fabric, agents, spec, reasons):
    settle(fabric, agents)
    t0 = time.monotonic_ns()
    faults.apply(fabric.prefix, spec)
    load = None
    if spec.kind == "congest":
        load = threading.Thread(target=traffic.send_flow, args=(fabric, A, B),
                                kwargs=dict(plane=0, dport=9, count=1500, size=1200, interval_s=0.004))
        load.start()
    try:
        ev = agents.wait_for(A, "path_state", lambda e: e["mono_ns"] >= t0 and e["new"] == "degraded"
                             and e["peer"] == f"h{B}", timeout_s=10)
        assert ev is not None, f"no DEGRADED at h{A}: {_transitions_since(agents, A, t0)}"
        assert ev["reason"] in reasons and ev["plane"] == 0, ev
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (1,), 3, "h0's route to leave plane 0")
    finally:
        if load is not None:
            load.join()
        faults.clear(fabric.prefix)
    wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1), 30,
               "h0's route to use both planes again after the fault cleared")
    # the agent changes the route first and logs the transition after it: wait for the line
    back = _logged_since(agents, A, t0, bool, new="up", reason="recovered")
    assert back, ("recovery must go through the hold-down (RECOVERING -> UP)", _transitions_since(agents, A, t0))


def test_hard_failure_of_an_uplink_moves_routes_at_both_ends_and_the_entropy_table(fabric, agents):
    settle(fabric, agents)
    t0 = time.monotonic_ns()
    faults.apply(fabric.prefix, FaultSpec("down", f"h{A}-p0l0"))
    try:
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (1,), 2, "A's route off plane 0")
        wait_until(lambda: routes_of(fabric, B).get(fabric.service_addr(A)) == (1,), 3, "B's route off plane 0")
        downs = _logged_since(agents, A, t0, lambda ds: any(e["plane"] == 0 for e in ds), new="down",
                              reason="hard_failure")
        assert {e["plane"] for e in downs} >= {0}, downs
        # a plane-1 DOWN here can only be a burst of lateness on this loaded machine: undone as such
        wait_until(lambda: {e["path"] for e in downs if e["plane"] == 1}
                   <= {e["path"] for e in _transitions_since(agents, A, t0, reason="spurious_down")},
                   2, "any plane-1 DOWN undone as late, not lost", lambda: downs)
        # every plane-0 path to B is down: the entry keeps its ports, flagged fail-static
        table = entropy.read_table(f"{agents.directory}/entropy-h{A}")
        e0 = table.get(fabric.nic_addr(B, 0), 0)
        e1 = table.get(fabric.nic_addr(B, 1), 1)
        assert e0 is not None and e0.flags & entropy_table.ENTRY_FAIL_STATIC, e0
        assert e1 is not None and e1.ports and not e1.flags, e1
    finally:
        faults.clear(fabric.prefix)
    _recovered(fabric, agents)


def test_spine_link_failure_leaves_only_that_path_out_of_the_entropy_table(fabric, agents):
    settle(fabric, agents)
    t0 = time.monotonic_ns()
    faults.apply(fabric.prefix, FaultSpec("down", "p0l0-p0s0"))
    try:
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (1,), 2, "A's route off plane 0")
        downs = _logged_since(agents, A, t0, lambda ds: any(e["plane"] == 0 for e in ds), new="down")
        # on this loaded machine another path may read down for a few ms (a burst of lateness):
        # such DOWNs are undone as late, not lost; the one that lasts is the cut path's
        # (a DOWN is undone by a spurious_down of its path after it: the cut path may have had
        # one of those earlier in the window, before its real DOWN)
        def undone(e) -> bool:
            return any(u["path"] == e["path"] and u["ts"] >= e["ts"]
                       for u in _transitions_since(agents, A, t0, reason="spurious_down"))
        wait_until(lambda: all(undone(e) for e in downs if e["plane"] == 1), 2,
                   "any plane-1 DOWN undone as late, not lost", lambda: downs)
        lasting = [e for e in downs if not undone(e)]
        assert lasting and {e["plane"] for e in lasting} == {0} and len({e["sport"] for e in lasting}) == 1, downs
        # plane 0 still has its path through spine 1: the ports that cross it stay, the other goes
        e0 = entropy.read_table(f"{agents.directory}/entropy-h{A}").get(fabric.nic_addr(B, 0), 0)
        assert e0 is not None and not e0.flags and e0.ports and lasting[0]["sport"] not in e0.ports, (e0, downs)
    finally:
        faults.clear(fabric.prefix)
    _recovered(fabric, agents)


def test_the_last_path_is_never_removed(fabric, agents):
    """Random sets of dead links between A and B, some leaving no path at all: the route to B
    always keeps at least one plane, and uses only clean planes when there is one."""
    settle(fabric, agents)
    rng = random.Random(11)
    links = [f"h{A}-p0l0", f"h{A}-p1l0", "p0l0-p0s0", "p0l0-p0s1", "p1l0-p1s0", "p1l0-p1s1"]
    for _ in range(3):
        chosen = rng.sample(links, rng.randint(2, 4))
        t0 = time.monotonic_ns()
        for link in chosen:
            faults.apply(fabric.prefix, FaultSpec("down", link))
        try:
            time.sleep(0.5)
            planes = routes_of(fabric, A).get(fabric.service_addr(B))
            assert planes, f"route to h{B} gone with {chosen}"
            dead = {p for p in (0, 1) if f"h{A}-p{p}l0" in chosen
                    or {f"p{p}l0-p{p}s0", f"p{p}l0-p{p}s1"} <= set(chosen)}
            if len(dead) == 2:  # nothing left: fail static, said in the log
                assert agents.wait_for(A, "fail_static", lambda e: e["peer"] == f"h{B}", 2), chosen
        finally:
            faults.clear(fabric.prefix)
        assert _transitions_since(agents, A, t0)  # the faults were seen at all
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1), 25, "both planes again")
        time.sleep(2)  # let the flap penalty of these DOWNs fade below suppress

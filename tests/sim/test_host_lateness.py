"""A host kept waiting is not a failed link: the agent's decision code (Failover, the detector)
on the simulator's data path, with the reflecting host stalled again and again.

The stalls make replies on every path late together, by 3-25 ms: far past the timeout, so the
detector declares DOWNs; the late replies then undo them. The data path must not move for any
of it (no plane change, no entropy change), while a real cut in the middle of the same stalls
is still routed around, about one lateness allowance later.
"""
from __future__ import annotations

import numpy as np

from linkpass.core.decide import PathInfo
from linkpass.core.constants import PROBE_PORT_BASE
from linkpass.core.detector import DetectorConfig, State
from linkpass_sim.virtual import MS, Effect, Rtt, VirtualAgent, VirtualPath, peer_addr


LINKS = {(plane, spine): (f"up-{plane}-{spine}", f"down-{plane}-{spine}") for plane in (0, 1) for spine in (0, 1)}


def _agent(seed: int, effects_of) -> VirtualAgent:
    """h0's agent probing h2 on 2 planes x 2 spines every 1 ms; `effects_of(plane, spine)` gives
    the effects on that path's links."""
    rng = np.random.default_rng(seed)
    agent = VirtualAgent("h0", DetectorConfig(flap_half_life_ns=2_000 * MS), rng, MS, batch_phase_ns=3 * MS)
    pid = 0
    for (plane, spine), (fwd, rev) in LINKS.items():
        pid += 1
        vp = VirtualPath(PathInfo(pid, "h2", plane, PROBE_PORT_BASE + pid, peer_addr("h2", plane)), (fwd,), (rev,),
                         MS, int(rng.integers(0, MS)), 100, Rtt(8_000, 20_000), size_offset=pid * 7)
        vp.fwd_effects = list(effects_of(plane, spine))
        agent.add_path(vp)
    return agent


def _stalls(seed: int, start_ns: int, end_ns: int) -> list[Effect]:
    """Stalls of 3-25 ms every 100-600 ms; each reaches the four paths up to 2 ms apart (the
    scheduler does not stop every thread and softirq at the same instant)."""
    rng = np.random.default_rng(seed)
    out, t = [], start_ns
    while t < end_ns:
        t += int(rng.integers(100, 600)) * MS
        length = int(rng.integers(3, 26)) * MS
        out.append((t, length, [int(x) for x in rng.integers(0, 2 * MS, size=len(LINKS))]))
    return out


def _stall_effects(stalls, plane, spine):
    k = list(LINKS).index((plane, spine))
    return [Effect(frozenset(LINKS[(plane, spine)]), "stall", t + onset[k], t + onset[k] + length)
            for t, length, onset in stalls]


def test_replies_late_on_every_path_together_move_no_route_and_no_port():
    stalls = _stalls(1, 2_000 * MS, 30_000 * MS)
    agent = _agent(1, lambda plane, spine: _stall_effects(stalls, plane, spine))
    agent.run_until(30_000 * MS)
    downs = [t for t in agent.transitions if t.new is State.DOWN]
    undone = [t for t in agent.transitions if t.reason.value == "spurious_down"]
    assert len(downs) > 50, "the stalls should have made the detector declare DOWNs (else this tests nothing)"
    assert len(undone) >= 0.9 * len(downs)
    assert [planes for _, _, planes in agent.plane_log if planes != (0, 1)] == []
    assert not any(t.new in (State.DAMPED, State.DEGRADED) for t in agent.transitions)
    assert agent.failover.counters["route_changes"] == 0 and agent.failover.allowance_ns("h2") > 0


def test_a_real_cut_during_the_stalls_is_still_routed_around():
    cut_at = 15_000 * MS + 123_456
    stalls = _stalls(2, 2_000 * MS, 20_000 * MS)
    cut = Effect(frozenset(LINKS[(0, 0)] + LINKS[(0, 1)]), "down", cut_at, 20_000 * MS)  # plane 0's uplink

    def effects(plane, spine):
        return _stall_effects(stalls, plane, spine) + ([cut] if plane == 0 else [])

    agent = _agent(2, effects)
    agent.run_until(20_000 * MS)
    moved = [(t, planes) for t, _, planes in agent.plane_log if t >= cut_at]
    assert moved and moved[0][1] == (1,), agent.plane_log[-5:]
    allowance = agent.failover.allowance_ns("h2")
    assert 0 < allowance <= agent.failover.lateness_cap_ns
    # detected (a few ms), then held for at most the allowance (plus a probe interval to decide)
    assert moved[0][0] - cut_at <= 10 * MS + agent.failover.lateness_cap_ns
    assert not [p for t, p in moved[1:] if p != (1,)], "plane 0 came back while it was cut"


def test_a_real_cut_while_an_allowance_stands_is_routed_around_without_waiting_for_it():
    """The stalls have left an allowance of tens of ms; the cut comes between stalls. Its DOWN's
    round shows the path silent while the other plane answers on time, with no other path late
    or missing since the silence began: a stall is ruled out and the route moves a timeout after
    the confirmation, not an allowance later."""
    cut_at = 15_000 * MS + 246_912
    stalls = _stalls(2, 2_000 * MS, 20_000 * MS)
    cut = Effect(frozenset(LINKS[(0, 0)] + LINKS[(0, 1)]), "down", cut_at, 20_000 * MS)
    agent = _agent(2, lambda plane, spine: _stall_effects(stalls, plane, spine) + ([cut] if plane == 0 else []))
    agent.run_until(17_000 * MS)
    moved = [(t, planes) for t, _, planes in agent.plane_log if t >= cut_at]
    assert moved and moved[0][1] == (1,), agent.plane_log[-5:]
    assert agent.failover.allowance_ns("h2") > 20 * MS  # the stalls' allowance stands
    assert moved[0][0] - cut_at < 6 * MS, (moved[0][0] - cut_at) / MS


def test_on_a_calm_host_a_cut_moves_the_route_within_a_few_probe_intervals():
    """No stall ever: the allowance stays 0, and waiting for an on-time answer sent after the
    DOWN costs about one probe interval."""
    cut_at = 5_000 * MS + 321_000
    cut = Effect(frozenset(LINKS[(1, 0)] + LINKS[(1, 1)]), "down", cut_at, 6_000 * MS)
    agent = _agent(3, lambda plane, spine: [cut] if plane == 1 else [])
    agent.run_until(6_000 * MS)
    moved = [(t, planes) for t, _, planes in agent.plane_log if t >= cut_at]
    assert moved and moved[0][1] == (0,)
    assert agent.failover.allowance_ns("h2") == 0
    assert moved[0][0] - cut_at <= 6 * MS, (moved[0][0] - cut_at) / MS

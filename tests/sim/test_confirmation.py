"""Confirmation rounds, on virtual time with the real decision code (Failover, the detector) and
the simulator's copy of the C core's judging: each miss of a streak asks at once for a probe on
every path to that peer (a poll sequence: the streak's misses come a timeout apart), and the
DOWN-making miss's round, sent a host stall's spread after the silence began, confirms the DOWN
a round trip later, even when the peer's other paths are idle (probed every 100 ms). The rounds
are bounded per peer. (The C core's own rounds, on real sockets: tests/root/test_engine_robustness.py.)"""
from __future__ import annotations

import numpy as np

from linkpass.core.decide import PathInfo
from linkpass.core.constants import CONFIRM_BURST, CONFIRM_PER_PEER_PER_S, PROBE_PORT_BASE
from linkpass.core.detector import DetectorConfig, State
from linkpass_sim.virtual import MS, Effect, Rtt, VirtualAgent, VirtualPath, peer_addr


US = 1_000


def _agent(idle_ns: int, effects_of) -> VirtualAgent:
    """h0 probing h2 over 2 planes x 2 spines: plane 0's paths every 1 ms (active), plane 1's
    every `idle_ns`; `effects_of(plane, spine)` gives the effects on that path's links."""
    rng = np.random.default_rng(7)
    agent = VirtualAgent("h0", DetectorConfig(flap_half_life_ns=2_000 * MS), rng, MS, batch_phase_ns=3 * MS)
    pid = 0
    for plane in (0, 1):
        for spine in (0, 1):
            pid += 1
            links = (f"up-{plane}-{spine}",), (f"down-{plane}-{spine}",)
            vp = VirtualPath(PathInfo(pid, "h2", plane, PROBE_PORT_BASE + pid, peer_addr("h2", plane)), *links,
                             MS if plane == 0 else idle_ns, 100 * US * pid, 0, Rtt(8_000, 2_000))
            vp.fwd_effects = list(effects_of(plane, spine))
            agent.add_path(vp)
    return agent


def test_a_cut_is_detected_a_few_timeouts_after_it_and_routed_around_at_once_though_the_other_plane_is_idle():
    cut_at = 2_000 * MS + 123 * US
    cut = Effect(frozenset({"up-0-0", "up-0-1"}), "down", cut_at, 10_000 * MS)
    agent = _agent(100 * MS, lambda plane, spine: [cut] if plane == 0 else [])
    agent.run_until(2_500 * MS)
    down = min(t.at_ns for t in agent.transitions if t.new is State.DOWN and t.path in (1, 2))
    moved = [t for t, _, planes in agent.plane_log if t >= cut_at and planes == (1,)]
    assert moved, agent.plane_log
    # a round at each miss of the streak, on every path to h2 (the idle ones included): the three
    # misses a timeout (250 us) apart, not a probe interval (1 ms), so the DOWN comes within
    # ~1.3 ms of the cut; the DOWN's round goes out 1.5 ms after the silence began (the stall
    # spread) and its answers (a ~10 us round trip) are the evidence: no wait for plane 1's next
    # probe, up to 100 ms away
    assert agent.confirm["rounds"] >= 3 and agent.confirm["probes"] >= 12 and agent.confirm["refused"] == 0
    assert 0 < down - cut_at < 1_500 * US, (down - cut_at) / 1e6
    assert 0 < moved[0] - cut_at < 3 * MS, (moved[0] - cut_at) / 1e6


def test_rounds_are_bounded_per_peer_when_a_link_flaps_fast():
    """A link flapping every 8 ms for 2 s makes a DOWN-making miss a few dozen times; rounds
    beyond the budget (a burst, then a steady rate) are refused and counted, not sent."""
    flaps = [Effect(frozenset({"up-0-0"}), "down", 1_000 * MS + k * 8 * MS, 1_000 * MS + k * 8 * MS + 5 * MS)
             for k in range(250)]
    agent = _agent(100 * MS, lambda plane, spine: flaps if (plane, spine) == (0, 0) else [])
    agent.run_until(3_000 * MS)
    c = agent.confirm
    assert c["refused"] > 0
    assert c["rounds"] <= CONFIRM_BURST + CONFIRM_PER_PEER_PER_S * 2 + 1, c
    assert c["probes"] <= 4 * c["rounds"]

"""The pure detector: transition table, simulated probe streams, properties. No root, fast."""
from __future__ import annotations

import heapq
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.core.detector import (TRANSITIONS, Detector, DetectorConfig, Event, PathDetector, Reason,
                                    State, Transition)
from linkpass.core.states import Direction


MS = 1_000_000
US = 1_000
S = 1_000_000_000


# ---- a probe-stream simulator (seeded; the detector under test is the real one) ---------------

def _never(t: int) -> bool:
    return False


def _zero(t: int) -> float:
    return 0.0


@dataclass
class Link:
    """What the fabric does to probes sent at time t (ns)."""

    base_owd_ns: int = 15 * US
    jitter_ns: int = 10 * US  # mean of the exponential queueing noise, per direction
    dark: Callable[[int], bool] = _never
    loss_fwd: Callable[[int], float] = _zero
    loss_rev: Callable[[int], float] = _zero
    shift_fwd: Callable[[int], int] = lambda t: 0
    shift_rev: Callable[[int], int] = lambda t: 0
    size_lost: Callable[[int], bool] = _never  # full-size probes dropped (MTU black hole)


@dataclass
class Run:
    transitions: list[Transition] = field(default_factory=list)

    def first(self, pred: Callable[[Transition], bool]) -> Transition | None:
        return next((t for t in self.transitions if pred(t)), None)


def simulate(det: PathDetector, link: Link, duration_ns: int, rng: random.Random, *, start_ns: int = 0,
             interval_ns: int = MS, size_every: int = 0, seq0: int = 0) -> Run:
    """Send a probe every interval; deliver replies and loss batches the way the telemetry does
    (loss per direction exact at each new highest answered sequence); tick at every deadline."""
    run = Run()
    events: list[tuple[int, int, int, tuple]] = []  # (time, order, seq, payload)
    n = duration_ns // interval_ns
    lost_dir: dict[int, str] = {}
    for i in range(n):
        t = start_ns + i * interval_ns
        seq = seq0 + i
        size = bool(size_every) and i % size_every == size_every - 1
        heapq.heappush(events, (t, 0, seq, ("send", size)))
        if link.dark(t) or (size and link.size_lost(t)) or rng.random() < link.loss_fwd(t):
            lost_dir[seq] = "fwd"
            continue
        fwd = link.base_owd_ns + int(rng.expovariate(1 / link.jitter_ns)) + link.shift_fwd(t)
        if rng.random() < link.loss_rev(t):
            lost_dir[seq] = "rev"
            continue
        rev = link.base_owd_ns + int(rng.expovariate(1 / link.jitter_ns)) + link.shift_rev(t)
        heapq.heappush(events, (t + fwd + rev, 1, seq, ("reply", fwd + rev, fwd, rev)))
    hi = seq0 - 1
    while events:
        t, _, seq, payload = heapq.heappop(events)
        while (d := det.next_deadline_ns()) is not None and d <= t:
            run.transitions += det.tick(d)
        if payload[0] == "send":
            run.transitions += det.on_sent(seq, t, size_probe=payload[1])
        else:
            _, rtt, fwd, rev = payload
            run.transitions += det.on_reply(seq, t, rtt, fwd, rev)
            if seq > hi:
                span = range(hi + 1, seq + 1)
                lf = sum(1 for s in span if lost_dir.get(s) == "fwd")
                lr = sum(1 for s in span if lost_dir.get(s) == "rev")
                run.transitions += det.on_loss(hi + 1, seq, lf, lr, t)
                hi = seq
    end = start_ns + n * interval_ns
    while (d := det.next_deadline_ns()) is not None and d <= end:
        run.transitions += det.tick(d)
    return run


def warm(det: PathDetector, rng: random.Random, ms: int = 500) -> int:
    """A healthy stretch: RTT estimate and delay baseline learned. Returns the next start time."""
    simulate(det, Link(), ms * MS, rng)
    assert det.state is State.UP
    return ms * MS


SEEDS = range(7)


# ---- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("field_name,value", [
    ("miss_threshold", 0), ("miss_threshold", 2.5), ("timeout_floor_ns", 0), ("gray_p0", 0.0),
    ("gray_p1_fast", 0.0005), ("gray_alpha", 0.7), ("flap_reuse", 3000.0), ("latency_clip_mad", 1.0),
    ("initial_timeout_ns", 1), ("timeout_ceiling_ns", 10), ("hold_down_ns", -1), ("rtt_k", float("nan")),
])
def test_config_errors_name_the_field(field_name, value):
    with pytest.raises(ValueError, match=f"DetectorConfig.{field_name}"):
        DetectorConfig(**{field_name: value})


def test_default_config_is_valid():
    DetectorConfig()


# ---- the table ---------------------------------------------------------------------------------

def test_table_targets_and_functions_exist():
    for (state, event), (new, fn) in TRANSITIONS.items():
        assert callable(getattr(PathDetector, fn)), fn
        assert new is not state


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_fire_follows_the_table_and_ignores_the_rest(state, event):
    d = PathDetector("p")
    d.state = state
    out = d._fire(event, Reason.HARD_FAILURE, 123)
    if (state, event) in TRANSITIONS:
        new = TRANSITIONS[(state, event)][0]
        assert d.state is new and out == [Transition("p", state, new, event, Reason.HARD_FAILURE, 123, "")]
    else:
        assert d.state is state and out == []


def _scenarios() -> list[Transition]:
    """Drive real inputs through every kind of fault; return every transition seen."""
    seen: list[Transition] = []
    fast = DetectorConfig(hold_down_ns=50 * MS, recovery_good_probes=20, flap_half_life_ns=200 * MS)
    # hard failure, lone miss, recovery, flapping, damping, reuse (dark and live)
    rng = random.Random(1)
    d = PathDetector("a", fast)
    t = warm(d, rng)
    seen += simulate(d, Link(dark=lambda x: 100 * MS <= x - t < 101 * MS), 300 * MS, rng, start_ns=t,
                     seq0=10_000).transitions  # one lost probe: SUSPECT -> UP
    t += 300 * MS
    flaps = lambda x: (x - t) % (40 * MS) < 10 * MS and x - t < 200 * MS
    seen += simulate(d, Link(dark=flaps), 1000 * MS, rng, start_ns=t, seq0=20_000).transitions
    t += 1000 * MS
    # damped, then reused while dark -> DOWN
    seen += simulate(d, Link(dark=lambda x: (x - t) % (30 * MS) < 10 * MS), 150 * MS, rng, start_ns=t,
                     seq0=30_000).transitions
    t += 150 * MS
    seen += simulate(d, Link(dark=lambda x: True), 1500 * MS, rng, start_ns=t, seq0=40_000).transitions
    t += 1500 * MS
    seen += simulate(d, Link(), 300 * MS, rng, start_ns=t, seq0=50_000).transitions
    # gray loss from UP, DEGRADED -> DOWN, and gray/latency/MTU from RECOVERING and SUSPECT
    for kind in ("gray", "latency", "mtu"):
        rng = random.Random(2)
        d = PathDetector(kind, fast)
        t = warm(d, rng)
        link = {"gray": Link(loss_fwd=lambda x: 0.2),
                "latency": Link(shift_fwd=lambda x: 300 * US),
                "mtu": Link(size_lost=lambda x: True)}[kind]
        seen += simulate(d, link, 400 * MS, rng, start_ns=t, seq0=10_000, size_every=5).transitions
        t += 400 * MS
        seen += simulate(d, Link(dark=lambda x: True), 10 * MS, rng, start_ns=t, seq0=20_000).transitions
        t += 10 * MS
        # back up: into RECOVERING, then the fault again while recovering
        seen += simulate(d, Link(), 5 * MS, rng, start_ns=t, seq0=30_000).transitions
        t += 5 * MS
        seen += simulate(d, link, 400 * MS, rng, start_ns=t, seq0=40_000, size_every=5).transitions
        t += 400 * MS
        # fault from SUSPECT: a lost probe, and the verdict arrives before the next reply
        seen += simulate(d, Link(), 3000 * MS, rng, start_ns=t, seq0=50_000, size_every=5).transitions
        t += 3000 * MS
        assert d.state is State.UP, (kind, seen[-3:])
        seen += _suspect_then(d, kind, t)
    # a streak of late (not lost) replies: DOWN, then undone
    d = PathDetector("late")
    t = warm(d, random.Random(5))
    for k in range(3):
        seen += d.on_sent(60_000 + k, t + k * MS)
    seen += d.tick(t + 3 * MS)
    seen += d.on_reply(60_000, t + 3 * MS + 10 * US, 3 * MS + 10 * US)
    # ... and undone after an older probe's late reply took it to RECOVERING first
    t += 10 * MS
    for k in range(3):
        seen += d.on_sent(61_000 + k, t + k * MS)
    seen += d.tick(t + 20 * MS)  # the late reply above raised the timeout to a few ms
    seen += d.on_reply(60_999, t + 20 * MS + 5 * US, 21 * MS)
    seen += d.on_reply(61_000, t + 20 * MS + 10 * US, 20 * MS + 10 * US)
    seen += _spurious_from_recovering_and_damped()
    return seen


def _late_streak(d: PathDetector, seq0: int, t: int) -> list[Transition]:
    """Three probes judged missed at their deadlines, then the first one's reply, late."""
    out = []
    for k in range(3):
        out += d.on_miss(seq0 + k, t + k * MS + d.rto_ns)
    return out + d.on_reply(seq0, t + 3 * MS, 3 * MS)


def _spurious_from_recovering_and_damped() -> list[Transition]:
    """Spurious DOWNs that damp a path (from UP and from RECOVERING) and one from RECOVERING."""
    seen: list[Transition] = []
    touchy = DetectorConfig(flap_suppress=1000, flap_reuse=500)  # one DOWN damps
    d = PathDetector("damp-from-up", touchy)
    seen += _late_streak(d, 70_000, warm(d, random.Random(7)))  # UP -> DOWN -> DAMPED -> UP
    for name, cfg in (("watch", DetectorConfig(flap_suppress=5000, flap_max_penalty=20_000)),
                      ("damp-from-watch", DetectorConfig(flap_suppress=1500, flap_reuse=500))):
        d = PathDetector(name, cfg)
        t = warm(d, random.Random(8))
        for k in range(3):  # a real outage: DOWN, then answered again -> RECOVERING
            seen += d.on_miss(80_000 + k, t + k * MS + d.rto_ns)
        seen += d.on_answered(1, 80_010, t + 10 * MS, 60 * US)
        assert d.state is State.RECOVERING, name
        seen += _late_streak(d, 80_020, t + 20 * MS)  # DOWN (or DAMPED) -> RECOVERING
    return seen


def _suspect_then(d: PathDetector, kind: str, t: int) -> list[Transition]:
    """UP -> SUSPECT by a missed probe, then the evidence event arrives during the streak."""
    out = d.on_sent(900_000, t)
    out += d.tick(d.next_deadline_ns())
    assert d.state is State.SUSPECT
    event = {"gray": Event.GRAY, "latency": Event.LATENCY, "mtu": Event.MTU}[kind]
    reason = {"gray": Reason.GRAY_LOSS_FWD, "latency": Reason.LATENCY_FWD, "mtu": Reason.MTU_BLACKHOLE}[kind]
    out += d._evidence(event, reason, t + 2 * MS, "test")
    return out


def test_every_allowed_transition_happens_through_real_inputs():
    transitions = _scenarios()
    seen = {(t.old, t.event) for t in transitions}
    missing = set(TRANSITIONS) - seen - {(State.UP, Event.MISSES)}  # needs miss_threshold = 1
    assert not missing, sorted((s.name, e.name) for s, e in missing)
    d = PathDetector("one", DetectorConfig(miss_threshold=1))
    d.on_sent(1, 0)
    out = d.tick(d.next_deadline_ns())
    assert [(t.old, t.event, t.new) for t in out] == [(State.UP, Event.MISSES, State.DOWN)]
    for t in transitions:
        assert TRANSITIONS[(t.old, t.event)][0] is t.new


# ---- hard failure ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_hard_failure_within_3ms_of_first_lost_probe(seed):
    rng = random.Random(seed)
    d = PathDetector("p")
    t0 = warm(d, rng)
    fault = t0 + 100 * MS + rng.randrange(MS)  # somewhere between two probes
    run = simulate(d, Link(dark=lambda x: x >= fault), 200 * MS, rng, start_ns=t0, seq0=10_000)
    down = run.first(lambda t: t.new is State.DOWN)
    assert down is not None and down.reason is Reason.HARD_FAILURE
    first_lost = -(-fault // MS) * MS
    assert down.at_ns - first_lost <= 2 * MS + d.cfg.timeout_floor_ns + 50 * US
    assert down.at_ns - fault <= 3.3 * MS
    assert [t.new for t in run.transitions] == [State.SUSPECT, State.DOWN]


def test_healthy_jittery_path_never_goes_down():
    rng = random.Random(7)
    d = PathDetector("p")
    run = simulate(d, Link(jitter_ns=40 * US), 10_000 * MS, rng)
    assert not [t for t in run.transitions if t.new in (State.DOWN, State.DEGRADED)]


def test_timeout_adapts_to_a_slow_path():
    rng = random.Random(3)
    d = PathDetector("p")
    run = simulate(d, Link(base_owd_ns=2 * MS, jitter_ns=200 * US), 2000 * MS, rng)
    assert d.rto_ns > 4 * MS
    assert not [t for t in run.transitions if t.new in (State.DOWN, State.DEGRADED)]


# ---- gray loss ---------------------------------------------------------------------------------

def _gray_detect_ms(seed: int, p: float, direction: str) -> tuple[float, Reason]:
    rng = random.Random(seed)
    d = PathDetector("p")
    t0 = warm(d, rng)
    link = Link(loss_fwd=lambda x: p) if direction == "fwd" else Link(loss_rev=lambda x: p)
    run = simulate(d, link, (300 if p >= 0.1 else 3000) * MS, rng, start_ns=t0, seq0=10_000)
    tr = run.first(lambda t: t.new is State.DEGRADED)
    assert tr is not None, (seed, p, direction, run.transitions[:5])
    return (tr.at_ns - t0) / MS, tr.reason


@pytest.mark.parametrize("direction,reason", [("fwd", Reason.GRAY_LOSS_FWD), ("rev", Reason.GRAY_LOSS_REV)])
def test_ten_percent_loss_within_100ms(direction, reason):
    results = [_gray_detect_ms(s, 0.10, direction) for s in SEEDS]
    times = [r[0] for r in results]
    assert statistics.median(times) <= 100, times
    assert max(times) <= 150, times
    assert all(r[1] is reason for r in results), results


@pytest.mark.parametrize("direction,reason", [("fwd", Reason.GRAY_LOSS_FWD), ("rev", Reason.GRAY_LOSS_REV)])
def test_one_percent_loss_within_2s(direction, reason):
    results = [_gray_detect_ms(s, 0.01, direction) for s in SEEDS]
    times = [r[0] for r in results]
    assert statistics.median(times) <= 2000, times
    assert all(r[1] is reason for r in results), results


def test_no_gray_false_positive_in_60s_of_healthy_probes():
    rng = random.Random(11)
    d = PathDetector("p")
    run = simulate(d, Link(loss_fwd=lambda x: 1e-4, loss_rev=lambda x: 1e-4), 60_000 * MS, rng)
    bad = [t for t in run.transitions if t.new in (State.DEGRADED, State.DOWN)]
    assert bad == []


def test_outage_is_not_counted_as_gray_loss_after_recovery():
    rng = random.Random(5)
    d = PathDetector("p", DetectorConfig(hold_down_ns=100 * MS))
    t0 = warm(d, rng)
    run = simulate(d, Link(dark=lambda x: x < t0 + 50 * MS), 1000 * MS, rng, start_ns=t0, seq0=10_000)
    assert [t.new for t in run.transitions] == [State.SUSPECT, State.DOWN, State.RECOVERING, State.UP]


@pytest.mark.parametrize("p1_slow, probes", [(0.005, 1150), (0.02, 240)])
def test_a_degraded_direction_clears_after_the_clean_probes_its_sensitive_test_needs(p1_slow, probes):
    """Clearing gray loss takes ~4.6 / (p1_slow - p0) clean probes: at the default 0.5 % that is
    1150 (two minutes for a path probed every 100 ms), at 2 % about 240."""
    waits = []
    for seed in SEEDS:
        rng = random.Random(seed)
        d = PathDetector("p", DetectorConfig(gray_p1_slow=p1_slow, hold_down_ns=100 * MS))
        t0 = warm(d, rng)
        end = t0 + 200 * MS
        run = simulate(d, Link(loss_fwd=lambda x: 0.10 if x < end else 0.0), 2000 * MS, rng, start_ns=t0,
                       seq0=10_000)
        assert run.first(lambda t: t.new is State.DEGRADED and t.reason is Reason.GRAY_LOSS_FWD), run.transitions
        cleared = run.first(lambda t: t.reason is Reason.EVIDENCE_CLEARED)
        if cleared is not None and not any(t.new is State.DOWN for t in run.transitions):
            waits.append((cleared.at_ns - end) / MS)  # probes: one a millisecond
    assert len(waits) >= len(SEEDS) // 2, waits
    assert probes * 0.85 <= statistics.median(waits) <= probes * 1.15, waits


# ---- latency -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_cusum_catches_forward_delay_shift_only(seed):
    rng = random.Random(seed)
    d = PathDetector("p")
    t0 = warm(d, rng)
    run = simulate(d, Link(shift_fwd=lambda x: 200 * US if x >= t0 + 50 * MS else 0), 200 * MS, rng,
                   start_ns=t0, seq0=10_000)
    tr = run.first(lambda t: t.new is State.DEGRADED)
    assert tr is not None and tr.reason is Reason.LATENCY_FWD
    assert tr.at_ns - (t0 + 50 * MS) <= 20 * MS
    assert Reason.LATENCY_REV not in d.faults


def test_latency_fault_clears_and_path_recovers():
    rng = random.Random(4)
    d = PathDetector("p", DetectorConfig(hold_down_ns=100 * MS))
    t0 = warm(d, rng)
    end = t0 + 300 * MS
    run = simulate(d, Link(shift_rev=lambda x: 500 * US if x < end else 0), 1000 * MS, rng, start_ns=t0,
                   seq0=10_000)
    # a 500 µs jump on a 50 µs path also makes the first replies late (SUSPECT) until rto adapts
    major = [t for t in run.transitions if State.SUSPECT not in (t.old, t.new)]
    assert [(t.new, t.reason) for t in major] == [
        (State.DEGRADED, Reason.LATENCY_REV), (State.RECOVERING, Reason.EVIDENCE_CLEARED),
        (State.UP, Reason.RECOVERED)]
    assert major[1].at_ns >= end


# ---- MTU black hole ----------------------------------------------------------------------------

def test_mtu_blackhole_when_only_big_probes_fail():
    rng = random.Random(8)
    d = PathDetector("p")
    t0 = warm(d, rng)
    run = simulate(d, Link(size_lost=lambda x: True), 500 * MS, rng, start_ns=t0, seq0=10_000, size_every=50)
    assert [(t.new, t.reason) for t in run.transitions] == [(State.DEGRADED, Reason.MTU_BLACKHOLE)]
    assert run.transitions[0].at_ns - t0 <= 3 * 50 * MS + MS


def test_no_mtu_blackhole_from_random_loss_of_small_probes():
    rng = random.Random(9)
    d = PathDetector("p")
    run = simulate(d, Link(loss_fwd=lambda x: 0.002), 5_000 * MS, rng, size_every=20)
    assert not [t for t in run.transitions if t.reason is Reason.MTU_BLACKHOLE]
    assert not [t for t in run.transitions if t.new is State.DEGRADED]


def test_mtu_blackhole_clears_when_big_probes_pass():
    rng = random.Random(10)
    d = PathDetector("p", DetectorConfig(hold_down_ns=200 * MS))
    t0 = warm(d, rng)
    end = t0 + 400 * MS
    run = simulate(d, Link(size_lost=lambda x: x < end), 1500 * MS, rng, start_ns=t0, seq0=10_000, size_every=50)
    assert [t.new for t in run.transitions] == [State.DEGRADED, State.RECOVERING, State.UP]


# ---- flapping and recovery ---------------------------------------------------------------------

def test_flapping_is_damped_then_reused_after_decay():
    cfg = DetectorConfig(hold_down_ns=100 * MS, recovery_good_probes=20, flap_half_life_ns=2 * S)
    rng = random.Random(12)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    flap_end = t0 + 140 * MS  # three outages: at +0, +50 and +100 ms
    flaps = lambda x: x < flap_end and (x - t0) % (50 * MS) < 10 * MS  # 10 ms dark every 50 ms
    run = simulate(d, Link(dark=flaps), 4_500 * MS, rng, start_ns=t0, seq0=10_000)
    damp = run.first(lambda t: t.new is State.DAMPED)
    assert damp is not None and damp.reason is Reason.FLAPPING
    downs_before = [t for t in run.transitions if t.new is State.DOWN and t.at_ns <= damp.at_ns]
    assert len(downs_before) == 3  # 1000 + ~1000 + ~1000 ≥ 2000
    reuse = run.first(lambda t: t.old is State.DAMPED)
    assert reuse is not None and reuse.new is State.RECOVERING and reuse.reason is Reason.REUSED
    # penalty ~2990 -> 750 takes log2(2990/750) ≈ 2 half-lives (2 s each here)
    assert 3.9 * S <= reuse.at_ns - damp.at_ns <= 4.1 * S
    assert d.penalty(reuse.at_ns) <= cfg.flap_reuse + 1
    # stayed out the whole time although the link was healthy after flap_end
    assert not [t for t in run.transitions if damp.at_ns < t.at_ns < reuse.at_ns]
    up = run.transitions[-1]
    assert up.new is State.UP and up.at_ns - reuse.at_ns >= cfg.hold_down_ns


def test_recovery_needs_the_hold_down():
    cfg = DetectorConfig(hold_down_ns=500 * MS, recovery_good_probes=100)
    rng = random.Random(13)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    heal = t0 + 20 * MS
    run = simulate(d, Link(dark=lambda x: x < heal), 2000 * MS, rng, start_ns=t0, seq0=10_000)
    rec = run.first(lambda t: t.new is State.RECOVERING)
    up = run.first(lambda t: t.new is State.UP)
    assert rec is not None and up is not None and up.reason is Reason.RECOVERED
    assert rec.at_ns - heal < 2 * MS
    assert cfg.hold_down_ns <= up.at_ns - rec.at_ns <= cfg.hold_down_ns + 2 * MS


def test_a_miss_while_recovering_restarts_the_good_count():
    cfg = DetectorConfig(hold_down_ns=10 * MS, recovery_good_probes=100)
    rng = random.Random(14)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    lone = t0 + 80 * MS
    run = simulate(d, Link(dark=lambda x: x < t0 + 20 * MS or lone <= x < lone + MS), 1000 * MS, rng,
                   start_ns=t0, seq0=10_000)
    rec = run.first(lambda t: t.new is State.RECOVERING)
    up = run.first(lambda t: t.new is State.UP)
    assert up is not None and rec is not None
    # without the lone loss it would be UP at rec + 100 probes; the loss restarts the count
    assert up.at_ns >= lone + 100 * MS > rec.at_ns + 100 * MS


def test_probes_answered_late_neither_count_nor_break_a_recovery():
    """A loaded host answers some probes after their deadline: a recovering path still finishes
    its hold-down (late replies do not restart the good-probe count), while a probe never
    answered does restart it (test_a_miss_while_recovering_restarts_the_good_count)."""
    cfg = DetectorConfig(hold_down_ns=500 * MS, recovery_good_probes=100)
    d = PathDetector("p", cfg)
    t0 = warm(d, random.Random(16))
    heal = t0 + 20 * MS
    simulate(d, Link(dark=lambda x: x < heal), 40 * MS, random.Random(17), start_ns=t0, seq0=10_000)
    assert d.state is State.RECOVERING
    t, seq, late_every = t0 + 40 * MS, 20_000, 25  # 4 % of the probes answered 30 ms late
    up = None
    for i in range(600):  # 6 s at 10 ms
        d.on_sent(seq, t)
        if i % late_every == late_every - 1:
            d.tick(t + 20 * MS)  # its deadline passes: counted missed...
            trs = d.on_reply(seq, t + 30 * MS, 30 * MS)  # ...then answered: it was only late
        else:
            trs = d.on_reply(seq, t + 200 * US, 200 * US)
        trs += d.tick(t + 5 * MS)
        up = up or next((x for x in trs if x.new is State.UP), None)
        seq, t = seq + 1, t + 10 * MS
    assert up is not None and up.at_ns - heal < 2_500 * MS, (d.state, d.good_run, d.waiting_for(t))


def test_a_recovering_path_says_what_it_waits_for():
    cfg = DetectorConfig(hold_down_ns=500 * MS, recovery_good_probes=100)
    rng = random.Random(15)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    assert d.waiting_for(t0) == []  # UP waits for nothing
    heal = t0 + 20 * MS
    simulate(d, Link(dark=lambda x: x < heal), 60 * MS, rng, start_ns=t0, seq0=10_000)
    assert d.state is State.RECOVERING
    now = t0 + 60 * MS
    waits = d.waiting_for(now)
    assert waits[0].startswith("hold-down ") and waits[0].endswith(" ms more")
    assert any(w.endswith("/100 good probes in a row") for w in waits), waits
    d._sprt[Direction.REV][1].llr = 3.0  # two recent reply losses' worth
    assert any(w.startswith("rev loss: recent losses still weigh 3.0") for w in d.waiting_for(now))


@pytest.mark.parametrize("seed", range(10))
def test_background_loss_an_up_path_tolerates_does_not_hold_a_recovering_path_out(seed):
    # 0.2 % loss at 100 probes/s: below the sensitive test's indifference point (~0.25 %), so an
    # UP path is never degraded for it; a recovering one must not be held out for it either
    cfg = DetectorConfig()
    rng = random.Random(seed)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    heal = t0 + 100 * MS
    run = simulate(d, Link(dark=lambda x: x < heal, loss_fwd=lambda x: 0.002), 30_000 * MS, rng,
                   start_ns=t0, interval_ns=10 * MS, seq0=10_000)
    up = run.first(lambda t: t.new is State.UP)
    assert up is not None and up.at_ns - heal < 5_000 * MS, (seed, up, d.state)


# ---- many paths ---------------------------------------------------------------------------------

def test_detector_keeps_paths_apart():
    det = Detector()
    a, b = det.add_path(("peer1", 0, "a")), det.add_path(("peer1", 1, "b"))
    for i in range(20):
        det.on_sent(a.path, i, i * MS)
        det.on_sent(b.path, i, i * MS)
        det.on_reply(a.path, i, i * MS + 50 * US, 50 * US)
        det.tick(i * MS + 500 * US)
    assert det.states() == {a.path: State.UP, b.path: State.DOWN}
    assert det.next_deadline_ns() is not None
    with pytest.raises(KeyError, match="add_path"):
        det.on_sent("nope", 1, 0)


def test_on_loss_rejects_impossible_counts():
    d = PathDetector("p")
    with pytest.raises(ValueError, match="on_loss"):
        d.on_loss(5, 4, 0, 0, 0)
    with pytest.raises(ValueError, match="exceeds"):
        d.on_loss(1, 3, 2, 2, 0)


# ---- properties --------------------------------------------------------------------------------

_inputs = st.lists(st.one_of(
    st.tuples(st.just("sent"), st.integers(0, 60), st.integers(0, 3 * MS), st.booleans()),
    st.tuples(st.just("reply"), st.integers(0, 60), st.integers(0, 3 * MS), st.integers(-5, 20 * MS),
              st.one_of(st.none(), st.integers(-MS, 20 * MS)), st.one_of(st.none(), st.integers(-MS, 20 * MS))),
    st.tuples(st.just("loss"), st.integers(0, 60), st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.integers(0, 50 * S)),
), max_size=200)


@settings(max_examples=80, deadline=None)
@given(_inputs)
def test_any_input_sequence_keeps_the_machine_in_its_table(ops):
    cfg = DetectorConfig(latency_learn_samples=8, hold_down_ns=MS, recovery_good_probes=2,
                         flap_half_life_ns=10 * MS)
    d = PathDetector("p", cfg)
    now = 0
    for op in ops:
        kind = op[0]
        if kind == "sent":
            now += op[2]
            out = d.on_sent(op[1], now, op[3])
        elif kind == "reply":
            now += op[2]
            out = d.on_reply(op[1], now, op[3], op[4], op[5])
        elif kind == "loss":
            first, n, lf, lr = op[1], op[2], op[3], op[4]
            lf, lr = min(lf, n + 1), min(lr, max(0, n + 1 - min(lf, n + 1)))
            out = d.on_loss(first, first + n, lf, lr, now)
        else:
            now += op[1] % (100 * MS)
            out = d.tick(now)
        state_before = None
        for t in out:
            assert (t.old, t.event) in TRANSITIONS and TRANSITIONS[(t.old, t.event)][0] is t.new
            if state_before is not None:
                assert t.old is state_before
            state_before = t.new
            assert t.at_ns == now
        assert d.state in State
        nd = d.next_deadline_ns()
        assert nd is None or isinstance(nd, int)
    assert len(d._outstanding) <= cfg.max_outstanding


def test_failing_again_while_damped_adds_penalty_without_transitions():
    cfg = DetectorConfig(flap_half_life_ns=S)
    rng = random.Random(15)
    d = PathDetector("p", cfg)
    t0 = warm(d, rng)
    run = simulate(d, Link(dark=lambda x: (x - t0) % (20 * MS) < 5 * MS), 60 * MS, rng, start_ns=t0, seq0=10_000)
    assert run.transitions[-1].new is State.DAMPED
    t1 = t0 + 60 * MS
    before = d.penalty(t1 + 500 * MS)
    run = simulate(d, Link(dark=lambda x: 300 * MS <= x - t1 < 310 * MS), 500 * MS, rng, start_ns=t1, seq0=20_000)
    assert run.transitions == [] and d.state is State.DAMPED
    assert d.penalty(t1 + 500 * MS) > before + 0.5 * cfg.flap_penalty


# ---- judging mode and spurious DOWNs -----------------------------------------------------------

def test_judging_mode_matches_per_probe_mode():
    """on_answered / on_miss (the C core's batched reports) lead to the same states as
    on_sent / on_reply / tick per probe, for the same story: healthy, dark for 5 probes, back."""
    per_probe, batched = PathDetector("a", DetectorConfig(hold_down_ns=0, recovery_good_probes=5)), \
        PathDetector("b", DetectorConfig(hold_down_ns=0, recovery_good_probes=5))
    states_a, states_b = [], []
    for seq in range(40):
        t = seq * MS
        dark = 20 <= seq < 25
        per_probe.on_sent(seq, t)
        if not dark:
            states_a += [x.new for x in per_probe.on_reply(seq, t + 50 * US, 50 * US)]
        states_a += [x.new for x in per_probe.tick(t + MS - 1)]
        if dark:
            states_b += [x.new for x in batched.on_miss(seq, t + batched.rto_ns)]
        else:
            states_b += [x.new for x in batched.on_answered(1, seq, t + 50 * US, 50 * US)]
        batched.tick(t + MS - 1)
    assert states_a == states_b
    assert State.DOWN in states_a and states_a[-1] is State.UP


def test_ticks_reach_the_paths_with_work_and_only_them():
    """Judging mode, as the agent runs it: of 50 paths only the one recovering has work for tick(),
    which still ends its hold-down on time, and none after."""
    det = Detector(DetectorConfig(hold_down_ns=100 * MS, recovery_good_probes=3))
    for i in range(50):
        det.add_path(i)
    for seq in range(20):  # every path healthy
        for i in range(50):
            det.on_answered(i, 1, seq, seq * MS + 50 * US, 50 * US)
    t = 20 * MS
    for seq in range(20, 23):
        det.on_miss(7, seq, t + det[7].rto_ns)
        t += MS
    assert det[7].state is State.DOWN
    trs = []
    for seq in range(23, 30):
        trs += det.on_answered(7, 1, seq, t, 50 * US)
        t += MS
    assert [x.new for x in trs] == [State.RECOVERING] and list(det._ticking) == [7]
    back = trs[0].at_ns + 100 * MS
    assert det.tick(back - MS) == []
    assert [(x.path, x.new) for x in det.tick(back)] == [(7, State.UP)]
    det.tick(back + MS)
    assert not det._ticking


def test_late_streak_is_undone_as_spurious_without_penalty():
    d = PathDetector("p")
    rng = random.Random(3)
    t0 = warm(d, rng)
    penalty_before = d.penalty(t0)
    out = []
    for k in range(3):  # three probes whose replies are 3 ms late: judged missed
        out += d.on_miss(10_000 + k, t0 + k * MS + d.rto_ns)
    assert [x.new for x in out][-1] is State.DOWN
    late = d.on_reply(10_000, t0 + 3 * MS, 3 * MS)
    assert [(x.new, x.reason) for x in late] == [(State.UP, Reason.SPURIOUS_DOWN)]
    assert d.penalty(t0 + 3 * MS) <= penalty_before + 1e-9  # the flap penalty was taken back
    # no hold-down; probes answered late neither count nor break the run of good ones
    assert d.state is State.UP and d.good_run == 500


def test_late_streak_is_undone_after_an_older_late_reply_took_the_path_to_recovering():
    """The first reply after the streak may be an older probe's (one that did not count in the
    streak, e.g. a full-size one); the streak's own late replies then still undo the DOWN, and
    its flap penalty, so bursts of lateness cannot add up to DAMPED."""
    d = PathDetector("p", DetectorConfig(hold_down_ns=500 * MS))
    t0 = warm(d, random.Random(3))
    penalty_before = d.penalty(t0)
    for k in range(3):
        d.on_miss(10_000 + k, t0 + k * MS + d.rto_ns)
    assert d.state is State.DOWN
    older = d.on_reply(9_999, t0 + 3 * MS, 4 * MS)
    assert [x.new for x in older] == [State.RECOVERING]
    late = d.on_reply(10_000, t0 + 3 * MS + 20 * US, 3 * MS)
    assert [(x.old, x.new, x.reason) for x in late] == [(State.RECOVERING, State.UP, Reason.SPURIOUS_DOWN)]
    assert d.penalty(t0 + 3 * MS) <= penalty_before + 1e-9


def test_a_spurious_down_of_a_recovering_path_returns_it_to_recovering_with_its_hold_down_running_on():
    d = PathDetector("p", DetectorConfig(hold_down_ns=500 * MS, flap_suppress=5000, flap_max_penalty=20_000))
    t0 = warm(d, random.Random(9))
    for k in range(3):
        d.on_miss(10_000 + k, t0 + k * MS + d.rto_ns)
    d.on_answered(1, 10_010, t0 + 10 * MS, 60 * US)
    assert d.state is State.RECOVERING
    since, penalty = d.since_ns, d.penalty(t0 + 100 * MS)
    for k in range(3):
        d.on_miss(10_020 + k, t0 + 100 * MS + k * MS + d.rto_ns)
    assert d.state is State.DOWN
    back = d.on_reply(10_020, t0 + 104 * MS, 4 * MS)
    assert [(x.old, x.new, x.reason) for x in back] == [(State.DOWN, State.RECOVERING, Reason.SPURIOUS_DOWN)]
    assert d.since_ns == since and d.penalty(t0 + 100 * MS) == pytest.approx(penalty)


def test_bursts_of_lateness_never_add_up_to_damped():
    """Fifty bursts a second apart, each making a streak late (not lost), the first reply after
    each an older probe's: every DOWN is undone and the path is never DAMPED."""
    d = PathDetector("p", DetectorConfig(flap_half_life_ns=10_000 * MS))
    t = warm(d, random.Random(6))
    states = []
    for burst in range(50):
        base = 100_000 + burst * 10
        for k in range(3):
            states += [x.new for x in d.on_miss(base + k, t + k * MS + d.rto_ns)]
        states += [x.new for x in d.on_reply(base - 1, t + 3 * MS, 4 * MS)]
        for k in range(3):
            states += [x.new for x in d.on_reply(base + k, t + 3 * MS + (k + 1) * 10 * US, 3 * MS)]
        t += 1000 * MS
        d.on_answered(5, base + 5, t, 60 * US)
    assert State.DOWN in states and State.DAMPED not in states and d.state is State.UP


def test_real_outage_is_not_undone_by_a_reply_after_it():
    d = PathDetector("p", DetectorConfig(hold_down_ns=100 * MS))
    t0 = warm(d, random.Random(4))
    for k in range(3):
        d.on_miss(10_000 + k, t0 + k * MS + d.rto_ns)
    back = d.on_reply(10_005, t0 + 6 * MS, 60 * US)  # a later probe answered: the link came back
    assert [(x.new, x.reason) for x in back] == [(State.RECOVERING, Reason.REPLY_SEEN)]

"""Per-path telemetry from exchanges: loss per direction from the reflector's counter, delays."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from linkpass.core.telemetry import LossCounters, LossSnapshot, PathTelemetry, percentile


def simulate(n, p_fwd, p_rev, seed=1, restart_at=None):
    """A sender/reflector pair over lossy directions; returns the sender's counters and the truth."""
    rng = random.Random(seed)
    loss = LossCounters()
    refl_count = 0
    truth_fwd = truth_rev = 0
    last_answered = None
    pending_fwd = pending_rev = 0
    for seq in range(n):
        if restart_at is not None and seq == restart_at:
            refl_count = 0
        if rng.random() < p_fwd:
            pending_fwd += 1
            continue
        refl_count += 1
        if rng.random() < p_rev:
            pending_rev += 1
            continue
        loss.on_reply(seq, refl_count)
        if last_answered is not None:  # losses only count once a later reply bounds them
            truth_fwd += pending_fwd
            truth_rev += pending_rev
        pending_fwd = pending_rev = 0
        last_answered = seq
    return loss, truth_fwd, truth_rev


def test_lost_requests_and_lost_replies_are_told_apart():
    loss, fwd, rev = simulate(20000, 0.10, 0.0)
    assert loss.lost_fwd == fwd and loss.lost_rev == 0
    loss, fwd, rev = simulate(20000, 0.0, 0.05)
    assert loss.lost_fwd == 0 and loss.lost_rev == rev


@settings(max_examples=60, deadline=None)
@given(p_fwd=st.floats(0, 0.5), p_rev=st.floats(0, 0.5), seed=st.integers(0, 1000))
def test_loss_accounting_is_exact(p_fwd, p_rev, seed):
    loss, fwd, rev = simulate(2000, p_fwd, p_rev, seed)
    assert (loss.lost_fwd, loss.lost_rev) == (fwd, rev)


def test_reflector_restart_is_not_counted_as_loss():
    loss, _, _ = simulate(1000, 0.0, 0.0, restart_at=500)
    assert loss.lost_fwd == 0 and loss.lost_rev == 0 and loss.reflector_restarts == 1


def test_window_of_loss_is_a_difference_of_snapshots():
    t = PathTelemetry()
    for seq in range(100):
        t.on_sent()
        t.on_reply(seq, 0, 0, 0, 0, seq + 1)
    a = LossSnapshot.of(t)
    rx = 100
    for seq in range(100, 200):
        t.on_sent()
        if seq % 4 == 0:
            continue  # request lost
        rx += 1
        if seq % 5 == 0:
            continue  # reply lost
        t.on_reply(seq, 0, 0, 0, 0, rx)
    w = LossSnapshot.of(t).minus(a)
    assert w["lost_fwd"] == 25
    assert w["lost_rev"] == len([s for s in range(100, 200) if s % 4 and s % 5 == 0])  # 199, the last, arrived
    assert w["loss_fwd_pct"] == pytest.approx(100 * 25 / w["sent"]) and w["unanswered"] == 0


def test_a_dark_path_is_sent_without_replies():
    t = PathTelemetry()
    for seq in range(10):
        t.on_sent()
        t.on_reply(seq, 0, 0, 0, 0, seq + 1)
    a = LossSnapshot.of(t)
    for _ in range(50):
        t.on_sent()  # nothing comes back
    w = LossSnapshot.of(t).minus(a)
    assert w["sent"] == 50 and w["replies"] == 0 and w["unanswered"] == 50 and w["loss_pct"] == 100
    assert w["loss_fwd_pct"] is None  # no reply, no direction


def test_one_way_delays_need_the_clock_offset():
    t = PathTelemetry()
    offset = 5_000_000  # reflector clock 5 ms ahead
    for seq in range(100):
        t1 = seq * 1_000_000
        t2 = t1 + 20_000 + offset  # 20 µs out
        t3 = t2 + 3_000
        t4 = t3 - offset + (80_000 if seq % 10 == 0 else 30_000)  # 30 µs back, sometimes 80
        t.on_reply(seq, t1, t2, t3, t4, seq + 1)
    w = t.window(0, offset_ns=offset)
    assert w["owd_fwd_ns"]["p50"] == 20_000 and w["owd_rev_ns"]["p50"] == 30_000
    assert w["owd_rev_ns"]["max"] == 80_000 and w["rtt_ns"]["min"] == 50_000
    assert "owd_fwd_ns" not in t.window(0)  # without clock sync, no one-way figures
    assert w["jitter_ns"] > 0


def test_memory_per_path_is_bounded():
    t = PathTelemetry(ring=128)
    for seq in range(10_000):
        t.on_reply(seq, 0, 1, 2, 3, seq + 1)
    assert len(t.samples) == 128 and t.window(0)["samples"] == 128


def test_percentile():
    assert percentile([], 0.5) is None
    assert percentile(list(range(101)), 0.99) == 99

"""The probe event (core/probe_event.py): one type for the C core's binding, the simulator and
Failover, and the one telemetry feed they share (core/telemetry.feed_events)."""
from __future__ import annotations

import ast
import os

from linkpass.core import telemetry
from linkpass.core.probe_event import EV_ANSWERED, EV_LATE, EV_MISS, EventKind, ProbeEvent, from_record
from linkpass.core.telemetry import LossCounters, PathTelemetry, feed_events
from linkpass.probe import _probecore
from linkpass.probe.engine import CoreProbeEngine


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_c_record_has_the_events_fields_in_their_order():
    assert CoreProbeEngine.EVENT.size == _probecore.EVENT_SIZE
    assert len(CoreProbeEngine.EVENT.unpack(bytes(CoreProbeEngine.EVENT.size))) == len(ProbeEvent._fields)
    assert ProbeEvent._fields[:2] == ("kind", "path_id") and ProbeEvent._fields[-4:] == ("t1", "t2", "t3", "t4")
    record = CoreProbeEngine.EVENT.pack(EV_MISS, 7, 41, 0, 0, 1, 0, 1_000, 0, 0, 251_000)
    assert from_record(CoreProbeEngine.EVENT.unpack(record)) == ProbeEvent.miss(7, 41, 1, 1_000, 251_000)


def test_each_kind_sets_only_its_fields():
    assert [int(k) for k in EventKind] == [1, 2, 3]  # _probecore.c's values
    miss = ProbeEvent.miss(3, 10, 1, 5_000, 255_000)
    assert (miss.kind, miss.count, miss.rx_count, miss.worst_rtt_ns, miss.t2, miss.t3) == (EV_MISS, 0, 0, 0, 0, 0)
    late = ProbeEvent.late(3, 10, 9, 5_000, 6_000, 7_000, 900_000)
    assert (late.kind, late.count, late.size_probe, late.worst_rtt_ns) == (EV_LATE, 0, 0, 0)
    ok = ProbeEvent.answered(3, 20, 10, 19, 0, 40_000, 15_000, 16_000, 17_000, 30_000)
    assert ok.kind == EV_ANSWERED and ok == (EV_ANSWERED, 3, 20, 10, 19, 0, 40_000, 15_000, 16_000, 17_000, 30_000)
    assert (ok.replies, late.replies, miss.replies) == (10, 1, 0)


def test_the_feed_counts_answered_batches_late_replies_and_skips_misses_and_removed_paths():
    events = [ProbeEvent.answered(1, 9, 10, 10, 0, 30_000, 9_000, 9_010, 9_020, 9_040),
              ProbeEvent.miss(1, 10, 0, 10_000, 10_250),
              ProbeEvent.answered(1, 12, 1, 12, 0, 20_000, 12_000, 12_010, 12_020, 12_030),
              ProbeEvent.late(1, 10, 11, 10_000, 10_100, 10_110, 10_400),
              ProbeEvent.answered(2, 5, 3, 5, 0, 20_000, 5_000, 5_010, 5_020, 5_030)]  # path 2: removed
    full, loss = PathTelemetry(), LossCounters()
    feed_events(events, {1: full})
    feed_events(events, {1: loss})
    for lc in (full.loss, loss):
        assert (lc.start_seq, lc.hi, lc.replies, lc.arrived) == (9, 12, 3, 3)
        assert (lc.lost_fwd, lc.lost_rev) == (1, 0)  # 10..12: the reflector got two (rx_count 10 -> 12)
    assert [s.seq for s in full.samples] == [9, 12, 10] and full.samples[-1].rtt == 400 - 10


def test_the_engine_and_the_simulator_call_the_one_feed():
    """Neither the C binding nor the simulator feeds telemetry from events by hand."""
    for rel, owner in (("linkpass/probe/engine.py", "CoreProbeEngine.poll"), ("sim/linkpass_sim/virtual.py", "_judge")):
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == owner.split(".")[-1])
        calls = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(fn)
                 if isinstance(c, ast.Call)}
        assert "feed_events" in calls and "on_reply" not in calls, (rel, calls)
    assert telemetry.feed_events is feed_events

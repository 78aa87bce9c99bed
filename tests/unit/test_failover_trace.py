"""Failover on a recorded event sequence (tests/data/failover_trace.json): given the same events
and the same times it makes the same transitions, timeout pushes and entropy updates. Pure: no
engine, no clock; the times are the trace's."""
from __future__ import annotations

import json
import os

from linkpass.agent.data_path import DataPath
from linkpass.core.decide import PathInfo
from linkpass.core.failover import Failover
from linkpass.core.detector import Detector, DetectorConfig
from linkpass.core.probe_event import EV_LATE, EV_MISS, ProbeEvent
from linkpass.core.telemetry import LossCounters, feed_events


TRACE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "failover_trace.json")


class _Entropy:
    """EntropyWriter's interface, recording what Failover writes."""

    def __init__(self):
        self.now = 0
        self.updates = []

    def update(self, peer, plane, ports, path_ids=(), port_flags=(), flags=0):
        self.updates.append([self.now, peer, plane, list(path_ids), flags])

    def remove(self, peer, plane):
        return 0


def test_a_recorded_event_sequence_gives_the_recorded_decisions():
    with open(TRACE) as f:
        trace = json.load(f)
    loss = {p[0]: LossCounters() for p in trace["paths"]}
    rto, entropy, logs, step = [], _Entropy(), [], [0]
    fo = Failover(Detector(DetectorConfig(**trace["detector"])), loss.__getitem__, entropy=True)
    data_path = DataPath(entropy=entropy, set_rto=lambda pid, ns: rto.append([step[0], pid, ns]),
                         log=lambda event, **fields: logs.append((event, fields)))
    for p in trace["paths"]:
        fo.add_path(PathInfo(*p))
    transitions = []
    for i, (now, records) in enumerate(trace["steps"]):
        step[0] = i
        events = [ProbeEvent._make(r) for r in records]
        feed_events(events, loss)  # what the engine does before Failover sees them
        entropy.now = now
        decided = fo.step(events, now, mono_ns=now)
        data_path.carry_out(fo, decided, now)
        transitions += decided.transitions
    assert {e.kind for s in trace["steps"] for e in map(ProbeEvent._make, s[1])} >= {EV_MISS, EV_LATE}
    assert [[t.path, t.old.value, t.new.value, t.reason.value, t.detail, t.at_ns] for t in transitions] \
        == trace["transitions"]
    assert rto == trace["rto"]
    assert entropy.updates == trace["entropy"]
    # every log line carries the caller's time, never a clock of Failover's own
    stamped = [f["mono_ns"] for e, f in logs if e == "path_state"]
    assert stamped and set(stamped) <= {s[0] for s in trace["steps"]}

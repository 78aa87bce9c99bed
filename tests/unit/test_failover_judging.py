"""Failover's judgement of paths from hand-made probe events (pure: no engine, no clock): a path
that never answered, a DOWN confirmed only by on-time answers sent after it, and the lateness
allowance a host-wide burst of late replies earns."""
from __future__ import annotations

import pytest

from linkpass.agent.data_path import DataPath
from linkpass.core.decide import PathInfo
from linkpass.core.decisions import RouteResult
from linkpass.core.failover import Failover, reported_state
from linkpass.core.detector import Detector, DetectorConfig, State
from linkpass.core.probe_event import ProbeEvent
from linkpass.core.telemetry import LossCounters, feed_events


MS = 1_000_000
RTT = 50_000


class _Routes:
    """RouteActuator's interface: records every plane set it is given."""

    def __init__(self, peers):
        self.peers = set(peers)
        self.dry_run = False
        self.sets: list[tuple[str, tuple[int, ...]]] = []
        self._now: dict[str, tuple[int, ...]] = {}

    def set_usable(self, peer, planes):
        planes = tuple(sorted(planes))
        changed = self._now.get(peer) != planes
        if changed:
            self._now[peer] = planes
            self.sets.append((peer, planes))
        return RouteResult(peer, planes, changed=changed)


class _Rig:
    """Two planes x two paths to h2, one probe per path per ms; `tick(ms, fate)` delivers one
    probe of every path: fate(path) is "ok", "lost" or ("late", ns)."""

    def __init__(self, **failover_kw):
        self.loss = {pid: LossCounters() for pid in (1, 2, 3, 4)}
        self.routes = _Routes(["h2"])
        self.logs = []
        self.fo = Failover(Detector(DetectorConfig()), self.loss.__getitem__, **failover_kw)
        self.data_path = DataPath(self.routes, log=lambda event, **f: self.logs.append((event, f)))
        for pid in (1, 2, 3, 4):
            self.fo.add_path(PathInfo(pid, "h2", (pid - 1) // 2, 49151 + pid, f"198.18.64.{pid}"))
        self.seq = 0
        self.late: list[tuple[int, ProbeEvent]] = []
        self.transitions = []

    def tick(self, fate=lambda pid: "ok"):
        self.seq += 1
        t1 = self.seq * MS
        events = []
        for pid in (1, 2, 3, 4):
            f = fate(pid)
            if f == "ok":
                events.append(ProbeEvent.answered(pid, self.seq, 1, self.seq, 0, RTT, t1, t1 + RTT // 2,
                                                  t1 + RTT // 2, t1 + RTT))
            else:
                deadline = t1 + self.fo.detector[pid].rto_ns
                events.append(ProbeEvent.miss(pid, self.seq, 0, t1, deadline))
                if isinstance(f, tuple):
                    t4 = t1 + f[1]
                    self.late.append((t4, ProbeEvent.late(pid, self.seq, self.seq, t1, t1 + RTT // 2,
                                                          t4 - RTT // 2, t4)))
        now = t1 + MS - 1
        due = sorted([x for x in self.late if x[0] <= now], key=lambda x: x[0])
        self.late = [x for x in self.late if x[0] > now]
        events += [e for _, e in due]
        events.sort(key=lambda e: e.t4)
        feed_events(events, self.loss)
        decided = self.fo.step(events, now, mono_ns=now)
        self.data_path.carry_out(self.fo, decided, now)
        self.transitions += decided.transitions

    def state(self, pid):
        return self.fo.detector[pid].state


def test_a_path_that_never_answered_is_judged_down_after_the_grace():
    rig = _Rig(unanswered_grace_ns=200 * MS)
    for _ in range(100):
        rig.tick(lambda pid: "lost" if pid == 4 else "ok")
    assert rig.state(4) is State.UP  # peers start at their own pace: not judged yet
    for _ in range(200):
        rig.tick(lambda pid: "lost" if pid == 4 else "ok")
    assert rig.state(4) is State.DOWN
    assert rig.routes.sets[-1] == ("h2", (0,))  # plane 1 is not clean without path 4
    assert [r for r in rig.fo.path_rows() if r["path"] == 4][0]["usable"] is False


def test_a_plane_cut_on_a_calm_host_moves_the_route_one_probe_after_the_down():
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    assert rig.fo.allowance_ns("h2") == 0
    for _ in range(10):
        rig.tick(lambda pid: "lost" if pid <= 2 else "ok")
    downs = [t for t in rig.transitions if t.new is State.DOWN]
    assert {t.path for t in downs} == {1, 2}
    assert rig.routes.sets[-1] == ("h2", (1,))


def test_replies_late_on_every_path_together_earn_an_allowance_and_move_nothing():
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    for burst in range(5):
        for k in range(6):  # six probes of every path answered 12 ms late (a stalled reflector)
            rig.tick(lambda pid: ("late", 12 * MS - k * MS))
        for _ in range(300):
            rig.tick()
    downs = [t for t in rig.transitions if t.new is State.DOWN]
    assert len(downs) >= 4
    assert rig.routes.sets == [("h2", (0, 1))], rig.routes.sets  # installed once, never moved
    assert 0 < rig.fo.allowance_ns("h2") <= rig.fo.lateness_cap_ns
    assert any(e == "host_lateness" for e, _ in rig.logs)
    assert all(rig.state(p) is State.UP for p in (1, 2, 3, 4))


def test_late_answers_on_other_planes_do_not_confirm_a_down():
    """Plane 0 goes quiet first, plane 1 a probe later and only late: nothing confirms plane 0's
    DOWN on time, so no route moves; the late replies then undo both."""
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    for k in range(6):
        rig.tick(lambda pid: ("late", 9 * MS - k * MS) if pid <= 2 or k > 0 else "ok")
    for _ in range(50):
        rig.tick()
    assert {t.path for t in rig.transitions if t.new is State.DOWN} >= {1, 2}
    assert rig.routes.sets == [("h2", (0, 1))], rig.routes.sets


def _rig_with_an_allowance() -> _Rig:
    """A rig whose peer earned a lateness allowance: one burst of replies up to 20 ms late on
    every path, then 100 probes on time."""
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    for k in range(6):
        rig.tick(lambda pid: ("late", 20 * MS - k * MS))
    for _ in range(100):
        rig.tick()
    return rig


def test_after_an_allowance_a_real_cut_moves_the_route_once_a_stall_is_ruled_out():
    """Plane 1 goes dark while plane 0 answers every probe on time: after the DOWN (three
    misses), the next probe of the dark path misses too while plane 0's, sent with it, is answered
    on time, and no path was late or missing since the silence began: no stall explains it, so
    the route moves then, not an allowance later."""
    rig = _rig_with_an_allowance()
    allowance = rig.fo.allowance_ns("h2")
    assert allowance > 10 * MS
    cut = rig.seq
    for _ in range(200):
        rig.tick(lambda pid: "lost" if pid >= 3 else "ok")
        if rig.routes.sets[-1] == ("h2", (0,)):
            break
    took_ms = rig.seq - cut
    assert rig.routes.sets[-1] == ("h2", (0,))
    assert took_ms <= 4, (took_ms, allowance / MS)  # 3 misses, then the re-probe's miss
    assert rig.fo.counters["route_changes"] == 2  # installed, then moved once


def test_after_an_allowance_a_cut_with_another_path_late_as_it_began_moves_once_that_stall_is_over():
    """The same cut, but a probe of plane 0 sent as the silence began is answered late: a stall
    reaching the paths one after another could explain the first misses, not the miss of a probe
    sent a margin (`stall_end_margin_ns`) after that late one while plane 0 answers on time
    again. The route moves at that miss, not an allowance later."""
    rig = _rig_with_an_allowance()
    allowance = rig.fo.allowance_ns("h2")
    assert allowance > 10 * MS
    cut = rig.seq
    for k in range(200):
        rig.tick(lambda pid: "lost" if pid >= 3 else (("late", 2 * MS) if k == 0 and pid == 1 else "ok"))
        if rig.routes.sets[-1] == ("h2", (0,)):
            break
    took_ms = rig.seq - cut
    assert rig.routes.sets[-1] == ("h2", (0,))
    # the late probe was sent with the cut's first; the miss that rules the stall out is of a probe
    # sent a margin later, judged within a probe interval
    margin_ms = rig.fo.stall_end_margin_ns / MS
    assert margin_ms < allowance / MS / 2  # else this would not tell the two apart
    assert 3 <= took_ms <= margin_ms + 2, (took_ms, allowance / MS)


def test_after_an_allowance_a_cut_while_other_paths_keep_answering_late_waits_out_the_allowance():
    """The same cut while plane 0's answers keep coming late every few probes (a stall that goes
    on, one that could explain the silence): the DOWN is acted on only once it has stood for the
    allowance."""
    rig = _rig_with_an_allowance()
    allowance = rig.fo.allowance_ns("h2")
    assert allowance > 10 * MS
    cut = rig.seq
    for k in range(200):
        rig.tick(lambda pid: "lost" if pid >= 3 else (("late", 2 * MS) if k % 2 == 0 and pid == 1 else "ok"))
        if rig.routes.sets[-1] == ("h2", (0,)):
            break
    took_ms = rig.seq - cut
    assert rig.routes.sets[-1] == ("h2", (0,))
    assert allowance / MS <= took_ms <= allowance / MS + 6, (took_ms, allowance / MS)


def test_a_held_down_is_shown_held_and_reported_suspect_until_the_data_path_acts():
    rig = _rig_with_an_allowance()
    assert rig.fo.allowance_ns("h2") > 10 * MS
    seen = []
    for _ in range(200):
        rig.tick(lambda pid: "lost" if pid >= 3 else "ok")
        row = [r for r in rig.fo.path_rows() if r["path"] == 3][0]
        seen.append((row["state"], row["held"], reported_state(row)))
        if rig.routes.sets[-1] == ("h2", (0,)):
            break
    assert ("down", True, "suspect") in seen  # within the allowance: traffic not moved, links not blamed
    assert seen[-1] == ("down", False, "down")  # the route moved: now it is evidence
    assert all(rep == "suspect" for st, held, rep in seen if held and st == "down")


@pytest.mark.parametrize("seed", range(6))
def test_a_path_out_of_use_is_out_of_the_route_however_it_got_there(seed):
    """Three probes lost in a row, then 20 % loss: the path goes DOWN and answers again before
    the route acted on the DOWN (RECOVERING, still counted usable), then turns DEGRADED, DOWN,
    DAMPED. Whenever it sits in a state the data path must avoid, the route has left its plane:
    the DEGRADED after an unacted DOWN is acted on then, not at the path's next change of
    usability (which may come only after the fault)."""
    import random
    rng = random.Random(seed)
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    kept = []
    for i in range(3000):
        rig.tick(lambda pid: "lost" if pid == 1 and (i < 3 or (i > 3 and rng.random() < 0.2)) else "ok")
        st = rig.state(1)
        if st in (State.DEGRADED, State.DAMPED) or (st is State.DOWN and not rig.fo.held_back(1)):
            if rig.routes.sets[-1] != ("h2", (1,)):
                kept.append((rig.seq, st.value, rig.routes.sets[-1]))
    ours = [(t.old, t.new) for t in rig.transitions if t.path == 1]
    assert (State.DOWN, State.RECOVERING) in ours and (State.RECOVERING, State.DEGRADED) in ours, ours[:6]
    assert not kept, (len(kept), kept[:5])


def test_a_failure_is_in_flight_from_the_first_miss_until_the_route_moves():
    """What keeps the agent's loop at real-time priority: a streak on a usable path, then the
    DOWN waiting for its confirming answers; not a healthy fabric, nor a dead path that keeps
    missing after the route left it."""
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    assert not rig.fo.in_flight()
    rig.tick(lambda pid: "lost" if pid <= 2 else "ok")
    assert rig.state(1) is State.SUSPECT and rig.fo.in_flight()
    while rig.state(1) is not State.DOWN:
        rig.tick(lambda pid: "lost" if pid <= 2 else "ok")
        assert rig.fo.in_flight()
    for _ in range(10):
        rig.tick(lambda pid: "lost" if pid <= 2 else "ok")
    assert rig.routes.sets[-1] == ("h2", (1,))
    assert not rig.fo.in_flight()  # decided: paths 1 and 2 are DOWN and keep missing


def test_a_single_late_reply_is_in_flight_only_until_it_arrives():
    rig = _Rig()
    for _ in range(50):
        rig.tick()
    rig.tick(lambda pid: ("late", 1500 * 1000) if pid == 3 else "ok")
    assert rig.fo.in_flight()
    rig.tick()
    rig.tick()
    assert rig.state(3) is State.UP and not rig.fo.in_flight()
    assert rig.routes.sets == [("h2", (0, 1))]

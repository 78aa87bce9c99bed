"""What the guests' ring all-reduce is judged by (pure): the plugin's lane lines, a rank's summary,
the ring's longest stall, and which queue pairs carried chunks on which path."""
from __future__ import annotations

import pytest

from linkpass.testbed.capture import UdpPacket
from linkpass.testbed.guest_ring import (busiest_port, data_paths, data_qps, lane_events, longest_gap_ms, move_cause,
                                         summary_of)


LOG = """\
[439.043799] NCCL INFO NET/LinkPass : lanes: 2 on its own plane + 1 standby on each other
[439.320326] NCCL INFO NET/LinkPass : lane 0.0 (QP 72, RoCE source port 49152) to 198.18.64.7 on plane 0 is up (a port from the entropy table)
[446.962412] NCCL INFO NET/LinkPass : lane 0.0 (QP 72, RoCE source port 49152) to 198.18.64.7 on plane 0 down: its source port 49152 left the entropy table's healthy set for 198.18.64.7 on plane 0; 1 chunks move to other lanes; retry in 0 ms
[447.227739] NCCL INFO NET/LinkPass : lane 0.0 (QP 79, RoCE source port 49153) to 198.18.64.7 on plane 0 is back (after: connect timed out)
[473.985000] NCCL INFO NET/LinkPass : lane 0.0 (QP 79, RoCE source port 49153) to 198.18.64.7 on plane 0 is re-made: spreading plane 0's lanes over its healthy paths again (port 49153 carries more); 0 chunks move to other lanes
NCCL INFO NET/LinkPass : lane 0.1 (sport 41233) to 127.0.0.1:4000 on plane 0 down: stuck
# rank 0: errors 0 wrong 0 iterations 379 lanes_down=2 lanes_up=9 table_moves=2 lane_kind=verbs chunks_plane0=1138
"""


def test_lane_lines_give_when_which_qp_and_port_did_what_and_why():
    ev = lane_events(LOG)
    assert [(e.what, e.qpn, e.sport) for e in ev] == [("is up", 72, 49152), ("down", 72, 49152),
                                                       ("is back", 79, 49153), ("is re-made", 79, 49153)]
    assert ev[1].t == pytest.approx(446.962412) and ev[1].plane == 0 and ev[1].lane == 0 and ev[1].peer == "198.18.64.7"
    assert ev[1].why.startswith("its source port 49152 left the entropy table's healthy set")
    assert ev[2].why == "after: connect timed out"
    assert move_cause(ev[1]) == "table"
    assert move_cause(ev[1].__class__(**{**ev[1].__dict__, "why": "stuck: no answer for 1001 ms"})) == "stuck"
    assert move_cause(ev[1].__class__(**{**ev[1].__dict__, "why": "QP 7 send failed: transport retry counter exceeded"})) == "qp-error"
    assert move_cause(ev[1].__class__(**{**ev[1].__dict__, "why": "closed by the peer"})) == "other"


def test_a_ranks_summary_line_with_the_plugins_counters():
    s = summary_of(LOG)
    assert s == {"rank": 0, "errors": 0, "wrong": 0, "iterations": 379, "lanes_down": 2, "lanes_up": 9,
                 "table_moves": 2, "lane_kind": "verbs", "chunks_plane0": 1138}
    assert summary_of("lp_allreduce: set-up failed") is None


def test_the_longest_stall_is_the_longest_gap_between_step_ends():
    steps = [{"step": i, "end_ns": t} for i, t in enumerate([0, 10**8, 2 * 10**8, 9 * 10**8, 10**9])] + [{"error": "x"}]
    assert longest_gap_ms(steps) == 700.0
    assert longest_gap_ms(steps, skip=3) == 100.0
    assert longest_gap_ms([]) == 0.0


def _p(ifname, sport, qpn, length=1100, opcode=0x01, t=1.0, src="198.18.64.1", dst="198.18.64.7"):
    return UdpPacket(ifname, src, dst, sport, 4791, length, True, qpn=qpn, t=t, opcode=opcode)


def test_data_paths_count_rc_chunks_per_path_and_qp_leaving_acks_probes_and_others_out():
    pk = [_p("s0", 49152, 32), _p("s0", 49152, 32), _p("s1", 49153, 38, t=5.0),
          _p("s0", 49152, 32, length=80),  # an ACK or a control frame
          _p("s0", 49152, 17, opcode=0x64),  # a LinkPass probe: a UD SEND, however large
          _p("s1", 49153, 40, src="198.18.72.1"),  # another plane's address
          _p("s1", 49153, 41, t=9.0)]  # after the window
    got = data_paths(pk, "198.18.64.1", "198.18.64.7", 0.0, 8.0)
    assert got == {("s0", 49152, 32): 2, ("s1", 49153, 38): 1}
    assert data_qps(got) == {32, 38} and data_qps(got, "s1") == {38}
    assert busiest_port(pk, "198.18.64.1", "198.18.64.7") == "s0"
    assert busiest_port([], "198.18.64.1", "198.18.64.7") is None


def _run(packets):
    from linkpass.testbed.guest_ring import RingRun
    return RingRun(rc=[0, 0], summary=[None, None], steps=[[], []], log=["", ""], packets=packets,
                   phases={"before": (0, 10), "fault": (10, 30), "healing": (30, 40), "after": (40, 50)})


ADDRS = {0: ("198.18.64.1", "198.18.64.7"), 1: ("198.18.72.1", "198.18.72.7")}


def test_the_wire_shows_a_spine_fault_moved_to_another_qp_and_back():
    from linkpass.testbed.guest_ring import wire_verdict
    good = [_p("s0", 49152, 32, t=5), _p("s1", 49153, 38, t=25), _p("s0", 49152, 43, t=45)]
    v = wire_verdict(_run(good), ADDRS, 0, "s0")
    assert v.moved and v.back, v.detail
    # still on the broken spine late in the fault: not moved; never back on it: not back
    v = wire_verdict(_run(good + [_p("s0", 49152, 32, t=26)]), ADDRS, 0, "s0")
    assert not v.moved and v.back
    v = wire_verdict(_run(good[:2]), ADDRS, 0, "s0")
    assert v.moved and not v.back
    # moved off the spine, but on a QP that already carried data: no new QP, so not shown to move
    v = wire_verdict(_run([_p("s0", 49152, 32, t=5), _p("s1", 49153, 38, t=6), _p("s1", 49153, 38, t=25)]),
                     ADDRS, 0, "s0")
    assert not v.moved


def test_the_wire_shows_an_uplink_fault_moved_to_the_other_planes_standby_qp_and_back():
    from linkpass.testbed.guest_ring import wire_verdict
    a1, b1 = ADDRS[1]
    pk = [_p("s1", 49153, 41, t=5, src=a1, dst=b1), _p("s0", 49152, 32, t=5),
          _p("s0", 49152, 35, t=25),  # plane 0's standby lane for plane 1's traffic
          _p("s1", 49153, 48, t=45, src=a1, dst=b1)]
    v = wire_verdict(_run(pk), ADDRS, 1, None)
    assert v.moved and v.back, v.detail
    v = wire_verdict(_run(pk + [_p("s1", 49153, 41, t=29, src=a1, dst=b1)]), ADDRS, 1, None)
    assert not v.moved

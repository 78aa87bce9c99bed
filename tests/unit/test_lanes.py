"""Lane reports (docs/lanes.md): the codec, the Python writer, the agent's reader with real files,
and the rates they give paths (the agent on the testbed following a job's lanes:
tests/root/test_lanes_testbed.py)."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

from linkpass.agent import lanes_reader as LR
from linkpass.core import lanes as L
from linkpass.core.activity import FUTURE_SLACK_NS as L_SLACK
from linkpass.core.activity import STALL_HOLD_NS
from linkpass.core.activity import ACTIVE, IDLE, PROGRESSING, STANDBY, Activity, LaneSeen, PathKey
from linkpass_rdma.lanes import KIND_TCP, KIND_VERBS, LaneReport

MS = 1_000_000


def report_bytes(*lanes: bytes, capacity: int = 4, used: int | None = None, heartbeat: int = 5) -> bytes:
    body = b"".join(lanes).ljust(L.LANE_SIZE * capacity, b"\0")
    return L.encode_header(capacity, 42, len(lanes) if used is None else used, heartbeat) + body


def test_the_codec_reads_open_lanes_and_skips_free_changing_and_unknown_ones():
    lanes = [L.encode_lane("198.18.64.3", 0, 49153, KIND_VERBS, bytes_sent=100, bytes_acked=60, progress_ns=7),
             L.encode_lane("198.18.64.5", 1, 0, KIND_TCP, state=L.STATE_FREE),
             L.encode_lane("fd00::3", 2, 0, KIND_TCP, seq=3),  # odd: its identity is being written
             L.encode_lane("198.18.64.7", 3, 0, 9),  # a kind this reader does not know
             L.encode_lane("fd00::5", 2, 7, KIND_TCP, bytes_sent=10, bytes_acked=99)]  # acked above sent
    buf = report_bytes(*lanes, capacity=8)
    got = L.decode_lanes(buf)
    assert [(x.slot, x.peer, x.plane, x.sport, x.kind) for x in got] == [
        (0, "198.18.64.3", 0, 49153, KIND_VERBS), (4, "fd00::5", 2, 7, KIND_TCP)]
    assert (got[0].bytes_sent, got[0].bytes_acked, got[0].progress_ns) == (100, 60, 7)
    assert got[1].bytes_acked == 10  # never above what was sent
    # a lane whose seq changed between the two reads is left for the next look
    live = bytearray(buf)
    live[L.HEADER_SIZE] += 2
    assert [x.slot for x in L.decode_lanes(buf, bytes(live))] == [4]
    # slots at or past `used` are not looked at
    assert L.decode_lanes(report_bytes(*lanes, capacity=8, used=1))[0].slot == 0
    assert len(L.decode_lanes(report_bytes(*lanes, capacity=8, used=1))) == 1


@pytest.mark.parametrize("damage, why", [
    (lambda b: b"XXXXXXXX" + b[8:], "magic"),
    (lambda b: b[:8] + (2).to_bytes(2, "little") + b[10:], "version 2"),
    (lambda b: b[:12] + (32).to_bytes(2, "little") + b[14:], "sizes 64/32"),
    (lambda b: b[:14] + (0).to_bytes(2, "little") + b[16:], "capacity 0"),
    (lambda b: b[:14] + (2000).to_bytes(2, "little") + b[16:], "capacity 2000"),
    (lambda b: b + bytes(64), "needs 320"),
    (lambda b: b[:40], "shorter than"),
])
def test_a_damaged_header_is_refused_with_what_is_wrong(damage, why):
    with pytest.raises(L.LanesBad, match=why):
        L.decode_lanes(damage(report_bytes()))


def test_progress_slows_a_path_a_stall_makes_it_active_and_quiet_lanes_are_standby():
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    verbs, other, plane1, far = PathKey("h1", 0, 49153), PathKey("h1", 0, 49154), PathKey("h1", 1, 49200), PathKey("h3", 0, 1)
    paths = {1: verbs, 2: other, 3: plane1, 4: far}
    now = 100 * MS
    act.saw_lanes([LaneSeen("h1", 0, 49153, now - MS, waiting=True)], now)  # bytes in flight, acked 1 ms ago
    act.update(paths, now)
    assert act.rate == {1: PROGRESSING, 2: STANDBY, 3: STANDBY, 4: IDLE}
    # acknowledgements stop while bytes wait: active at the look after the window runs out
    act.saw_lanes([LaneSeen("h1", 0, 49153, now - MS, waiting=True)], now + 3 * MS)
    assert act.update(paths, now + 3 * MS) == []  # 4 ms since the last acknowledgement: still within the window
    act.saw_lanes([LaneSeen("h1", 0, 49153, now - MS, waiting=True)], now + 6 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, now + 6 * MS)] == [(1, ACTIVE)]
    # progress again at once: the path stays active for the stall's hold, then slows again
    act.saw_lanes([LaneSeen("h1", 0, 49153, now + 7 * MS, waiting=True)], now + 7 * MS)
    assert act.update(paths, now + 7 * MS) == []
    act.saw_lanes([LaneSeen("h1", 0, 49153, now + 8 * MS, waiting=False)], now + 8 * MS)
    assert act.update(paths, now + 8 * MS) == []  # for the whole hold, whether bytes wait or not
    t = now + 6 * MS + STALL_HOLD_NS + MS
    act.saw_lanes([LaneSeen("h1", 0, 49153, t - MS, waiting=True)], t)
    assert [(c.path, c.rate) for c in act.update(paths, t)] == [(1, PROGRESSING)]
    now = t - 7 * MS  # the rest of the story, shifted
    # everything acknowledged, nothing waiting: quiet between transfers, standby
    act.saw_lanes([LaneSeen("h1", 0, 49153, now + 7 * MS, waiting=False)], now + 20 * MS)
    assert act.update(paths, now + 20 * MS)[0].rate == STANDBY
    # ... until idle_after passes without the lane carrying anything: the peer is idle again
    act.saw_lanes([LaneSeen("h1", 0, 49153, now + 7 * MS, waiting=False)], now + 1006 * MS)
    assert act.update(paths, now + 1006 * MS) == [] and act.rate[1] == STANDBY
    act.saw_lanes([], now + 1100 * MS)
    act.update(paths, now + 1100 * MS)
    assert set(act.rate.values()) == {IDLE}
    # a lane whose path the agent does not probe (a TCP lane, port 0) stands for its whole plane
    act.saw_lanes([LaneSeen("h1", 1, 0, now + 1200 * MS, waiting=True)], now + 1200 * MS)
    act.update(paths, now + 1200 * MS)
    assert act.rate == {1: STANDBY, 2: STANDBY, 3: PROGRESSING, 4: IDLE}


def test_a_report_cannot_claim_progress_from_the_future():
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    paths = {1: PathKey("h1", 0, 5)}
    act.saw_lanes([LaneSeen("h1", 0, 5, 10**18, waiting=True)], 100 * MS)  # "progressed" in a year
    act.update(paths, 100 * MS)
    assert act.rate[1] == ACTIVE  # bytes wait, and no believable progress
    # a write that raced the look by less than the slack counts as now (once the stall's hold is over)
    later = 100 * MS + STALL_HOLD_NS + MS
    act.saw_lanes([LaneSeen("h1", 0, 5, later + L_SLACK // 2, waiting=True)], later)
    act.update(paths, later)
    assert act.rate[1] == PROGRESSING


def progressing_lane(t: int) -> tuple[Activity, dict]:
    """Path 1's lane progressing at `t`: acknowledged 1 ms before its writer's look at `t`."""
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    paths = {1: PathKey("h1", 0, 7)}
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t)], t)
    act.update(paths, t)
    return act, paths


def test_a_stall_is_judged_on_the_writers_clock_and_a_silent_writer_gives_no_evidence():
    t = 100 * MS
    act, paths = progressing_lane(t)
    assert act.rate[1] == PROGRESSING
    # the writer is kept off the CPU: it has not looked since, so no stall yet, for up to 5 windows
    for later in (6 * MS, 12 * MS, 19 * MS):
        act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t)], t + later)
        assert act.update(paths, t + later) == [], later
    # ... then it gives no evidence either way: standby, as a path of a peer in use (the full rate
    # would take more CPU from a host that already keeps the writer off it), and no stall
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t)], t + 21 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 21 * MS)] == [(1, STANDBY)]
    assert not act.lane_stalled
    # back, with its bytes acknowledged meanwhile: progressing again
    act.saw_lanes([LaneSeen("h1", 0, 7, t + 22 * MS, waiting=True, looked_ns=t + 22 * MS)], t + 23 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 23 * MS)] == [(1, PROGRESSING)]

    act, paths = progressing_lane(t)
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t)], t + 30 * MS)
    assert act.update(paths, t + 30 * MS)[0].rate == STANDBY
    # back, and nothing was acknowledged while it was away: a stall at its first look
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t + 31 * MS)], t + 32 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 32 * MS)] == [(1, ACTIVE)] and act.lane_stalled

    act, paths = progressing_lane(t)
    # a writer that looks and sees nothing acknowledged for longer than the window: a stall at once
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t + 3 * MS)], t + 3 * MS)
    assert act.update(paths, t + 3 * MS) == []
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t + 3 * MS + MS // 2)], t + 4 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 4 * MS)] == [(1, ACTIVE)]


def test_a_tcp_lanes_own_sockets_do_not_outvote_its_report():
    """The socket sampler sees a TCP lane's traffic as TCP to the peer's plane address. While the
    lane's report is read, that traffic is the lane's: the report decides (a silent writer's path
    is standby, not active); once no lane reports the plane, TCP seen there makes its paths active."""
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    paths = {1: PathKey("h1", 1, 49200), 2: PathKey("h1", 0, 49153)}
    t = 100 * MS
    act.saw_planes([("h1", 1)], t)  # the lane's own bytes, as the sockets show them
    act.saw_lanes([LaneSeen("h1", 1, 0, t - MS, waiting=True, looked_ns=t)], t)
    act.update(paths, t)
    assert act.rate == {1: PROGRESSING, 2: STANDBY}
    # its writer kept off the CPU past five windows: no evidence, standby, however fresh the TCP
    act.saw_planes([("h1", 1)], t + 25 * MS)
    act.saw_lanes([LaneSeen("h1", 1, 0, t - MS, waiting=True, looked_ns=t)], t + 25 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 25 * MS)] == [(1, STANDBY)]
    # the report is gone and TCP still moves on the plane: unreported traffic, the full rate
    act.saw_lanes([], t + 30 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 30 * MS)] == [(1, ACTIVE)]


def test_a_transfer_after_a_quiet_spell_is_not_a_stall_until_its_own_window_runs_out():
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    paths = {1: PathKey("h1", 0, 7)}
    t = 100 * MS
    act.saw_lanes([LaneSeen("h1", 0, 7, t - 10 * MS, waiting=False, looked_ns=t)], t)
    act.update(paths, t)
    assert act.rate[1] == STANDBY  # everything acknowledged 10 ms ago: quiet between transfers
    # 20 ms later the job hands the lane its next chunk; nothing acknowledged since the last one
    act.saw_lanes([LaneSeen("h1", 0, 7, t - 10 * MS, waiting=True, looked_ns=t + 20 * MS)], t + 20 * MS)
    act.update(paths, t + 20 * MS)
    assert act.rate[1] == ACTIVE and not act.lane_stalled  # no evidence yet, so the full rate, but no stall
    act.saw_lanes([LaneSeen("h1", 0, 7, t + 21 * MS, waiting=True, looked_ns=t + 22 * MS)], t + 22 * MS)
    act.update(paths, t + 22 * MS)
    assert act.rate[1] == PROGRESSING  # its first acknowledgement: no stall hold keeps it active
    # the next chunk is not acknowledged within the window: that is a stall
    act.saw_lanes([LaneSeen("h1", 0, 7, t + 21 * MS, waiting=True, looked_ns=t + 27 * MS)], t + 27 * MS)
    act.update(paths, t + 27 * MS)
    assert act.rate[1] == ACTIVE and act.lane_stalled


def test_a_look_says_whether_any_lane_changed_what_it_gives_its_path():
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    t = 100 * MS
    assert act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=t)], t)  # a new lane
    # progressing on, a few acknowledgements later: nothing a path's rate depends on moved
    assert not act.saw_lanes([LaneSeen("h1", 0, 7, t + MS, waiting=True, looked_ns=t + 2 * MS)], t + 2 * MS)
    # ... nor did its chunk draining: a progressing lane's bytes wait and drain at every chunk
    assert not act.saw_lanes([LaneSeen("h1", 0, 7, t + 2 * MS, waiting=False, looked_ns=t + 3 * MS)], t + 3 * MS)
    # a second lane on the same path that does not progress changes nothing either: any lane counts
    assert not act.saw_lanes([LaneSeen("h1", 0, 7, t + 3 * MS, waiting=True, looked_ns=t + 4 * MS),
                              LaneSeen("h1", 0, 7, 0, waiting=False, looked_ns=t + 4 * MS)], t + 4 * MS)
    assert act.saw_lanes([LaneSeen("h1", 0, 7, t + 3 * MS, waiting=True, looked_ns=t + 9 * MS)], t + 9 * MS)  # stalled
    assert act.saw_lanes([LaneSeen("h1", 0, 7, t + 3 * MS, waiting=False, looked_ns=t + 10 * MS)], t + 10 * MS)  # drained
    assert act.saw_lanes([], t + 11 * MS)  # gone
    assert not act.saw_lanes([], t + 12 * MS)


def test_a_look_time_from_the_future_is_no_excuse_for_a_stall():
    t = 100 * MS
    act, paths = progressing_lane(t)
    # a heartbeat claimed in a year: judged on the reader's clock, stalled after the window
    act.saw_lanes([LaneSeen("h1", 0, 7, t - MS, waiting=True, looked_ns=10**18)], t + 6 * MS)
    assert [(c.path, c.rate) for c in act.update(paths, t + 6 * MS)] == [(1, ACTIVE)]


def test_the_python_writer_and_the_reader_agree(tmp_path):
    d = str(tmp_path / "lanes")
    reader = LR.LanesReader(d)
    assert os.stat(d).st_mode & 0o7777 == LR.DIR_MODE  # any job adds its own report, removes only its own
    with LaneReport.open(d, capacity=2) as rep:
        a = rep.claim("198.18.64.3", 0, 49153, KIND_VERBS)
        b = rep.claim("198.18.64.5", 1, 0, KIND_TCP)
        assert rep.claim("198.18.64.7", 2, 0, KIND_TCP) is None  # full: that lane goes unreported
        a.sent(4096)
        a.acked(1024)
        now = time.monotonic_ns()
        got = {x.slot: x for x in reader.look(now)}
        assert set(got) == {0, 1} and got[0].bytes_sent == 4096 and got[0].bytes_acked == 1024
        assert 0 < now - got[0].progress_ns < 10**9 and got[1].progress_ns == 0
        b.release()
        c = rep.claim("198.18.64.9", 3, 7, KIND_TCP)  # the freed slot, with its new identity and zero counts
        got = {x.slot: x for x in reader.look(now)}
        assert got[1].peer == "198.18.64.9" and got[1].bytes_sent == 0 and c.slot == 1
        assert reader.counts["reports_live"] == 1 and reader.counts["lanes"] == 2
        # a writer silent for a second is gone: its lanes are no evidence; after a minute its file goes
        assert reader.look(now + LR.STALE_NS + 10**8) == [] and reader.counts["reports_stale"] == 1
        assert reader.look(now + LR.REMOVE_NS + 10**9) == [] and reader.counts["removed"] == 1
        assert not os.path.exists(rep.path)
    reader.close()


def test_a_report_not_yet_beating_is_no_evidence_and_is_not_removed_at_once(tmp_path):
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    path = d / f"{L.FILE_PREFIX}{os.getpid() + 1}"
    path.write_bytes(report_bytes(L.encode_lane("198.18.64.3", 0, 49153, L.KIND_VERBS), heartbeat=0))
    now = time.monotonic_ns()
    assert reader.look(now) == [] and reader.counts["reports_stale"] == 1
    assert path.exists()  # its writer has yet to beat: a new job, not one dead for the clock's age
    assert reader.look(now + LR.REMOVE_NS) == [] and path.exists()
    assert reader.look(now + LR.REMOVE_NS + 1) == [] and not path.exists()  # a minute without a beat
    reader.close()


WRITER_LOOP = """
import sys, time
from linkpass_rdma.lanes import KIND_VERBS, LaneReport
rep = LaneReport.open(sys.argv[1], capacity=1)
lane = rep.claim("198.18.64.3", 0, 49153, KIND_VERBS)
print(rep.path, flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(100):
        lane.sent(1)
        lane.acked(1)
        rep.beat(force=True)
rep.close()
"""


def test_a_reader_in_another_process_never_sees_a_counter_or_heartbeat_half_written(tmp_path):
    """The agent reads a report while its writer stores into it: every counter and the heartbeat
    must read as the old value or the new one. A momentary 0 would read as a writer gone for good
    (the agent removes its file) or as a lane whose bytes were never acknowledged (a stall)."""
    d = tmp_path / "lanes"
    d.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER_LOOP, str(d), "1.5"], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        path = writer.stdout.readline().strip()
        assert path, "the writer did not start"
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        offs = {"heartbeat": L.OFF_HEARTBEAT, "sent": L.HEADER_SIZE + L.OFF_BYTES_SENT,
                "acked": L.HEADER_SIZE + L.OFF_BYTES_ACKED, "progress": L.HEADER_SIZE + L.OFF_PROGRESS}
        last, bad, reads = dict.fromkeys(offs, 0), [], 0
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline and writer.poll() is None:
            for name, off in offs.items():
                value = int.from_bytes(mm[off:off + 8], "little")
                if value < last[name]:
                    bad.append((name, last[name], value))
                last[name] = max(last[name], value)
            reads += 1
        mm.close()
    finally:
        writer.kill()
        writer.wait()
    assert reads > 10_000 and last["acked"] > 1000, (reads, last)  # both really ran side by side
    assert bad == [], f"{len(bad)} of {reads} looks saw a value go back, e.g. {bad[:3]}"


def test_the_reader_refuses_links_other_files_and_damaged_reports(tmp_path):
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    (d / "lanes.1").write_bytes(report_bytes()[:100])  # a size no report has
    (d / "lanes.2").symlink_to("/etc/passwd")
    os.mkfifo(d / "lanes.3")
    (d / "lanes.4").write_bytes(b"Z" * len(report_bytes()))  # bad magic
    (d / "lanes.5").write_bytes(report_bytes(L.encode_lane("198.18.64.3", 0, 0, KIND_TCP), heartbeat=time.monotonic_ns()))
    (d / "other").write_bytes(b"not a report name: not looked at")
    got = reader.look(time.monotonic_ns())
    assert [x.peer for x in got] == ["198.18.64.3"]
    assert set(reader.bad) == {"lanes.1", "lanes.2", "lanes.3", "lanes.4"}
    assert "needs 320" in reader.bad["lanes.1"] and "regular" in reader.bad["lanes.3"] and "magic" in reader.bad["lanes.4"]
    assert reader.counts["reports_bad"] == 4
    reader.close()


def test_no_directory_means_no_report_and_no_error(tmp_path, capsys):
    assert LaneReport.open(str(tmp_path / "missing")) is None
    assert "not reporting lanes" in capsys.readouterr().err

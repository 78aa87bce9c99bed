"""The probe core's lane watch (linkpass/probe/lane_watch.h): the loop reads the job's lane
reports and wakes the agent's Python loop only when what its rate rule (linkpass/core/activity.py)
reads from them changed, so a settled job's lanes cost no Python look every 2 ms. Checked against
that rule on random report histories, on hostile bytes, through the real loop on a real file, and
the agent's reader on a report its writer cuts short."""
from __future__ import annotations

import os
import random
import select
import time

import pytest

from linkpass.agent import lanes_reader as LR
from linkpass.core import lanes as L
from linkpass.core.activity import WRITER_SILENT_WINDOWS, Activity, LaneSeen
from linkpass.probe import _probecore
from linkpass_rdma.lanes import KIND_TCP, KIND_VERBS


MS = 1_000_000
WINDOW = 4 * MS
SILENT = WRITER_SILENT_WINDOWS * WINDOW
PEERS = ["198.18.64.3", "198.18.64.5", "fd00::7"]


def core():
    return _probecore.Core(b"k" * 32, 7)


class Writer:
    """A lane report's bytes as a writer changes them: lanes claimed, released, re-made on the
    same path, bytes handed over and acknowledged, looks (heartbeats) or silence."""

    def __init__(self, rng: random.Random, capacity: int = 4):
        self.rng, self.capacity = rng, capacity
        self.lanes: list[dict | None] = [None] * capacity
        self.seq = [0] * capacity
        self.heartbeat = 0
        self.used = 0

    def step(self, now: int) -> None:
        r, rng = self.rng.random(), self.rng
        slot = rng.randrange(self.capacity)
        lane = self.lanes[slot]
        if lane is None and r < 0.15:  # a lane opens (on a path an earlier lane may have had)
            self.seq[slot] += 2
            self.lanes[slot] = {"peer": rng.choice(PEERS), "plane": rng.randrange(2), "sport": rng.choice([0, 49152]),
                                "kind": rng.choice([KIND_TCP, KIND_VERBS]), "sent": 0, "acked": 0, "progress": 0}
            self.used = max(self.used, slot + 1)
        elif lane is not None and r < 0.03:  # it closes
            self.seq[slot] += 2
            self.lanes[slot] = None
        elif lane is not None and r < 0.45:  # bytes handed over
            lane["sent"] += rng.randrange(1, 5000)
        elif lane is not None and r < 0.8 and lane["acked"] < lane["sent"]:  # acknowledged
            lane["acked"] = rng.randint(lane["acked"] + 1, lane["sent"])
            lane["progress"] = now - rng.randrange(0, 300_000)
        if rng.random() < 0.7:  # the writer looks (else it is away, now and then for long)
            self.heartbeat = now - rng.randrange(0, 200_000)

    def bytes(self) -> bytes:
        body = b""
        for slot in range(self.capacity):
            lane = self.lanes[slot]
            if lane is None:
                body += L.encode_lane("198.18.0.1", 0, 0, KIND_TCP, seq=self.seq[slot], state=L.STATE_FREE)
            else:
                body += L.encode_lane(lane["peer"], lane["plane"], lane["sport"], lane["kind"], seq=self.seq[slot],
                                      bytes_sent=lane["sent"], bytes_acked=lane["acked"], progress_ns=lane["progress"])
        return L.encode_header(self.capacity, 42, self.used, self.heartbeat) + body


def seen(buf: bytes) -> list[LaneSeen]:
    return [LaneSeen(x.peer, x.plane, x.sport, x.progress_ns, x.bytes_acked < x.bytes_sent, x.looked_ns)
            for x in L.decode_lanes(buf)]


@pytest.mark.parametrize("seed", range(12))
def test_the_watch_wakes_the_agent_whenever_its_rule_would_see_the_lanes_change(seed):
    """Two agents follow one writer for thousands of looks: one looks every time (the rule's own
    truth), the other only when the watch's digest changed or its view is not settled. Whenever
    the truth's view of the lanes changes, the watched agent looks at that moment, and then sees
    exactly what the truth sees."""
    rng = random.Random(seed)
    writer, c = Writer(rng), core()
    truth, watched = Activity(2000 * MS, WINDOW), Activity(2000 * MS, WINDOW)
    now, last_digest, looks, changes = 10_000 * MS, None, 0, 0
    for _ in range(4000):
        now += rng.choice([200_000, 1 * MS, 2 * MS, 2 * MS, 7 * MS, 30 * MS])
        writer.step(now)
        buf = writer.bytes()
        digest = c.lane_digest(buf, now, WINDOW, SILENT)
        changed = truth.saw_lanes(seen(buf), now)
        changes += changed
        digest_changed = digest != last_digest
        wake = digest_changed or not watched.lanes_settled(now)
        last_digest = digest
        if changed:
            assert wake, (now, truth.lane_status, watched.lane_status)
        if wake:
            looks += 1
            if digest_changed:
                watched.unsettle(now)
            watched.saw_lanes(seen(buf), now)
            assert watched.lane_status == truth.lane_status, (now, truth.lane_status, watched.lane_status)
    assert changes > 50, changes  # the history really moved the rule
    assert looks < 4000, looks  # and the watch let the agent skip looks


def test_a_settled_progressing_lane_needs_no_look_until_it_stops():
    """The case the watch is for: a lane whose acknowledgements keep coming has the same digest
    look after look; the moment it stops with bytes waiting, the digest changes."""
    c, now = core(), 10_000 * MS
    digests = []
    for i in range(50):
        now += 2 * MS
        lane = L.encode_lane("198.18.64.3", 0, 49152, KIND_VERBS, bytes_sent=1000 * (i + 2), bytes_acked=1000 * (i + 1),
                             progress_ns=now - MS)
        digests.append(c.lane_digest(L.encode_header(1, 1, 1, now) + lane, now, WINDOW, SILENT))
    assert len(set(digests)) == 1
    stalled = L.encode_lane("198.18.64.3", 0, 49152, KIND_VERBS, bytes_sent=60_000, bytes_acked=50_000,
                            progress_ns=now - 2 * MS)
    now += 6 * MS
    assert c.lane_digest(L.encode_header(1, 1, 1, now) + stalled, now, WINDOW, SILENT) != digests[-1]


@pytest.mark.parametrize("buf", [
    b"", b"LPLANES1", b"\xff" * 64, b"\xff" * 5000,
    L.encode_header(4, 1, 4, 5),  # used lanes the bytes do not hold
    L.encode_header(1024, 1, 60_000, 5) + b"\xff" * 64,  # used far past the capacity
    L.encode_header(4, 1, 4, 5)[:14] + (60_000).to_bytes(2, "little") + bytes(48),  # capacity out of bounds
    L.encode_header(4, 1, 4, 2**63 + 5) + L.encode_lane("198.18.64.3", 0, 1, KIND_TCP, bytes_sent=2**64 - 1,
                                                        progress_ns=2**64 - 1) * 4,  # times no clock has
])
def test_hostile_report_bytes_give_a_digest_and_nothing_else(buf):
    c = core()
    d = c.lane_digest(buf, 10**12, WINDOW, SILENT)
    assert isinstance(d, int) and d == c.lane_digest(buf, 10**12, WINDOW, SILENT)


def test_the_loop_reads_a_real_report_wakes_python_on_a_change_and_survives_a_cut_file(tmp_path):
    path = tmp_path / "lanes.1"
    idle = L.encode_lane("198.18.64.3", 0, 49152, KIND_VERBS, bytes_sent=100, bytes_acked=100, progress_ns=1)
    path.write_bytes(L.encode_header(2, 1, 1, 1) + idle + bytes(L.LANE_SIZE))
    c = core()
    fd = os.open(path, os.O_RDONLY)
    try:
        c.watch_lanes([fd], WINDOW, SILENT)
    finally:
        os.close(fd)  # the core keeps its own descriptor
    c.run(10 * MS)
    assert c.lanes_changed() is True  # the first look tells what it sees
    assert select.select([c.fileno()], [], [], 0)[0], "the first look did not wake Python"
    os.read(c.fileno(), 8)
    c.run(10 * MS)
    assert c.lanes_changed() is False  # a silent writer's idle lane: nothing to say
    waiting = L.encode_lane("198.18.64.3", 0, 49152, KIND_VERBS, bytes_sent=900, bytes_acked=100, progress_ns=1)
    with open(path, "r+b") as f:
        f.seek(L.HEADER_SIZE)
        f.write(waiting)
    c.run(10 * MS)
    assert c.lanes_changed() is False  # bytes wait, but the writer is silent: no evidence either way
    with open(path, "r+b") as f:
        f.seek(L.OFF_HEARTBEAT)
        f.write((2**62).to_bytes(8, "little"))  # ahead of any clock: judged at the look, so not silent
    c.run(10 * MS)
    assert c.lanes_changed() is True
    os.truncate(path, 10)  # a writer cuts its file: a read, not a fault
    c.run(10 * MS)
    assert c.lanes_changed() is True
    looks = c.counters()["lane_looks"]
    assert looks >= 10, looks  # every half window while it ran (50 ms, 2 ms apart), not once per run
    c.watch_lanes([], WINDOW, SILENT)
    c.run(10 * MS)
    assert c.counters()["lane_looks"] == looks


def test_the_watch_refuses_bad_arguments():
    c = core()
    with pytest.raises(ValueError, match="window"):
        c.watch_lanes([], 10, SILENT)
    with pytest.raises(ValueError, match="silent"):
        c.watch_lanes([], WINDOW, WINDOW - 1)
    with pytest.raises(ValueError, match="at most"):
        c.watch_lanes([0] * 300, WINDOW, SILENT)
    with pytest.raises(OSError):
        c.watch_lanes([987654], WINDOW, SILENT)
    with pytest.raises(ValueError, match="-1 is not a file descriptor"):
        c.watch_lanes([-1], WINDOW, SILENT)


def test_the_reader_takes_a_report_cut_short_for_a_bad_one_not_a_crash(tmp_path):
    """A writer may truncate its file while the agent reads it: a mapping would fault and kill the
    agent; the reader reads, and counts the report as bad."""
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    path = d / "lanes.9"
    lane = L.encode_lane("198.18.64.3", 0, 0, KIND_TCP)
    path.write_bytes(L.encode_header(2, 9, 1, time.monotonic_ns()) + lane + bytes(L.LANE_SIZE))
    assert [x.peer for x in reader.look(time.monotonic_ns())] == ["198.18.64.3"]
    generation = reader.generation
    os.truncate(path, 40)
    assert reader.look(time.monotonic_ns()) == []
    assert "40 bytes" in reader.bad["lanes.9"] and reader.counts["reports_bad"] == 1
    assert reader.generation != generation and reader.fds() == []
    reader.close()

"""Lane reports from hostile local users: the lanes directory takes files from any job, so files
one user makes must neither hide another user's reports nor make the agent's reader or its probe
thread read without bound. Real files, the agent's reader and the probe core's watch (users
of their own: tests/root/test_lanes_hostile_users.py)."""
from __future__ import annotations

import os
import time

from linkpass.agent import lanes_reader as LR
from linkpass.core import lanes as L
from linkpass.probe import _probecore
from linkpass_rdma.lanes import KIND_TCP, KIND_VERBS

MS = 1_000_000
FULL = L.MAX_CAPACITY  # a full-size report: 64 KiB of lanes


def report(path, lanes: int, heartbeat: int, capacity: int = 4, peer: str = "198.18.64.3") -> None:
    body = b"".join(L.encode_lane(peer, 0, 49152 + k % 1000, KIND_VERBS, bytes_sent=10, bytes_acked=10,
                                  progress_ns=heartbeat) for k in range(lanes))
    path.write_bytes(L.encode_header(capacity, 1, lanes, heartbeat) + body.ljust(L.LANE_SIZE * capacity, b"\0"))


class ReadBytes:
    """os.pread counted, for the reader's look."""

    def __init__(self, monkeypatch):
        self.n, real = 0, os.pread

        def pread(fd, size, off):
            out = real(fd, size, off)
            self.n += len(out)
            return out

        monkeypatch.setattr(LR.os, "pread", pread)


def test_silent_files_named_to_sort_first_do_not_hide_a_live_report(tmp_path):
    """Dead writers' files (or junk with a heartbeat long past), more than the reader holds and
    named to come first: none is taken for a live report, and the live one is read."""
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    now = time.monotonic_ns()
    for k in range(LR.MAX_FILES + 50):
        report(d / f"lanes.0{k:05d}", 1, heartbeat=now - 5 * LR.STALE_NS, peer="198.18.64.9")
    report(d / "lanes.zzz", 1, heartbeat=now)
    got = reader.look(now)
    assert [x.peer for x in got] == ["198.18.64.3"]
    assert len(reader.reports) == 1 and reader.counts["reports_live"] == 1
    reader.close()


def test_a_look_reads_a_bounded_number_of_bytes_and_still_reaches_every_report(tmp_path, monkeypatch):
    """Full-size live reports: one look reads at most LOOK_BYTES of lanes (plus each report's
    header); the reports it had no room for keep their last lanes and are read by the next looks."""
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    now = time.monotonic_ns()
    files = LR.PER_OWNER + 10
    for k in range(files):
        report(d / f"lanes.{k}", FULL, heartbeat=now + 10**12, capacity=FULL)
    counted = ReadBytes(monkeypatch)
    looks_needed = -(-LR.PER_OWNER * FULL * L.LANE_SIZE * 2 // LR.LOOK_BYTES)
    for look in range(looks_needed + 1):
        counted.n = 0
        got = reader.look(now)
        # headers: every file's at the scan, then each open report's, and one per copy read
        assert counted.n <= LR.LOOK_BYTES + L.HEADER_SIZE * (files + 3 * len(reader.reports)), (look, counted.n)
    assert len(reader.reports) == LR.PER_OWNER
    assert len(got) == LR.PER_OWNER * FULL  # every report read by now, none twice in one look
    assert reader.counts["reports_deferred"] > 0
    reader.close()


def test_the_probe_thread_s_look_is_bounded_and_still_sees_a_change_in_the_last_report(tmp_path):
    """The probe core's watch over full-size live reports: a look reads at most LW_LOOK_BYTES of
    lanes (the rest deferred, counted) and a change in any report still wakes Python."""
    paths = []
    now = time.monotonic_ns()
    for k in range(40):
        p = tmp_path / f"lanes.{k}"
        report(p, FULL, heartbeat=now + 10**12, capacity=FULL)
        paths.append(p)
    c = _probecore.Core(b"k" * 32, 7)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        c.watch_lanes(fds, 4 * MS, 12 * MS)
    finally:
        for fd in fds:
            os.close(fd)
    c.run(100 * MS)
    c.lanes_changed()
    assert c.counters()["lane_deferred"] > 0
    c.run(100 * MS)
    assert c.lanes_changed() is False  # every report read at least once: the digest settled
    lane = L.encode_lane("198.18.64.3", 0, 49152, KIND_TCP, bytes_sent=900, bytes_acked=100, progress_ns=1)
    with open(paths[-1], "r+b") as f:  # bytes wait on the last report's last lane
        f.seek(L.HEADER_SIZE + (FULL - 1) * L.LANE_SIZE)
        f.write(lane)
    c.run(100 * MS)
    assert c.lanes_changed() is True


def test_a_planted_file_in_the_writer_s_place_leaves_the_job_unreported_not_failed(tmp_path, capsys):
    """Someone put something the writer cannot replace where its report goes (another user's
    file in the sticky directory; here a directory): the job runs on, unreported, and says so."""
    from linkpass_rdma.lanes import LaneReport

    d = tmp_path / "lanes"
    d.mkdir()
    (d / f"{L.FILE_PREFIX}{os.getpid()}").mkdir()
    assert LaneReport.open(str(d)) is None
    assert "not reporting lanes" in capsys.readouterr().err


def test_a_scan_tries_a_bounded_number_of_files_and_silent_ones_last(tmp_path, monkeypatch):
    """Thousands of silent files: a scan opens at most MAX_OPENS of them, and a live report
    among them is found within a few scans, however it is named."""
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    now = time.monotonic_ns()
    for k in range(2000):
        report(d / f"lanes.0{k:05d}", 1, heartbeat=now - 5 * LR.STALE_NS, peer="198.18.64.9")
    report(d / "lanes.zzz", 1, heartbeat=now + 10**12)
    opened = []
    real = LR.os.open
    monkeypatch.setattr(LR.os, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    found_at = None
    for scan in range(8):
        opened.clear()
        got = reader.look(now + scan * LR.RESCAN_NS)
        assert len(opened) <= LR.MAX_OPENS
        if got and found_at is None:
            found_at = scan
    assert found_at is not None and found_at <= 2000 // LR.MAX_OPENS + 1
    reader.close()

"""The NCCL plugin's lane report (docs/lanes.md), read with the agent's codec while the harness
moves data over two loopback planes: one open lane per send lane, naming its plane and the peer's
address there; acknowledged bytes that add up to the bytes moved; a fresh heartbeat; slots given
back and taken again when lanes are re-made; the file gone when the process ends. Without a lanes
directory the job runs exactly as before."""
from __future__ import annotations

import struct
import threading
import time

import pytest

from support.nccl import harness_fields, HarnessRun, nccl_harness
from support.waiting import wait_until

from linkpass.core import lanes as L


MiB = 1 << 20
ENV = {"LINKPASS_LANES": "4", "LINKPASS_STANDBY_LANES": "1",
       "LINKPASS_STUCK_MS": "2000"}  # a busy 2-core host must not re-make lanes by itself here


def read(path):
    """(header, lanes, {slot: seq}) of the report, as the agent reads it; None while absent (or
    for the microseconds between its creation and its header)."""
    try:
        with open(path, "rb") as f:
            copy = f.read()
        with open(path, "rb") as f:
            live = f.read()
        head = L.decode_header(copy, len(copy))
        lanes = L.decode_lanes(copy, live)
    except (FileNotFoundError, L.LanesBad):
        return None
    seqs = {ln.slot: struct.unpack_from("<I", copy, L.HEADER_SIZE + ln.slot * L.LANE_SIZE + L.OFF_SEQ)[0]
            for ln in lanes}
    return head, lanes, seqs


class Sampler:
    """Reads the report every few ms until stopped and keeps each lane's highest counters, keyed by
    its identity (slot, seq): a lane given back keeps what it counted."""

    def __init__(self, path):
        self.path, self.best, self.reads = path, {}, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            got = read(self.path)
            if got:
                self.reads += 1
                for ln in got[1]:
                    key = (ln.slot, got[2][ln.slot])
                    old = self.best.get(key)
                    if old is None or ln.bytes_acked > old.bytes_acked:
                        self.best[key] = ln
            time.sleep(0.003)

    def acked(self) -> int:
        return sum(ln.bytes_acked for ln in list(self.best.values()))

    def stop(self):
        self._stop.set()
        self._t.join(timeout=10)


def test_lanes_are_reported_with_their_paths_and_acknowledged_bytes_and_removed_at_exit(tmp_path):
    d = tmp_path / "lanes"
    d.mkdir()
    run = HarnessRun(tmp_path, "-s", "1M", "-w", "8", "-B", env={**ENV, "LINKPASS_LANES_DIR": str(d)})
    path = d / f"lanes.{run.proc.pid}"
    sampler = None
    try:
        got = wait_until(lambda: (r := read(path)) and len(r[1]) == 5 and r, 30, f"5 lanes in {path}",
                         lambda: f"{read(path)}\n{run.log[-2000:]}")
        head, lanes, _ = got
        assert head.pid == run.proc.pid and head.capacity >= 5 and head.used >= 5
        assert path.stat().st_mode & 0o777 == 0o644
        by_plane = {}
        for ln in lanes:
            assert (ln.family, ln.kind, ln.sport) == (4, L.KIND_TCP, 0), ln  # a TCP lane: the kernel's ports
            by_plane.setdefault(ln.plane, []).append(ln.peer)
        assert by_plane == {0: ["127.0.0.1"] * 4, 1: ["127.0.0.2"]}
        assert "lane reports: " + str(path) in run.log

        sampler = Sampler(path)
        wait_until(lambda: sampler.acked() >= 128 * MiB, 60, "128 MiB acknowledged in the report",
                   lambda: f"{sampler.acked()} bytes after {sampler.reads} reads\n{run.log[-2000:]}")
        h1, lanes1, _ = read(path)
        now = time.monotonic_ns()  # the writer's CLOCK_MONOTONIC
        assert 0 <= now - h1.heartbeat_ns < 1_000_000_000
        assert 0 <= now - max(ln.progress_ns for ln in lanes1) < 1_000_000_000, lanes1
        assert all(ln.bytes_acked <= ln.bytes_sent for ln in lanes1)
        acked1 = sum(ln.bytes_acked for ln in lanes1)
        time.sleep(0.3)
        h2, lanes2, _ = read(path)
        assert h2.heartbeat_ns - h1.heartbeat_ns >= 100_000_000  # written while the job runs, not once
        assert sum(ln.bytes_acked for ln in lanes2) > acked1
    finally:
        rc, out, err = run.stop()
        if sampler:
            sampler.stop()
    assert rc == 0, f"{out}\n{err[-3000:]}"
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == t["recv_done"]
    assert s["lanes_down"] == "0", "a lane was re-made: its last bytes may be missing from the report"
    moved = int(t["bytes"])
    # each chunk's ACK is counted once, on the lane that carried it; what the samples can miss is
    # the last few ms before the lanes close (at most the 8 messages in flight, and one look)
    assert moved - 32 * MiB <= sampler.acked() <= moved, (sampler.acked(), moved)
    assert not path.exists() and list(d.iterdir()) == []


def test_a_lane_re_made_gives_its_slot_back_and_takes_one_again(tmp_path):
    """Lanes reset mid-transfer: each goes down (its slot is freed) and comes back (a slot again,
    its identity written anew): the report keeps exactly the 5 live lanes in the first slots."""
    d = tmp_path / "lanes"
    d.mkdir()
    run = HarnessRun(tmp_path, "-s", "8M", "-k", "30:3", "-t", env={**ENV, "LINKPASS_LANES_DIR": str(d)})
    path = d / f"lanes.{run.proc.pid}"
    try:
        run.wait_for("is back (after:", times=3)
        head, lanes, seqs = wait_until(lambda: (r := read(path)) and len(r[1]) == 5 and r, 30, "5 lanes again",
                                       lambda: f"{read(path)}\n{run.log[-2000:]}")
        assert head.used <= 6 and sorted(ln.slot for ln in lanes) == sorted(set(ln.slot for ln in lanes))
        assert max(seqs.values()) >= 6, seqs  # claimed, given back, claimed again: seq 2 -> 4 -> 6
        assert {(ln.plane, ln.peer) for ln in lanes} == {(0, "127.0.0.1"), (1, "127.0.0.2")}
    finally:
        rc, out, err = run.stop()
    assert rc == 0, f"{out}\n{err[-3000:]}"
    assert not path.exists()


@pytest.mark.parametrize("version", [8, 12])
def test_the_report_is_removed_when_the_process_ends(tmp_path, version):
    """v12 closes it once every context is finalized and the comms are gone; v8 has no finalize,
    so at exit."""
    r = nccl_harness("-v", str(version), "transfer", "-s", "1M", "-n", "20", env={"LINKPASS_LANES_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"lane reports: {tmp_path}/lanes." in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_without_a_lanes_directory_the_job_runs_as_before_and_says_so_once(tmp_path):
    missing = tmp_path / "missing"
    r = nccl_harness("transfer", "-s", "1,524289,3M", "-n", "10", env={"LINKPASS_LANES_DIR": str(missing)})
    assert r.returncode == 0, r.stderr[-3000:]
    t = harness_fields(r.stdout, "transfer")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["send_done"] == t["recv_done"] == t["messages"] == "30"
    said = [line for line in r.stderr.splitlines() if "lane reports:" in line]
    assert len(said) == 1 and "not written" in said[0] and "runs as before" in said[0], said
    assert not missing.exists()

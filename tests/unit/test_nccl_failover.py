"""The NCCL plugin under lane failures, in one process on two loopback planes: lanes reset with
data in flight still deliver every byte exactly once with no error; the entropy table moves
traffic off a plane; only when every lane of every plane is gone past the give-up bound does
NCCL get an error, once, with a message naming peer, planes, lanes and causes."""
from __future__ import annotations

import os
import re
import time

import pytest

from support.nccl import harness_fields, HarnessRun, nccl_harness

from linkpass.agent.entropy_writer import EntropyWriter
from linkpass.core.entropy_table import ENTRY_FAIL_STATIC


def test_lanes_reset_mid_transfer_deliver_every_byte_once_without_an_error(tmp_path):
    """Five resets of the lane with the most bytes in flight (both ends' queued bytes are lost): the
    unacknowledged chunks leave on other lanes, every message arrives whole and once, test() never
    returns an error, and each reset lane comes back on a fresh source port."""
    run = HarnessRun(tmp_path, "-s", "8M", "-k", "30:5", "-t")
    try:
        run.wait_for("lp_harness: reset lane", times=5)
        run.wait_for("is back (after:", times=5)
    finally:
        rc, out, err = run.stop()
    assert rc == 0, f"{out}\n{err[-3000:]}"
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == t["recv_done"]
    assert t["lanes_killed"] == "5" and int(s["lanes_down"]) >= 5
    assert int(s["chunks_resent"]) > 0, "no reset caught data in flight: the test proved nothing"
    assert "error" not in out
    downs = re.findall(r"lane (\d+\.\d+) \(sport (\d+)\) .* down: ", err)
    backs = dict((lane, int(port)) for lane, port in re.findall(r"lane (\d+\.\d+) \(sport (\d+)\) .* is back", err))
    assert downs and all(int(port) != backs.get(lane) for lane, port in downs if lane in backs)


def test_every_lane_gone_past_the_give_up_bound_is_one_clean_error():
    """The peer is gone (every lane and listener shut down): reconnects are refused; after
    LINKPASS_GIVEUP_MS the plugin returns ncclSystemError, and WARNs what it tried and why it failed."""
    r = nccl_harness("transfer", "-s", "8M", "-n", "400", "-K", "200", "-t", env={"LINKPASS_GIVEUP_MS": "1000"})
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
    errs = [line for line in r.stdout.splitlines() if line.startswith("side_error ")]
    assert sorted(e.split()[1] for e in errs) == ["side=recv", "side=send"], r.stdout  # one per comm
    side = {e.split()[1]: dict(kv.split("=") for kv in e.split()[1:]) for e in errs}
    assert side["side=send"]["rc"] == side["side=recv"]["rc"] == "2", r.stdout  # ncclSystemError
    # the sender's lanes died at the cut: not before the bound. (The receiver counts from the last
    # bytes it got, which may come a ping interval or more before the cut on a loaded host.)
    assert int(side["side=send"]["after_ms"]) >= 900, r.stdout
    warn = [line for line in r.stderr.splitlines() if "NCCL WARN" in line and "send to 127.0.0.1 failed" in line]
    assert len(warn) == 1, r.stderr[-3000:]
    assert "no lane could carry data for" in warn[0] and "(LINKPASS_GIVEUP_MS)" in warn[0]
    assert "plane 0 (127.0.0.1 -> 127.0.0.1:" in warn[0] and "plane 1 (127.0.0.2 -> 127.0.0.2:" in warn[0]
    assert "lane 0 [connect: Connection refused]" in warn[0] and "lane 4 [connect: Connection refused]" in warn[0]
    assert sum("NCCL WARN" in line and "receive from 127.0.0.1 failed: no lane" in line
               for line in r.stderr.splitlines()) == 1
    assert harness_fields(r.stdout, "transfer")["wrong"] == "0"


def test_no_error_before_the_give_up_bound_while_lanes_are_being_remade(tmp_path):
    """Resets of every lane, one after another, never leave NCCL with an error: lanes are re-made."""
    run = HarnessRun(tmp_path, "-s", "4M", "-k", "20:12", "-t", env={"LINKPASS_LANES": "2"})
    try:
        run.wait_for("lp_harness: reset lane", times=12)
    finally:
        rc, out, err = run.stop()
    assert rc == 0, f"{out}\n{err[-3000:]}"
    t = harness_fields(out, "transfer")
    assert t["wrong"] == "0" and t["lanes_killed"] == "12" and t["messages"] == t["recv_done"] == t["send_done"]


@pytest.fixture
def table(tmp_path):
    w = EntropyWriter(str(tmp_path / "entropy"), capacity=16)
    yield w
    w.close(unlink=True)


def test_the_entropy_table_moves_traffic_off_a_plane_it_marks_unusable(table):
    """(127.0.0.1, plane 0) fail-static in the agent's table: the comm on device 0 carries nothing on
    plane 0 and says so; the data is whole."""
    table.update("127.0.0.1", 0, [50000, 50001], flags=ENTRY_FAIL_STATIC)
    table.update("127.0.0.2", 1, [50002], port_flags=[1])
    r = nccl_harness("transfer", "-s", "2M", "-n", "10", env={"LINKPASS_ENTROPY_TABLE": table.path})
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
    s = harness_fields(r.stdout, "stats")
    assert s["chunks_plane0"] == "0" and int(s["chunks_plane1"]) >= 40, r.stdout
    assert "plane 0 to 127.0.0.1: the entropy table marks it unusable (fail-static)" in r.stderr
    assert "traffic to 127.0.0.1 moves from plane 0 (127.0.0.1) to plane 1 (127.0.0.2)" in r.stderr
    assert harness_fields(r.stdout, "transfer")["wrong"] == "0"


def test_a_plane_the_table_knows_healthy_keeps_its_traffic(table):
    table.update("127.0.0.1", 0, [50000], port_flags=[1])
    table.update("127.0.0.2", 1, [], flags=0)  # no healthy port on plane 1: only the standby is affected
    r = nccl_harness("transfer", "-s", "2M", "-n", "10", env={"LINKPASS_ENTROPY_TABLE": table.path})
    assert r.returncode == 0, r.stderr[-3000:]
    s = harness_fields(r.stdout, "stats")
    assert int(s["chunks_plane0"]) >= 40 and s["chunks_plane1"] == "0", r.stdout
    assert "moves from plane" not in r.stderr


def test_every_plane_marked_unusable_still_carries_the_data(table):
    """The table never stops traffic: with both planes fail-static, a live lane is used anyway."""
    table.update("127.0.0.1", 0, [50000], flags=ENTRY_FAIL_STATIC)
    table.update("127.0.0.2", 1, [50001], flags=ENTRY_FAIL_STATIC)
    r = nccl_harness("transfer", "-s", "1M", "-n", "10", env={"LINKPASS_ENTROPY_TABLE": table.path})
    assert r.returncode == 0, r.stderr[-3000:]
    t = harness_fields(r.stdout, "transfer")
    assert t["wrong"] == "0" and t["messages"] == "10"


def test_traffic_leaves_a_plane_the_table_marks_mid_transfer_and_returns_when_it_clears(table, tmp_path):
    """The agent marks (peer, plane 0) fail-static while data flows: the next progress pass moves
    the traffic to plane 1; when the mark clears, it comes back to plane 0. Nothing lost, no error."""
    table.update("127.0.0.1", 0, [50000], port_flags=[1])
    run = HarnessRun(tmp_path, "-s", "1M", env={"LINKPASS_ENTROPY_TABLE": table.path})
    try:
        run.wait_for("steering lanes by it")
        time.sleep(0.3)
        table.update("127.0.0.1", 0, [50000], flags=ENTRY_FAIL_STATIC)
        run.wait_for("moves from plane 0 (127.0.0.1) to plane 1 (127.0.0.2)")
        time.sleep(0.3)
        table.update("127.0.0.1", 0, [50000], port_flags=[1])
        run.wait_for("to plane 0 (127.0.0.1): its own plane is usable again")
        time.sleep(0.3)
    finally:
        rc, out, err = run.stop()
    assert rc == 0, f"{out}\n{err[-3000:]}"
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["send_done"] == t["recv_done"] == t["messages"]
    assert int(s["chunks_plane0"]) > 0 and int(s["chunks_plane1"]) > 0
    assert "plane 0 to 127.0.0.1: the entropy table marks it usable again" in err


def test_a_table_others_could_have_written_is_not_steered_by(table):
    """Its ports and marks would steer this host's traffic: a group/world-writable table is not
    read (the log says why), so its fail-static mark on plane 0 moves nothing."""
    table.update("127.0.0.1", 0, [50000, 50001], flags=ENTRY_FAIL_STATIC)
    os.chmod(table.path, 0o666)
    r = nccl_harness("transfer", "-s", "2M", "-n", "10", env={"LINKPASS_ENTROPY_TABLE": table.path})
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
    assert "can be written by its group or others (mode 0666)" in r.stderr and "not used" in r.stderr, r.stderr[-3000:]
    s = harness_fields(r.stdout, "stats")
    assert int(s["chunks_plane0"]) >= 40 and s["chunks_plane1"] == "0", r.stdout

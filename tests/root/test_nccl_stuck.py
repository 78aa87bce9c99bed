"""The NCCL plugin alone (no agent) when a plane goes silent: no reset, no error, packets simply
vanish. In a network namespace of its own, plane 0 (127.0.0.1) is black-holed with nft mid-transfer
and later healed: its lanes are judged stuck from their own silence, the traffic moves to plane 1's
standby lane with nothing lost or duplicated, and comes back to plane 0 once its lanes are re-made."""
from __future__ import annotations

import subprocess
import time

import pytest

from support.nccl import harness_fields, HarnessRun
from support.testbed import prefix_for


# plane 0 (127.0.0.1 -> 127.0.0.1) black-holed: TCP simply vanishes, no reset
BLACK_HOLE = ("add table inet lpnccl; add chain inet lpnccl out { type filter hook output priority 0 ; } ; "
              "add rule inet lpnccl out ip saddr 127.0.0.1 ip daddr 127.0.0.1 meta l4proto tcp drop")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def netns():
    name = f"{prefix_for('n')}-nccl"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_silent_plane_is_left_and_rejoined_without_an_error(netns, tmp_path):
    run = HarnessRun(tmp_path, "-s", "4M", "-t", env={"LINKPASS_LANES": "2"}, netns=netns)
    try:
        run.wait_for("listening on port")
        time.sleep(0.5)  # data flows on plane 0
        sh("ip", "netns", "exec", netns, "nft", BLACK_HOLE)
        run.wait_for("traffic to 127.0.0.1 moves from plane 0 (127.0.0.1) to plane 1 (127.0.0.2)")
        time.sleep(1.0)  # plane 0's lanes try to come back into the black hole, and fail
        sh("ip", "netns", "exec", netns, "nft", "delete table inet lpnccl")
        run.wait_for("moves from plane 1 (127.0.0.2) to plane 0 (127.0.0.1): its own plane is usable again")
        time.sleep(0.3)
    finally:
        subprocess.run(["ip", "netns", "exec", netns, "nft", "delete table inet lpnccl"], capture_output=True)
        rc, out, err = run.stop()
    assert rc == 0, f"{out}\n{err[-4000:]}"
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == t["recv_done"], out
    assert "error" not in out
    assert "down: stuck: no answer for" in err, err[-4000:]
    assert int(s["chunks_plane1"]) > 0 and int(s["chunks_resent"]) > 0, out


def test_the_entropy_tables_mark_moves_a_silent_planes_chunks_before_the_stuck_bound(netns, tmp_path):
    """The agent's verdict is faster than the plugin's own: plane 0 black-holed, then marked
    fail-static in the table while the lanes' stuck bound is 30 s. The chunks its lanes owe leave
    for plane 1 on the mark (the log says the table moved them), not 30 s later; nothing is lost."""
    from linkpass.agent.entropy_writer import EntropyWriter
    from linkpass.core.entropy_table import ENTRY_FAIL_STATIC

    table = EntropyWriter(str(tmp_path / "entropy"), capacity=16)
    table.update("127.0.0.1", 0, [50000], port_flags=[1])
    run = HarnessRun(tmp_path, "-s", "4M", "-t", netns=netns,
                     env={"LINKPASS_LANES": "2", "LINKPASS_STUCK_MS": "30000", "LINKPASS_ENTROPY_TABLE": table.path})
    try:
        run.wait_for("steering lanes by it")
        time.sleep(0.5)  # data flows on plane 0
        sh("ip", "netns", "exec", netns, "nft", BLACK_HOLE)
        time.sleep(0.2)  # chunks written into the black hole wait for ACKs that never come
        table.update("127.0.0.1", 0, [50000], flags=ENTRY_FAIL_STATIC)
        # within 20 s, far inside the 30 s stuck bound: the mark, not the silence, moves them
        run.wait_for("down: the entropy table marks plane 0 to the peer unusable", timeout_s=20)
        sh("ip", "netns", "exec", netns, "nft", "delete table inet lpnccl")
        table.update("127.0.0.1", 0, [50000], port_flags=[1])
        run.wait_for("its own plane is usable again")
    finally:
        subprocess.run(["ip", "netns", "exec", netns, "nft", "delete table inet lpnccl"], capture_output=True)
        rc, out, err = run.stop()
        table.close(unlink=True)
    assert rc == 0, f"{out}\n{err[-4000:]}"
    assert "down: stuck" not in err, err[-4000:]
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == t["recv_done"], out
    assert int(s["chunks_resent"]) > 0 and int(s["chunks_plane1"]) > 0, out

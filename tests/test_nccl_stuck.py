"""The NCCL plugin alone (no agent) when a plane goes silent: no reset, no error, packets simply
vanish. In a network namespace of its own, plane 0 (127.0.0.1) is black-holed with nft mid-transfer
and later healed: its lanes are judged stuck from their own silence, the traffic moves to plane 1's
standby lane with nothing lost or duplicated, and comes back to plane 0 once its lanes are re-made."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from helpers import harness_fields, nccl_build, prefix_for

pytestmark = pytest.mark.root


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


def test_a_silent_plane_is_left_and_rejoined_without_an_error(netns):
    plugin, harness = nccl_build()
    env = dict(os.environ, LINKPASS_NICS="127.0.0.1,127.0.0.2", LINKPASS_ENTROPY_TABLE="/nonexistent/entropy",
               LINKPASS_LANES="2")
    proc = subprocess.Popen(["ip", "netns", "exec", netns, harness, "-l", plugin, "transfer", "-s", "4M", "-n", "400",
                             "-t", "-T", "120"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.7)
        sh("ip", "netns", "exec", netns, "nft", "add table inet lpnccl; add chain inet lpnccl out "
           "{ type filter hook output priority 0 ; } ; add rule inet lpnccl out ip saddr 127.0.0.1 ip daddr 127.0.0.1 "
           "meta l4proto tcp drop")
        time.sleep(2.0)
        sh("ip", "netns", "exec", netns, "nft", "delete table inet lpnccl")
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{out}\n{err[-4000:]}"
    t, s = harness_fields(out, "transfer"), harness_fields(out, "stats")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == "400", out
    assert "error" not in out
    assert "down: stuck: no answer for" in err, err[-4000:]
    assert "traffic to 127.0.0.1 moves from plane 0 (127.0.0.1) to plane 1 (127.0.0.2)" in err
    assert "moves from plane 1 (127.0.0.2) to plane 0 (127.0.0.1): its own plane is usable again" in err
    assert int(s["chunks_plane1"]) > 0 and int(s["chunks_resent"]) > 0, out

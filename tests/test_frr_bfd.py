"""The BFD peer on the testbed: FRR bfdd sessions host to host at 10 ms × 3 detect a host-uplink
cut, and everything is removed afterwards. (The comparison itself is a benchmark.)"""
from __future__ import annotations

import os
import time

import pytest

from linkpass.testbed import faults, frr
from linkpass.testbed.faults import FaultSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(not frr.available(), reason="FRR not installed (deploy/install-os-deps.sh installs it)")]


def test_bfd_detects_an_uplink_cut_and_cleans_up(clean_faults):
    fab = clean_faults
    bfd = frr.Bfd(fab, [0, 3])
    try:
        bfd.start([(0, 3, 0)])
        assert bfd.session_states(0) == {fab.nic_addr(3, 0): "up"}
        rec = faults.apply(fab.prefix, FaultSpec("down", "h0-p0l0"))
        time.sleep(0.5)
        fault_wall = int(time.time_ns() - (time.monotonic_ns() - rec["effective_mono_ns"]))
        downs = [c for c in bfd.changes(0) if c.new == "down" and c.wall_ns >= fault_wall - 5_000_000]
        assert downs, bfd.changes(0)
        detect_ms = (downs[0].wall_ns - fault_wall) / 1e6
        assert 5 <= detect_ms <= 100, detect_ms  # 10 ms × 3, give or take a phase and a slow VM
    finally:
        faults.clear(fab.prefix)
        bfd.stop()
    for h in (0, 3):
        assert not any(os.path.exists(d) for d in bfd._dirs(h))

"""Lane reports from hostile local users, as real users: one user's files do not crowd out another
user's report (the reader's bounds: tests/unit/test_lanes_hostile.py)."""
from __future__ import annotations

import os
import time

from linkpass.agent import lanes_reader as LR
from linkpass.core import lanes as L
from linkpass_rdma.lanes import KIND_VERBS


def report(path, lanes: int, heartbeat: int, capacity: int = 4, peer: str = "198.18.64.3") -> None:
    body = b"".join(L.encode_lane(peer, 0, 49152 + k % 1000, KIND_VERBS, bytes_sent=10, bytes_acked=10,
                                  progress_ns=heartbeat) for k in range(lanes))
    path.write_bytes(L.encode_header(capacity, 1, lanes, heartbeat) + body.ljust(L.LANE_SIZE * capacity, b"\0"))


def test_one_user_s_files_do_not_crowd_out_another_user_s_report(tmp_path):
    """Live-looking reports of one owner, more than the reader holds in all: that owner gets its
    share (PER_OWNER), and another owner's report is read whatever its name."""
    d = tmp_path / "lanes"
    reader = LR.LanesReader(str(d))
    now = time.monotonic_ns()
    for k in range(LR.MAX_FILES + 20):
        p = d / f"lanes.0{k:05d}"
        report(p, 1, heartbeat=now + 10 * 10**9, peer="198.18.64.9")  # beats "in the future": never stale here
        os.chown(p, 65534, 65534)
    report(d / "lanes.zzz", 1, heartbeat=now)  # root's
    got = reader.look(now)
    assert "198.18.64.3" in [x.peer for x in got]
    by_owner = {}
    for rep in reader.reports.values():
        by_owner[rep.uid] = by_owner.get(rep.uid, 0) + 1
    assert by_owner == {65534: LR.PER_OWNER, os.getuid(): 1}
    assert reader.counts["reports_over_share"] == LR.MAX_FILES + 20 - LR.PER_OWNER
    reader.close()

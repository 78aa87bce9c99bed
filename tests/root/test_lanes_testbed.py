"""Lane reports (docs/lanes.md) and the agent on the testbed following a job's lanes: it catches
a stall, never exceeds its probe budget, and the job keeps its rate."""
from __future__ import annotations

import json
import os
import subprocess
import time

from linkpass.core.activity import IDLE, PROGRESSING, STANDBY

A, B = 0, 3
PROBE = {"idle_rates": True, "idle_interval_ms": 100, "idle_after_ms": 2000, "standby_interval_ms": 50,
         "progress_interval_ms": 50, "progress_window_ms": 4}


def rates_to(fab, host: int, peer: str) -> dict[int, dict]:
    from linkpass.testbed.agents import LINKPASS

    out = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), *LINKPASS, "paths", "--local", "-o", "json"],
                         capture_output=True, text=True, timeout=30)
    rows = json.loads(out.stdout) if out.stdout.startswith("[") else []
    return {r["path_id"]: r for r in rows if r["peer"] == peer}


def wait_until(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    return got


def test_the_agent_follows_a_jobs_lanes_and_catches_a_stall(clean_faults, tmp_path):
    from linkpass.testbed import faults
    from linkpass.testbed.agents import Agents
    from linkpass.testbed.lanejob import LaneJob

    fab = clean_faults
    # a slow progressing rate: found at that rate, the cut would take three misses at 500 ms, so a DOWN
    # well inside that can only come from the stall putting the paths back on the active rate
    probe = {**PROBE, "progress_interval_ms": 500}
    with Agents(fab, str(tmp_path), [A, B], interval_ms=1.0, probe=probe) as ag:
        lanes_dir = os.path.join(str(tmp_path), f"lanes-h{A}")
        assert wait_until(lambda: {r["rate"] for r in rates_to(fab, A, "h3").values()} == {IDLE})
        job = LaneJob(fab, A, [B], [0], lanes_dir, max_seconds=60).start()
        try:
            # plane 0's paths carry the lane and it progresses; h3's other plane is the standby
            def split():
                rows = rates_to(fab, A, "h3").values()
                by = {(r["plane"], r["rate"]) for r in rows}
                return by if by == {(0, PROGRESSING), (1, STANDBY)} else None
            assert wait_until(split), {(r["plane"], r["rate"]) for r in rates_to(fab, A, "h3").values()}
            # plane 0 cut between h0's leaf and the spines: the lane stalls with bytes waiting, so its
            # paths go back to the active rate and the failure is found as on any active path
            t_fault, t_fault_wall = time.monotonic_ns(), time.time()
            faults.apply(fab.prefix, faults.FaultSpec("down", "p0l0-p0s0"))  # cleared by the fixture
            faults.apply(fab.prefix, faults.FaultSpec("down", "p0l0-p0s1"))
            ev = ag.wait_for(A, "path_state", lambda e: e["new"] == "down" and e["mono_ns"] >= t_fault
                             and e.get("plane") in (0, None), timeout_s=5)
            assert ev is not None, ag.events(A, "path_state")[-5:]
            # the window, the writer's look, the agent's look and three misses at 1 kHz: tens of ms
            # here. At the slow rate three misses need probes 500 ms apart (a slow path's probe goes
            # at most an eighth early), so no DOWN found that way comes before ~875 ms after the cut;
            # the bound leaves a loaded machine room below that
            assert (ev["mono_ns"] - t_fault) / 1e6 < 600, (ev, ag.events(A, "path_rates")[-3:])
            # and the agent says so: h3's paths went to the active rate after the cut
            went = ag.wait_for(A, "path_rates", lambda e: "h3" in e.get("active", []) and e["ts"] >= t_fault_wall)
            assert went is not None, ag.events(A, "path_rates")[-3:]
        finally:
            moved = job.stop()
        sent, acked = moved[(B, 0)]
        assert sent > 0 and acked > 0


def test_the_probe_budget_is_never_exceeded_and_the_job_keeps_its_rate(clean_faults, tmp_path):
    """A ceiling below what every path at 1 kHz wants: the job's paths (h3's plane 0, a lane)
    keep their rate while the rest are stretched; the probes sent stay under the ceiling."""
    from linkpass.testbed.agents import Agents
    from linkpass.testbed.lanejob import LaneJob

    fab = clean_faults
    budget = 2500  # probes/s: the lane's two paths at 1 kHz fit, not h3's other plane's two as well
    probe = {**PROBE, "idle_interval_ms": 1, "standby_interval_ms": 1, "progress_interval_ms": 1,
             "budget_pps": budget}
    with Agents(fab, str(tmp_path), [A, B], interval_ms=1.0, probe=probe) as ag:
        lanes_dir = os.path.join(str(tmp_path), f"lanes-h{A}")
        job = LaneJob(fab, A, [B], [0], lanes_dir, max_seconds=60).start()
        try:
            # (at start every new path is active, so the first line may say the active class is stretched)
            ev = ag.wait_for(A, "probe_budget", lambda e: e["degraded"] == ["standby"], timeout_s=15)
            assert ev is not None, ag.events(A, "probe_budget")
            assert ev["granted_pps"] <= budget + 1e-6 and ev["wanted_pps"] > budget
            assert ev["classes"]["active"]["granted_pps"] == ev["classes"]["active"]["wanted_pps"]  # the job's, kept
            t0, first, t0b = time.monotonic(), rates_to(fab, A, "h3"), time.monotonic()
            time.sleep(2.0)
            t1, second, t1b = time.monotonic(), rates_to(fab, A, "h3"), time.monotonic()
            span = (t1 + t1b) / 2 - (t0 + t0b) / 2  # each snapshot taken somewhere in its CLI call
            sent = sum(second[p]["sent"] - first[p]["sent"] for p in second if p in first) / span
            assert sent <= budget * 1.1, (sent, span, {p: (r["rate"], r["sent"] - first[p]["sent"]) for p, r in second.items()})
            by_plane = {}
            for p, r in second.items():
                if p in first:
                    by_plane.setdefault(r["plane"], []).append((r["sent"] - first[p]["sent"]) / span)
            assert min(by_plane[0]) > max(by_plane[1]), by_plane  # the lane's plane is probed more
        finally:
            job.stop()

"""An agent's lifecycle around failover: killed with SIGKILL in the middle of one, its successor
reconciles the routes it left; stopped cleanly, it leaves a plane known bad out of its routes
(a rolling restart does not put traffic back on it); with --dry-run it decides and logs but
touches nothing. (Agents of
their own: not alongside test_failover.py's, which hold the same hosts' sockets.)"""
from __future__ import annotations

import signal
import time

from linkpass.testbed import faults
from linkpass.testbed.agents import Agents
from linkpass.testbed.faults import FaultSpec

from support.testbed import A, B, routes_of
from support.waiting import wait_until


def test_agent_killed_mid_failover_leaves_routes_its_successor_reconciles(fabric, tmp_path):
    ag = Agents(fabric, str(tmp_path), [A, B]).start()
    try:
        time.sleep(1.5)
        faults.apply(fabric.prefix, FaultSpec("down", f"h{A}-p0l0"))
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (1,), 2, "route off plane 0")
        ag.procs[A].send_signal(signal.SIGKILL)
        ag.procs[A].wait()
        ag.stop()  # B stops cleanly; A is gone already
        faults.clear(fabric.prefix)
        assert routes_of(fabric, A).get(fabric.service_addr(B)) == (1,)  # left as it was: no cleanup ran
        ag2 = Agents(fabric, str(tmp_path), [A, B]).start()  # same directory: same journals
        try:
            rec = ag2.events(A, "routes_reconciled")[0]
            assert rec["installed"][f"h{B}"] == [1]  # the journal is what the kernel had
            # and the healthy fabric brings plane 0 back after the hold-down
            wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1), 15, "both planes again")
        finally:
            ag2.stop()
    finally:
        ag.stop()
        faults.clear(fabric.prefix)


def test_a_clean_stop_leaves_a_plane_known_bad_out_and_every_peer_a_route(fabric, tmp_path):
    ag = Agents(fabric, str(tmp_path), [A, B]).start()
    try:
        time.sleep(1.5)
        faults.apply(fabric.prefix, FaultSpec("down", f"h{A}-p0l0"))
        wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (1,), 2, "route off plane 0")
        assert ag.stop() == {A: 0, B: 0}
        # plane 0 is known bad at A: it stays out after the stop (the baseline would put it back)
        assert routes_of(fabric, A) == {fabric.service_addr(B): (1,)}
        left = ag.events(A, "routes_left")
        assert left and left[-1]["installed"] == {f"h{B}": [1]}
        assert all(routes_of(fabric, B).values())  # B's route to A: at least one plane, as always
        ag2 = Agents(fabric, str(tmp_path), [A, B]).start()  # the restart: same journals
        try:
            assert ag2.events(A, "routes_reconciled")[0]["installed"][f"h{B}"] == [1]
            faults.clear(fabric.prefix)
            wait_until(lambda: routes_of(fabric, A).get(fabric.service_addr(B)) == (0, 1), 15, "both planes again")
        finally:
            ag2.stop()
    finally:
        ag.stop()
        faults.clear(fabric.prefix)
        ag.remove_routes()


def test_dry_run_decides_and_logs_but_touches_no_route(fabric, tmp_path):
    before = routes_of(fabric, A)
    ag = Agents(fabric, str(tmp_path), [A, B], extra_args=("--dry-run",)).start()
    try:
        time.sleep(1.5)
        t0 = time.monotonic_ns()
        faults.apply(fabric.prefix, FaultSpec("down", f"h{A}-p0l0"))
        ev = ag.wait_for(A, "route_change", lambda e: e["mono_ns"] >= t0, 3)
        assert ev is not None and ev["dry_run"] is True and ev["planes"] == [1], ev
        assert routes_of(fabric, A) == before
    finally:
        ag.stop()
        faults.clear(fabric.prefix)

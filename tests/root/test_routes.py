"""The route actuator on the real kernel: LinkPass's own /32 routes, failover between planes,
never the last path, journal + reconcile after SIGKILL, dry run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from linkpass.agent.routes import RTPROT_LINKPASS, RouteActuator
from linkpass.testbed import faults, traffic
from linkpass.testbed.faults import FaultSpec
from linkpass.testbed.agents import peer_routes


@pytest.fixture
def actuator(clean_faults, tmp_path):
    fab = clean_faults
    act = RouteActuator(fab.netns("h0"), fab.service_addr(0), peer_routes(fab, 0), str(tmp_path / "journal"))
    try:
        yield fab, act
    finally:
        act.remove_all()
        act.close()


def ip_routes(fab, host=0) -> str:
    return subprocess.run(["ip", "-n", fab.netns(f"h{host}"), "route", "show", "proto", str(RTPROT_LINKPASS)],
                          capture_output=True, text=True, check=True).stdout


def test_reconcile_installs_multipath_routes_with_rto_min(actuator):
    fab, act = actuator
    installed = act.reconcile()
    assert installed == {f"h{j}": (0, 1) for j in (1, 2, 3)}
    text = ip_routes(fab)
    for j in (1, 2, 3):
        assert fab.service_addr(j) in text
    assert text.count("rto_min lock 10ms") == 3 and text.count("nexthop") == 6
    assert all(r["ok"] for r in traffic.reachability(fab, tries=2))


def test_tcp_connections_over_our_routes_retransmit_after_rto_min(actuator):
    """The point of rto_min: a real TCP connection on our route times out in ~10 ms, not 200 ms.
    (The kernel applies a route's rto_min only when the metric is locked; unlocked it kept 204 ms.)"""
    import socket
    import struct

    from linkpass.kernel import netns as ns_io

    fab, act = actuator
    act.reconcile()
    srv = ns_io.socket_in_netns(fab.netns("h1"), type=socket.SOCK_STREAM)
    cli = ns_io.socket_in_netns(fab.netns("h0"), type=socket.SOCK_STREAM)
    try:
        srv.bind((fab.service_addr(1), 0))
        srv.listen(1)
        cli.settimeout(5)
        cli.connect((fab.service_addr(1), srv.getsockname()[1]))
        conn, _ = srv.accept()
        for _ in range(20):  # a few round trips, so the RTO is computed from samples
            cli.sendall(b"x" * 1000)
            conn.recv(4096)
        rto_us = struct.unpack_from("=I", cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 8)[0]
        conn.close()
    finally:
        cli.close()
        srv.close()
    assert rto_us < 100_000, f"TCP's RTO on a LinkPass route is {rto_us / 1000:.0f} ms; rto_min is not applied"


def test_failover_moves_every_flow_to_the_usable_plane(actuator):
    fab, act = actuator
    act.reconcile()
    faults.apply(fab.prefix, FaultSpec("down", "h0-p0l0"))
    # before failover: flows hashing onto plane 0 are black-holed
    lost_before = [traffic.send_flow(fab, 0, 3, target="service", sport=sp, count=10).loss_pct for sp in range(42000, 42016)]
    assert any(x == 100 for x in lost_before)
    t0 = time.perf_counter()
    result = act.set_usable("h3", {1})
    change_ms = (time.perf_counter() - t0) * 1000
    # one netlink replace (~1 ms; bench/failover.py times it): bounded loosely for a loaded machine
    assert result.changed and result.planes == (1,) and change_ms < 1000
    for sp in range(42000, 42016):
        res = traffic.send_flow(fab, 0, 3, target="service", sport=sp, count=10)
        assert res.loss_pct == 0 and set(res.ingress) == {"p1"}
    # recovery: both planes again
    faults.clear(fab.prefix)
    assert act.set_usable("h3", {0, 1}).planes == (0, 1)
    assert "nexthop" in ip_routes(fab)


def test_the_last_usable_path_is_never_removed(actuator):
    fab, act = actuator
    act.reconcile()
    act.set_usable("h2", {0})
    out = act.set_usable("h2", set())
    assert out.refused == (0,) and not out.changed
    assert act.kernel_routes()[fab.service_addr(2)] == (0,)
    assert act.stats["refused_last_path"] == 1


def test_dry_run_touches_nothing(clean_faults, tmp_path):
    fab = clean_faults
    act = RouteActuator(fab.netns("h1"), fab.service_addr(1), peer_routes(fab, 1), str(tmp_path / "j"), dry_run=True)
    try:
        act.reconcile()
        assert act.set_usable("h0", {1}).changed
        assert ip_routes(fab, 1) == "" and not os.path.exists(tmp_path / "j")
    finally:
        act.close()


def test_sigkill_mid_change_then_reconcile_leaves_consistent_routes(clean_faults, tmp_path):
    fab = clean_faults
    journal = str(tmp_path / "journal")
    churn = textwrap.dedent(f"""
        import itertools, sys
        sys.path.insert(0, {os.getcwd()!r})
        from linkpass.testbed.build import load_fabric
        from linkpass.testbed.agents import peer_routes
        from linkpass.agent.routes import RouteActuator
        fab = load_fabric({fab.prefix!r})
        act = RouteActuator(fab.netns("h0"), fab.service_addr(0), peer_routes(fab, 0), {journal!r},
                            max_changes_per_s=1e9, burst=10**9)
        act.reconcile()
        print("ready", flush=True)
        for k in itertools.count():  # bounded by the parent's SIGKILL (and 60 s below)
            for j, peer in enumerate(("h1", "h2", "h3")):
                act.set_usable(peer, [{{0}}, {{1}}, {{0, 1}}][(k + j) % 3])
            if k > 200000:
                break
    """)
    for delay in (0.05, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, "-c", churn], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        act = RouteActuator(fab.netns("h0"), fab.service_addr(0), peer_routes(fab, 0), journal)
        try:
            installed = act.reconcile()
            kernel = act.kernel_routes()
            assert {fab.service_addr(int(p[1:])): planes for p, planes in installed.items()} == kernel
            assert all(planes for planes in kernel.values())  # every peer keeps a route
            assert all(r["ok"] for r in traffic.reachability(fab, tries=2) if r["src"] == "h0" and r["target"] == "nic")
        finally:
            act.close()
    RouteActuator(fab.netns("h0"), fab.service_addr(0), peer_routes(fab, 0), journal).remove_all()

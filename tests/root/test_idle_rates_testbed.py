"""Active and idle rates on the kernel: its TCP socket diagnostics find only the sockets to the
peers among thousands, and the agent on the testbed slows its probes without traffic, speeds them
up with it, and still catches a failure."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time

from linkpass.core.activity import ACTIVE, IDLE
from linkpass.agent.config import Peer
from linkpass.kernel import sockdiag as SD
from linkpass.testbed.agents import LINKPASS


def peer(name: str, service: str, nics: dict | None = None) -> Peer:
    return Peer(name, 1, service, nics or {})


CLONE_NEWNET = 0x40000000


def in_netns(name: str, fn):
    """fn()'s result, run by a thread of its own that entered the network namespace `name` (a
    socket stays in the namespace it was made in; the thread ends with fn)."""
    import ctypes
    import threading

    box: dict = {}

    def run():
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {name}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_kernel_sends_only_sockets_to_the_peers_among_thousands(monkeypatch):
    """In a network namespace of its own, 1 000 loopback connections (2 000 sockets) no peer
    owns, and 6 sockets whose destination is a peer's address (IPv4, IPv6, v4-mapped): the
    filtered dump hands the parser those 6 messages and no other, in the one dump and in a dump
    per family; unfiltered it is all 2 012. With the bound lifted, 2 000 more scattered addresses
    (~56 KiB of conditions) pass the kernel's audit and still filter."""
    import resource

    from support.testbed import prefix_for

    ns = f"{prefix_for('s')}-sockdiag"
    socks: list[socket.socket] = []
    tcp: list[SD.TcpActivity] = []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        if nofile[0] < 4096:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, nofile[1]), nofile[1]))
        for args in (["link", "set", "lo", "up"], ["addr", "add", "198.18.0.2/32", "dev", "lo"],
                     ["addr", "add", "10.9.0.1/32", "dev", "lo"], ["addr", "add", "fd00::1/128", "dev", "lo", "nodad"],
                     ["addr", "add", "fd00::2/128", "dev", "lo", "nodad"]):
            subprocess.run(["ip", "-n", ns, *args], check=True)

        def made(sock: socket.socket) -> socket.socket:
            socks.append(sock)
            return sock

        def connect(listener: socket.socket, family: int, src: str, dst: str) -> socket.socket:
            c = made(socket.socket(family))
            c.bind((src, 0))
            c.connect((dst, listener.getsockname()[1]))
            made(listener.accept()[0]).sendall(b"x")
            c.recv(1)
            return c

        def open_all() -> None:
            noise = made(socket.create_server(("127.0.0.1", 0), backlog=64))
            for _ in range(1000):
                made(socket.create_connection(noise.getsockname()))
                made(noise.accept()[0])
            v4 = made(socket.create_server(("198.18.0.2", 0)))
            v6 = made(socket.create_server(("fd00::2", 0), family=socket.AF_INET6))
            for _ in range(3):
                connect(v4, socket.AF_INET, "10.9.0.1", "198.18.0.2")
            for _ in range(2):
                connect(v6, socket.AF_INET6, "fd00::1", "fd00::2")
            connect(v4, socket.AF_INET6, "::ffff:10.9.0.1", "::ffff:198.18.0.2")  # v4-mapped
            tcp.append(SD.TcpActivity())  # its dumps are of this namespace

        in_netns(ns, open_all)
        t = tcp[0]
        by_addr = SD.peer_addresses([peer("h1", "198.18.0.2", {0: "fd00::2"})])
        want = {("h1", None), ("h1", 0)}  # the accepted ends' destinations, 10.9.0.1 and fd00::1, are no peer's
        t.filtering = False
        assert t.moving(by_addr, 60_000) == want and t.sockets_read == 2012
        every_byte = t.bytes_read
        for any_family in (False, True):
            t.filtering, t.any_family = True, any_family
            assert t.moving(by_addr, 60_000) == want and t.filtering and t.any_family == any_family
            assert t.sockets_read == 6, (any_family, t.sockets_read)
        assert t.bytes_read * 100 < every_byte, (t.bytes_read, every_byte)
        # 2 000 scattered addresses more: above the bound, no filter; lifted, the kernel takes it
        rnd = random.Random(5)
        big = dict(by_addr)
        big.update({bytes([10, 200]) + rnd.randbytes(2): ("far", None) for _ in range(1000)})
        big.update({bytes([253]) + rnd.randbytes(15): ("far", 1) for _ in range(1000)})
        assert t.moving(big, 60_000) == want and t.sockets_read == 2012
        monkeypatch.setattr(SD, "MAX_CONDITIONS", 10**6)
        big = dict(big)
        assert len(SD.dst_bytecode(big)) > 50_000
        assert t.moving(big, 60_000) == want and t.sockets_read == 6 and t.filtering and t.any_family
        # a kernel that refuses the filter: the one dump without it, from then on
        monkeypatch.setattr(SD, "dst_bytecode", lambda keys: SD._NLA.pack(8, SD.INET_DIAG_REQ_BYTECODE)
                            + SD._OP.pack(SD.INET_DIAG_BC_JMP, 4, 2))
        assert t.moving(dict(by_addr), 60_000) == want and t.sockets_read == 2012
        assert (t.any_family, t.filtering) == (True, False)
    finally:
        for t in tcp:
            t.close()
        for s in socks:
            s.close()
        subprocess.run(["ip", "netns", "del", ns], check=False)
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)


A, B = 0, 3
PROBE = {"idle_rates": True, "idle_interval_ms": 100, "idle_after_ms": 1000}


def sent_per_s(ag, fab, host: int, peer: str, seconds: float = 1.0) -> tuple[set[str], float]:
    """(the rates the agent's paths to `peer` report, their slowest probe rate in packets/s)."""
    def rows():
        out = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), *LINKPASS, "paths", "--local", "-o",
                              "json"], capture_output=True, text=True, timeout=30)
        got = json.loads(out.stdout) if out.stdout.startswith("[") else []
        return {r["path_id"]: r for r in got if r["peer"] == peer}

    t0, first = time.monotonic(), rows()
    time.sleep(seconds)
    t1, second = time.monotonic(), rows()
    per_s = min((second[p]["sent"] - first[p]["sent"]) / (t1 - t0) for p in second if p in first)
    return {r["rate"] for r in second.values()}, per_s


def wait_rate(ag, fab, host: int, peer: str, rate: str, timeout_s: float = 10.0) -> tuple[set[str], float]:
    """Once every path to `peer` reports `rate`: (their rates, their probe rate measured from then on)."""
    deadline = time.monotonic() + timeout_s
    got: tuple[set[str], float] = (set(), 0.0)
    while time.monotonic() < deadline:
        got = sent_per_s(ag, fab, host, peer, seconds=0.2)
        if got[0] == {rate}:
            return sent_per_s(ag, fab, host, peer)
    return got


def test_paths_slow_down_without_traffic_speed_up_with_it_and_still_catch_a_failure(clean_faults, tmp_path):
    from linkpass.testbed import faults
    from linkpass.testbed.agents import Agents
    from linkpass.testbed.tcpflow import TcpFlow

    fab = clean_faults
    with Agents(fab, str(tmp_path), [A, B], interval_ms=1.0, probe=PROBE) as ag:
        # no traffic between the two: every path idle, probed ~10 times a second
        rates, per_s = wait_rate(ag, fab, A, "h3", IDLE)
        assert rates == {IDLE} and 5 <= per_s <= 30, (rates, per_s)
        quiet = ag.wait_for(A, "path_rates", lambda e: e["paths"]["idle"] > 0 and e["paths"]["active"] == 0)
        assert quiet is not None and quiet["batch_ms"] == 50, quiet  # no path fast: replies taken every 50 ms
        # a TCP flow between their service addresses: both ends' paths go active within a sample
        t_flow = time.time()
        flow = TcpFlow(fab, A, B, max_seconds=30).start()
        try:
            ev = ag.wait_for(A, "path_rates", lambda e: "h3" in e["active"] and e["ts"] >= t_flow, timeout_s=5)
            assert ev is not None and ev["ts"] - t_flow < 1.0, ev  # one sample per 100 ms
            assert ev["batch_ms"] == 10, ev  # an active path: its replies every probe.batch_ms again
            rates, per_s = wait_rate(ag, fab, A, "h3", ACTIVE)
            assert rates == {ACTIVE} and per_s >= 400, (rates, per_s)
            assert wait_rate(ag, fab, B, "h0", ACTIVE)[0] == {ACTIVE}
        finally:
            result = flow.stop()
        assert result.received > 100
        # quiet again: idle once idle_after_ms has passed without data
        rates, per_s = wait_rate(ag, fab, A, "h3", IDLE)
        assert rates == {IDLE} and per_s <= 30, (rates, per_s)
        # no false verdict: a DOWN only of the host-wide lateness bursts a loaded machine has, which
        # the detector undoes itself when the late replies come in (late, not lost)
        states = ag.events(A, "path_state")
        kept = [e for k, e in enumerate(states) if e["new"] == "down" and not any(
            later["path"] == e["path"] and later["reason"] == "spurious_down" for later in states[k + 1:])]
        assert kept == [], kept
        # a hard failure on idle paths is still found, within about a second
        t_fault = time.monotonic_ns()
        faults.apply(fab.prefix, faults.FaultSpec("down", "p0l0-p0s1"))  # cleared by the fixture
        ev = ag.wait_for(A, "path_state", lambda e: e["new"] == "down" and e["mono_ns"] >= t_fault, timeout_s=5)
        assert ev is not None, ag.events(A, "path_state")[-5:]
        assert (ev["mono_ns"] - t_fault) / 1e9 < 1.0, ev

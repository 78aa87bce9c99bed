"""Soft-RoCE guests on the testbed fabric: hosts 0 and 3 of the default shape are QEMU guests
with rdma_rxe, the others namespaces. The guests boot with one RDMA device per plane, the fabric
reaches them like any host, an RC queue pair steered to a source port carries exactly that port
on the wire (both directions), each port keeps to one spine, and the mlx5-only re-path call is
refused on rxe. The first run builds the guest image (minutes; cached afterwards)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from linkpass.core.names import host_name
from linkpass.kernel import netns as ns_io
from linkpass.testbed import build, guests, topology
from linkpass.testbed.capture import Capture
from linkpass_rdma import steer

from helpers import prefix_for

pytestmark = pytest.mark.root

GA, GB = 0, 3  # on different leaves: their traffic crosses a spine
GUEST_ENV = {"PYTHONPATH": "/opt/linkpass/rdma"}  # the project's source, shared read-only


@pytest.fixture(scope="module")
def rfab():
    prefix = prefix_for("r")
    build.clean(prefix)
    spec = dataclasses.replace(topology.preset("default"), rdma_hosts=(GA, GB))
    fab = build.up(spec, prefix, progress=print)
    try:
        yield fab
    finally:
        build.down(prefix)
        # nothing of the guests is left: no QEMU, no TAP, no work directory
        left = subprocess.run(["pgrep", "-f", f"-name {prefix}-h"], capture_output=True, text=True).stdout.split()
        assert not left, left
        assert not build.root_links_with_prefix(prefix)
        assert not os.path.exists(guests.guests_root(prefix))


@pytest.fixture(scope="module")
def ctl(rfab):
    conns = {h: guests.Control(rfab.prefix, h) for h in (GA, GB)}
    try:
        yield conns
    finally:
        for c in conns.values():
            c.close()


def test_guests_boot_with_one_soft_roce_device_per_plane(rfab, ctl):
    for h in (GA, GB):
        links = ctl[h].check(["rdma", "-j", "link"])
        by_dev = {entry["ifname"]: entry.get("netdev") for entry in json.loads(links)}
        assert by_dev == {"rxe_p0": "p0", "rxe_p1": "p1"}, links
        for p in range(rfab.spec.planes):
            dev = ctl[h].check(["python3", "-c", "import sys; from linkpass_rdma.qp import Device; "
                                "d = Device.for_address(sys.argv[1]); print(d.name, d.gid_index)",
                                rfab.nic_addr(h, p)], env=GUEST_ENV).split()
            assert dev[0] == f"rxe_p{p}", dev


ECHO = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 7007))\n"
        "while True:\n    data, peer = s.recvfrom(2048)\n    s.sendto(data, peer)\n")


def _echo_from_namespace(fab, host: int, addr: str) -> bytes | None:
    s = ns_io.socket_in_netns(fab.netns(host_name(host)))
    s.settimeout(1.0)
    try:
        for _ in range(5):  # the guest's server may still be starting
            s.sendto(b"hello " + addr.encode(), (addr, 7007))
            try:
                return s.recv(2048)
            except TimeoutError:
                continue
        return None
    finally:
        s.close()


def test_the_fabric_reaches_guests_like_any_host(rfab, ctl):
    for h in (GA, GB):
        ctl[h].spawn("echo", ["python3", "-c", ECHO])
    try:
        for h in (GA, GB):  # from a namespace host, to every address of each guest
            for addr in [rfab.service_addr(h)] + [rfab.nic_addr(h, p) for p in range(rfab.spec.planes)]:
                assert _echo_from_namespace(rfab, 1, addr) == b"hello " + addr.encode(), addr
        # guest to guest, over the fabric
        code = ("import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(3); "
                "s.bind((sys.argv[1],0)); s.sendto(b'ping',(sys.argv[2],7007)); print(s.recv(64).decode())")
        out = ctl[GA].check(["python3", "-c", code, rfab.service_addr(GA), rfab.service_addr(GB)])
        assert out.strip() == "ping"
    finally:
        for h in (GA, GB):
            ctl[h].kill("echo")


def _spine_ports(fab, host: int, plane: int) -> tuple[str, list[str]]:
    leaf = fab.leaf_of(host, plane)
    return leaf, [fab.leaf_spine(leaf, s).a_if for s in range(fab.spec.spines_per_plane)]


def test_an_rc_qp_carries_the_port_it_was_steered_to_and_keeps_one_spine(rfab, ctl):
    ports = [49152, 49153, 49160, 50000, 52017, 58177, 61000, 65535]
    server = ctl[GB].spawn("rc-serve", ["python3", "-m", "linkpass_rdma.qp", "serve", "--addr",
                                        rfab.nic_addr(GB, 0), "--connections", str(len(ports))], env=GUEST_ENV)
    assert server > 0
    a_leaf, a_ups = _spine_ports(rfab, GA, 0)
    b_leaf, b_ups = _spine_ports(rfab, GB, 0)
    a_addr, b_addr = rfab.nic_addr(GA, 0), rfab.nic_addr(GB, 0)
    seen = {}
    try:
        for sport in ports:
            reverse = steer.SPORT_MIN + (sport * 7919) % (steer.SPORT_MAX - steer.SPORT_MIN)
            with Capture(rfab.netns(a_leaf), a_ups, steer.ROCE_V2_DPORT) as cap_a, \
                    Capture(rfab.netns(b_leaf), b_ups, steer.ROCE_V2_DPORT) as cap_b:
                out = ctl[GA].check(["python3", "-m", "linkpass_rdma.qp", "ping", "--addr", a_addr, "--server",
                                     f"{b_addr}:18515", "--sport", str(sport), "--reverse-sport", str(reverse),
                                     "--count", "5"], timeout_s=120, env=GUEST_ENV)
            res = json.loads(out.strip().splitlines()[-1])
            assert res["sport"] == sport and res["count"] == 5, res
            # leaving A's leaf towards a spine: A's requests, every one with the chosen port
            fwd = {(k[0], k[3]) for k, n in cap_a.by_flow(outgoing=True).items() if k[1] == a_addr and k[2] == b_addr}
            assert {p for _, p in fwd} == {sport}, (sport, cap_a.by_flow())
            assert len(fwd) == 1, f"port {sport} took more than one spine: {fwd}"
            rev = {(k[0], k[3]) for k, n in cap_b.by_flow(outgoing=True).items() if k[1] == b_addr and k[2] == a_addr}
            assert {p for _, p in rev} == {reverse}, (reverse, cap_b.by_flow())
            seen[sport] = next(iter(fwd))[0]
    finally:
        ctl[GB].kill("rc-serve")
    # ECMP spreads the ports: with 8 ports both spines carry some (each one's spine is its own)
    assert len(set(seen.values())) == rfab.spec.spines_per_plane, seen


def test_repathing_a_live_qp_is_refused_on_rxe_with_the_alternative_named(rfab, ctl):
    code = ("import sys; from linkpass_rdma.qp import Device, SteeredRC; from linkpass_rdma.verbs import "
            "RdmaUnavailable\nrc = SteeredRC(Device.for_address(sys.argv[1]))\ntry:\n    rc.repath(50000)\n"
            "except RdmaUnavailable as e:\n    print('refused:', e)")
    out = ctl[GA].check(["python3", "-c", code, rfab.nic_addr(GA, 0)], env=GUEST_ENV)
    assert "refused:" in out and "mlx5" in out and "new QP" in out, out


def test_a_guest_command_that_fails_reports_its_exit_code_and_output(ctl):
    res = ctl[GA].run(["sh", "-c", "echo oops >&2; exit 3"])
    assert res.rc == 3 and "oops" in res.stderr
    with pytest.raises(guests.GuestError, match="exited 3"):
        ctl[GA].check(["sh", "-c", "exit 3"])

"""The testbed on the real kernel: build, reach, diversity, coexistence, teardown."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from linkpass.testbed import build, faults, state, topology, traffic

from support.testbed import prefix_for

LINKPASS = [sys.executable, "-m", "linkpass.cli"]


def leftovers(prefix: str) -> dict:
    """Everything a testbed might leave behind on this machine."""
    procs = build._flapper_pids(prefix)
    nft_root = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return {
        "namespaces": build.namespaces_with_prefix(prefix),
        "root_links": build.root_links_with_prefix(prefix),
        "processes": procs,
        "state": state.load(prefix),
        "root_nft": [line for line in nft_root.splitlines() if prefix in line],
    }


def nothing_left(prefix: str) -> bool:
    return not any(leftovers(prefix).values())


def test_default_preset_every_host_reaches_every_host_over_every_plane(fabric):
    rows = traffic.reachability(fabric)
    assert len(rows) == 4 * 3 * 2 * 2  # ordered pairs × planes × (NIC, service)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


def test_default_preset_objects_exist_with_the_prefix(fabric):
    nss = build.namespaces_with_prefix(fabric.prefix)
    assert len(nss) == 4 + 2 * (2 + 2)
    assert build.root_links_with_prefix(fabric.prefix) == sorted(
        [fabric.mgmt_bridge] + [fabric.mgmt_root_if(i) for i in range(4)])


def test_service_route_hash_uses_every_plane(fabric):
    """Without pinning, the host's ECMP route spreads flows to a peer over both planes."""
    planes = set()
    for sport in range(42000, 42032):
        res = traffic.send_flow(fabric, 0, 3, target="service", sport=sport, count=3)
        assert res.received == 3
        planes |= set(res.ingress)
    assert planes == {"p0", "p1"}


def test_path_diversity_source_ports_pick_spines(fabric):
    """Different source ports to one peer take different spines (seen in interface counters)."""
    for plane in range(2):
        spines = {sport: traffic.spine_for_sport(fabric, 0, 3, plane, sport) for sport in range(50000, 50016)}
        assert set(spines.values()) == {f"p{plane}s0", f"p{plane}s1"}, spines
        # the choice is a hash of the 5-tuple: stable for a port
        again = traffic.spine_for_sport(fabric, 0, 3, plane, 50000)
        assert again == spines[50000]


def test_management_network_reaches_root_namespace(fabric):
    import socket

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind((fabric.mgmt_root_addr, 0))
    rx.settimeout(2)
    port = rx.getsockname()[1]
    try:
        for i in range(fabric.spec.hosts):
            tx = traffic.ns_io.socket_in_netns(fabric.netns(f"h{i}"))
            tx.sendto(f"h{i}".encode(), (fabric.mgmt_root_addr, port))
            data, addr = rx.recvfrom(100)
            tx.close()
            assert data == f"h{i}".encode() and addr[0] == fabric.mgmt_addr(i)
    finally:
        rx.close()


def test_yaml_topology_builds_and_reaches(tmp_path):
    path = tmp_path / "fabric.yaml"
    path.write_text("name: three-planes\nhosts: 5\nplanes: 3\nleaves_per_plane: 2\nspines_per_plane: 3\nmtu: 9000\n")
    prefix = prefix_for("y")
    try:
        out = subprocess.run(LINKPASS + ["testbed", "up", "--topology", str(path), "--prefix", prefix, "-o", "json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["name"] == "three-planes" and doc["planes"] == 3 and doc["mtu"] == 9000
        fab = build.load_fabric(prefix)
        assert all(r["ok"] for r in traffic.reachability(fab, tries=2))
        big = traffic.send_flow(fab, 0, 4, plane=2, count=20, size=9000)
        assert big.received == 20  # jumbo MTU applied end to end
        chk = subprocess.run(LINKPASS + ["testbed", "check", "--prefix", prefix, "-o", "json"],
                             capture_output=True, text=True, timeout=120)
        assert chk.returncode == 0 and json.loads(chk.stdout)["failed"] == 0
    finally:
        build.down(prefix)
    assert nothing_left(prefix), leftovers(prefix)


def test_two_testbeds_with_different_prefixes_coexist(fabric):
    other = prefix_for("c")
    try:
        fab2 = build.up(topology.preset("tiny"), other)
        assert fab2.mgmt_subnet != fabric.mgmt_subnet
        assert all(r["ok"] for r in traffic.reachability(fab2, tries=2))
        assert all(r["ok"] for r in traffic.reachability(fabric, tries=2))
    finally:
        build.down(other)
    assert nothing_left(other), leftovers(other)
    assert len(build.namespaces_with_prefix(fabric.prefix)) == 12  # the first one untouched


def test_existing_prefix_is_refused_with_a_way_out(fabric):
    with pytest.raises(build.TestbedError, match=f"already exists.*testbed down --prefix {fabric.prefix}"):
        build.up(topology.preset("tiny"), fabric.prefix)


def test_teardown_leaves_nothing_even_with_a_running_flapper():
    prefix = prefix_for("t")
    build.up(topology.preset("tiny"), prefix)
    try:
        rec = faults.apply(prefix, faults.FaultSpec("flap", "h0-p0l0", None, {"period": "100ms"}))
        faults.apply(prefix, faults.FaultSpec("loss", "h1-p1l1", None, {"pct": 50}))
        assert os.path.exists(f"/proc/{rec['pid']}")
        # a stray process inside a host namespace, as an agent will be
        sleeper = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-h0", "sleep", "60"])
        assert len(leftovers(prefix)["processes"]) == 1
    finally:
        build.down(prefix)
    sleeper.wait(timeout=5)
    assert nothing_left(prefix), leftovers(prefix)
    assert not os.path.exists(f"/proc/{rec['pid']}") or open(f"/proc/{rec['pid']}/stat").read().split()[2] == "Z"


def test_build_failing_half_way_cleans_up(monkeypatch):
    prefix = prefix_for("f")

    def broken(*_a, **_k):
        raise RuntimeError("injected failure while wiring the management network")

    monkeypatch.setattr(build, "_build_mgmt", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        build.up(topology.preset("default"), prefix)
    assert nothing_left(prefix), leftovers(prefix)


def test_clean_reaps_a_crashed_run_without_state_file():
    prefix = prefix_for("k")
    build.up(topology.preset("tiny"), prefix)
    state.remove(prefix)  # as if the process died before writing it
    assert build.namespaces_with_prefix(prefix)
    assert prefix in build.find_prefixes()  # what `clean --all` reaps (not run here: it would take the shared fabric too)
    out = subprocess.run(LINKPASS + ["testbed", "clean", "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and prefix in out.stdout
    assert nothing_left(prefix), leftovers(prefix)


def test_cli_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: 4\nplanes: 2\nleaves_per_plane: 2\nspines_per_plane: two\n")
    out = subprocess.run(LINKPASS + ["testbed", "up", "--topology", str(bad), "--prefix", prefix_for("e")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{bad}.spines_per_plane: expected an integer" in out.stderr
    assert nothing_left(prefix_for("e"))


def test_cli_show_and_fault_round_trip(fabric):
    run = lambda *a: subprocess.run(LINKPASS + ["testbed", *a, "--prefix", fabric.prefix], capture_output=True,
                                    text=True, timeout=60)
    out = run("fault", "loss", "p1l1-p1s1", "5", "--from", "p1s1", "-o", "json")
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["kind"] == "loss" and rec["direction"] == "p1s1" and rec["effective_at"]
    shown = json.loads(run("show", "-o", "json").stdout)
    assert [f["id"] for f in shown["faults"]] == [rec["id"]]
    table = run("show").stdout
    assert "p1l1-p1s1" in table and "from p1s1" in table
    dup = run("fault", "loss", "p1l1-p1s1", "7")
    assert dup.returncode == 2 and "already has a loss fault" in dup.stderr
    assert run("fault", "--clear").returncode == 0
    assert json.loads(run("show", "-o", "json").stdout)["faults"] == []

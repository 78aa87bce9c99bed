#!/usr/bin/env python3
"""Testbed build and teardown time: LinkPass (netlink via pyroute2) against the same fabric
built the usual way, one `ip`/`sysctl` process per object, measured in the same run.

    python bench/testbed.py [--quick] [--runs N] [--json FILE]

Cases hosts-4, hosts-16, hosts-32 (× 2 planes, 2 leaves + 2 spines per plane); metrics up_s,
down_s. Each peer build is checked for reachability once, so both sides build a working fabric.
Target: 32 hosts up in <= 15 s on this 2-core machine.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/testbed/build.py",
    "linkpass/testbed/topology.py",
    "linkpass/kernel/netns.py",
    "bench/testbed.py",
)


import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass.core.names import HOST, host_index, host_name  # noqa: E402
from linkpass.testbed import build, topology, traffic  # noqa: E402
from linkpass.testbed.topology import Fabric, mac_of  # noqa: E402

PEER = "ip-process-per-object"


def ip_commands(fab: Fabric) -> list[list[str]]:
    """The same fabric as a shell script would build it: one process per object."""
    cmds: list[list[str]] = []
    for node in fab.nodes:
        cmds.append(["ip", "netns", "add", fab.netns(node)])
    for node, n in fab.nodes.items():
        for key, value in n.sysctls:
            cmds.append(["ip", "netns", "exec", fab.netns(node), "sysctl", "-qw", f"{key.replace('/', '.')}={value}"])
    for lk in fab.links.values():
        cmds.append(["ip", "-n", fab.netns(lk.a), "link", "add", lk.a_if, "address", mac_of(lk.a_addr), "type", "veth",
                     "peer", "name", lk.b_if, "address", mac_of(lk.b_addr), "netns", fab.netns(lk.b)])
    for node, n in fab.nodes.items():
        ns = fab.netns(node)
        cmds.append(["ip", "-n", ns, "link", "set", "lo", "up"])
        if n.role == HOST:
            cmds.append(["ip", "-n", ns, "addr", "add", f"{fab.service_addr(host_index(node))}/32", "dev", "lo"])
        for lk in fab.links_of(node):
            ifname, addr = lk.end(node)
            cmds.append(["ip", "-n", ns, "link", "set", ifname, "mtu", str(fab.spec.mtu)])
            cmds.append(["ip", "-n", ns, "addr", "add", addr, "dev", ifname])
            cmds.append(["ip", "-n", ns, "link", "set", ifname, "up"])
    plen = fab.mgmt_subnet.split("/")[1]
    cmds.append(["ip", "link", "add", fab.mgmt_bridge, "type", "bridge"])
    cmds.append(["ip", "addr", "add", f"{fab.mgmt_root_addr}/{plen}", "dev", fab.mgmt_bridge])
    cmds.append(["ip", "link", "set", fab.mgmt_bridge, "up"])
    for i in range(fab.spec.hosts):
        ns = fab.netns(host_name(i))
        cmds.append(["ip", "link", "add", fab.mgmt_root_if(i), "type", "veth", "peer", "name", "mgmt", "netns", ns])
        cmds.append(["ip", "link", "set", fab.mgmt_root_if(i), "master", fab.mgmt_bridge, "up"])
        cmds.append(["ip", "-n", ns, "addr", "add", f"{fab.mgmt_addr(i)}/{plen}", "dev", "mgmt"])
        cmds.append(["ip", "-n", ns, "link", "set", "mgmt", "up"])
    for node in fab.nodes:
        ns = fab.netns(node)
        for ifname, ip, mac in fab.neighbors(node):
            cmds.append(["ip", "-n", ns, "neigh", "replace", ip, "lladdr", mac, "dev", ifname, "nud", "permanent"])
        for r in fab.routes.get(node, []):
            cmd = ["ip", "-n", ns, "route", "replace", r.dst, "proto", "static"]
            if r.src:
                cmd += ["src", r.src]
            if len(r.via) == 1:
                cmd += ["via", r.via[0][0], "dev", r.via[0][1]]
            else:
                for gw, dev in r.via:
                    cmd += ["nexthop", "via", gw, "dev", dev]
            cmds.append(cmd)
    return cmds


def peer_up(fab: Fabric) -> None:
    for cmd in ip_commands(fab):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def peer_down(fab: Fabric) -> None:
    subprocess.run(["ip", "link", "del", fab.mgmt_bridge], check=False)
    for i in range(fab.spec.hosts):
        subprocess.run(["ip", "link", "del", fab.mgmt_root_if(i)], check=False, stderr=subprocess.DEVNULL)
    for node in fab.nodes:
        subprocess.run(["ip", "netns", "del", fab.netns(node)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 run per size, 4 and 16 hosts only")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--prefix", default="bench")
    args = ap.parse_args()
    if not report.require_root():
        return 3
    sizes = [4, 16] if args.quick else [4, 16, 32]
    runs = 1 if args.quick else args.runs
    build.clean(args.prefix)
    rows = []
    for hosts in sizes:
        spec = topology.parse_spec({"hosts": hosts, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2,
                                    "name": f"hosts-{hosts}"})
        ours = {"up_s": [], "down_s": []}
        peer = {"up_s": [], "down_s": []}
        for r in range(runs):
            print(f"hosts-{hosts}: run {r + 1}/{runs}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            fab = build.up(spec, args.prefix)
            ours["up_s"].append(time.perf_counter() - t)
            if r == 0:
                rows_ok = all(x["ok"] for x in traffic.reachability(fab, tries=2)) if hosts <= 16 else True
                assert rows_ok, "LinkPass-built fabric does not deliver"
            t = time.perf_counter()
            build.down(args.prefix)
            ours["down_s"].append(time.perf_counter() - t)

            fab_peer = topology.make_fabric(spec, args.prefix, fab.mgmt_subnet)
            t = time.perf_counter()
            try:
                peer_up(fab_peer)
                peer["up_s"].append(time.perf_counter() - t)
                if r == 0 and hosts <= 16:
                    assert all(x["ok"] for x in traffic.reachability(fab_peer, tries=2)), "peer fabric does not deliver"
            finally:
                t = time.perf_counter()
                peer_down(fab_peer)
                peer["down_s"].append(time.perf_counter() - t)
            build.clean(args.prefix)
        for metric in ("up_s", "down_s"):
            m, pm = statistics.median(ours[metric]), statistics.median(peer[metric])
            rows.append({"case": f"hosts-{hosts}", "metric": metric, "unit": "s", "n": runs,
                         "median": round(m, 4), "p99": report.tail(ours[metric], 0.99), "max": round(max(ours[metric]), 4),
                         "peer": PEER, "peer_median": round(pm, 4), "peer_p99": report.tail(peer[metric], 0.99),
                         "ratio": round(pm / m, 2) if m else None})
    doc = report.document("testbed", rows)
    print(f"{'case':10} {'metric':7} {'n':>3} {'median':>9} {'max':>9} {'peer median':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:10} {r['metric']:7} {r['n']:3} {r['median']:8.3f}s {r['max']:8.3f}s {r['peer_median']:11.3f}s "
              f"{r['ratio']:5.1f}×")
    target = [r for r in rows if r["case"] == "hosts-32" and r["metric"] == "up_s"]
    if target:
        print(f"target: 32 hosts up in <= 15 s -> {target[0]['median']:.2f} s "
              f"({'met' if target[0]['median'] <= 15 else 'MISSED'})")
    report.write(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ECMP path discovery: Paris-style sweeps on the real testbed (the pure table: test_paths.py)."""
from __future__ import annotations

import socket
import threading

from linkpass.kernel import netns as ns_io
from linkpass.core import paths as P
from linkpass.probe import discovery as D
from linkpass.testbed import faults, traffic


# ---- the real testbed -------------------------------------------------------------------

def expected_paths(fab, i: int, j: int, plane: int) -> set[tuple[str, ...]]:
    """Hop sequences host i -> host j on `plane`, from the Fabric's links (inbound addresses)."""
    ip = lambda a: a.split("/")[0]  # noqa: E731
    li, lj = fab.leaf_of(i, plane), fab.leaf_of(j, plane)
    first = ip(fab.uplink(f"h{i}", plane).b_addr)  # the leaf's end of host i's uplink
    if li == lj:
        return {(first,)}
    out = set()
    for s in range(fab.spec.spines_per_plane):
        spine = f"p{plane}s{s}"
        out.add((first, ip(fab.links[f"{li}-{spine}"].b_addr), ip(fab.links[f"{lj}-{spine}"].a_addr)))
    return out


def spine_of_hop(fab) -> dict[str, str]:
    """Spine-side address of each leaf-spine link -> spine name."""
    return {lk.b_addr.split("/")[0]: lk.b for lk in fab.links.values() if lk.kind == "leaf-spine"}


def test_discovered_paths_match_the_topology(fabric):
    fab = fabric
    tables = D.discover_fabric(fab)
    total = D.total_stats(tables)
    assert not total["deadline_hit"] and total["unfinished"] == 0 and total["socket_errors"] == 0, total
    # how fast is the benchmark's business (bench/discovery.py holds the 1 s target)
    S, K, ports = fab.spec.spines_per_plane, D.DiscoveryConfig().k, len(D.DiscoveryConfig().ports)
    for i in range(fab.spec.hosts):
        table = tables[f"h{i}"]
        assert len(table) == (fab.spec.hosts - 1) * fab.spec.planes
        for p in range(fab.spec.planes):
            for j in range(fab.spec.hosts):
                if j == i:
                    continue
                entry = table.get(fab.nic_addr(j, p), f"p{p}")
                assert entry is not None and entry.src == fab.nic_addr(i, p)
                found = {path.hops for path in entry.paths.values()}
                want = expected_paths(fab, i, j, p)
                assert found == want, (i, j, p, [x.describe() for x in entry.paths.values()])
                assert len(found) == (1 if fab.leaf_of(i, p) == fab.leaf_of(j, p) else S)
                assert all(path.reached for path in entry.paths.values())
                assert sum(path.seen for path in entry.paths.values()) == ports == len(entry.ports)
                for path in entry.paths.values():
                    assert len(path.ports) == min(K, path.seen)
                    assert all(entry.ports[s] == path.id for s in path.ports)


def test_every_spine_is_covered(fabric):
    tables = D.discover_fabric(fabric)
    names = spine_of_hop(fabric)
    seen = {names[path.hops[1]] for t in tables.values() for e in t.entries.values()
            for path in e.paths.values() if len(path.hops) == 3}
    assert seen == {n for n, node in fabric.nodes.items() if node.role == "spine"}


def test_ports_in_a_path_take_that_spine(fabric):
    """Cross-check with interface counters: traffic on a path's ports leaves the leaf to its spine."""
    names = spine_of_hop(fabric)
    for plane in range(fabric.spec.planes):
        table = D.discover(fabric.netns("h0"), D.fabric_targets(fabric, 0, planes=[plane], peers=[3]), host="h0")
        entry = table.get(fabric.nic_addr(3, plane), f"p{plane}")
        assert len(entry.paths) == fabric.spec.spines_per_plane
        for path in entry.paths.values():
            for sport in path.ports[:2]:
                assert traffic.spine_for_sport(fabric, 0, 3, plane, sport) == names[path.hops[1]], (plane, sport)


def test_fixed_payload_sends_one_ttl_at_a_time_and_finds_the_same_paths(fabric):
    targets = D.fabric_targets(fabric, 1)
    ref = D.discover(fabric.netns("h1"), targets, host="h1")
    fixed = D.discover(fabric.netns("h1"), targets, D.DiscoveryConfig(payload=b"LinkPass-fixed!!"), host="h1")
    assert not P.diff_tables(ref, fixed).changed
    assert fixed.stats["late"] == 0  # never more than one TTL in flight: nothing past the peer
    assert fixed.stats["unmatched"] == 0


def test_reached_hook_accepts_a_reflector_answer(fabric):
    """With something answering on 4791, the peer sends no port unreachable: the hook decides."""
    peer_ns = fabric.netns("h3")
    rx = ns_io.socket_in_netns(peer_ns)
    rx.bind(("0.0.0.0", D.ROCE_PORT))
    rx.settimeout(0.05)
    stop = threading.Event()

    def echo() -> None:
        for _ in range(10_000):  # bounded: ~0.05 s per idle turn
            if stop.is_set():
                return
            try:
                data, addr = rx.recvfrom(2048)
            except socket.timeout:
                continue
            rx.sendto(b"ECHO" + data, addr)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        targets = D.fabric_targets(fabric, 0, peers=[3])
        no_hook = D.discover(fabric.netns("h0"), targets, D.DiscoveryConfig(timeout_s=0.05, retries=1), host="h0")
        cfg = D.DiscoveryConfig(reached=lambda d: d[4:] if d.startswith(b"ECHO") else None)
        table = D.discover(fabric.netns("h0"), targets, cfg, host="h0")
    finally:
        stop.set()
        t.join(2)
        rx.close()
    for p in range(fabric.spec.planes):
        # without the hook nothing ends the trace: it stops after gap_limit silent TTLs
        assert all(not path.reached for path in no_hook.paths(fabric.nic_addr(3, p), f"p{p}"))
        entry = table.get(fabric.nic_addr(3, p), f"p{p}")
        assert {path.hops for path in entry.paths.values()} == expected_paths(fabric, 0, 3, p)
        assert all(path.reached for path in entry.paths.values())
    assert table.stats["stray"] == 0 and no_hook.stats["lost_ttls"] > 0  # no hook: echoes go unread


def test_down_link_shows_in_a_refresh_and_in_the_diff(clean_faults):
    fab = clean_faults
    before = D.discover_fabric(fab)
    link = fab.links["p0l0-p0s1"]
    dead_hop = link.b_addr.split("/")[0]  # s1's end of the link: paths through it cross the cut
    faults.apply(fab.prefix, faults.FaultSpec("down", link.name))
    after = D.discover_fabric(fab)
    broken = 0
    for i in range(fab.spec.hosts):
        h = f"h{i}"
        diff = P.diff_tables(before[h], after[h])
        for e in diff.entries:
            assert e.local == "p0", e.to_dict()  # the other plane is untouched
        for j in range(fab.spec.hosts):
            if j == i or fab.leaf_of(i, 0) == fab.leaf_of(j, 0):
                continue
            old_entry = before[h].get(fab.nic_addr(j, 0), "p0")
            crossing = [p for p in old_entry.paths.values() if link.a_addr.split("/")[0] in p.hops
                        or dead_hop in p.hops]
            assert len(crossing) == 1
            old = crossing[0]
            e = diff.get(fab.nic_addr(j, 0), "p0")
            assert e is not None and old in e.removed, (h, j)
            moved = {m.sport: m for m in e.moved}
            new_entry = after[h].get(fab.nic_addr(j, 0), "p0")
            for sport, pid in old_entry.ports.items():
                if pid != old.id:
                    continue
                assert sport in moved and moved[sport].old == old.id
                new = new_entry.paths[moved[sport].new]
                assert new in e.added and not new.reached
                # ends early: a strict prefix of the old hops (plus, maybe, the refusing spine)
                assert len(new.hops) < len(old.hops) and new.hops == old.hops[:len(new.hops)], new.describe()
                if fab.leaf_of(i, 0) == "p0l0":
                    # the source side of the cut: the leaf answers, then the probe dies on the dead link
                    assert new.hops == old.hops[:1] and new.end == P.END_LOST
                broken += 1
    assert broken >= 8  # 2 x 2 hosts x 2 directions, several ports each
    faults.clear(fab.prefix)
    healed = D.discover_fabric(fab)
    assert not any(P.diff_tables(before[h], healed[h]).changed for h in healed)

"""The coordinator tests' fabric (FAB, MODEL: 4 hosts, 2 planes) and what its agents report: path
tables, identities, failed paths; a Coordinator with h0..h3 registered (no Ray, no sockets)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from linkpass.core.fabric import from_testbed
from linkpass.testbed.topology import make_fabric, preset

if TYPE_CHECKING:
    from linkpass.coordinator.coordinator import Coordinator


FAB = make_fabric(preset("default"), "lpc", "198.19.250.0/24")  # 4 hosts, 2 planes, 2 leaves and 2 spines each
MODEL = from_testbed(FAB)


def bare(addr: str) -> str:
    return addr.split("/")[0]


def hops(src: int, dst: int, plane: int, spine: int) -> tuple[list[str], str]:
    """The routers a probe src -> dst crosses through `spine`, as discovery reports them: each
    hop is the address of the interface the probe came in on; and the peer's NIC address."""
    up = FAB.uplink(f"h{src}", plane)
    src_leaf, dst_leaf = FAB.leaf_of(src, plane), FAB.leaf_of(dst, plane)
    out = [bare(up.b_addr)]
    if src_leaf != dst_leaf:
        out.append(bare(FAB.links[f"{src_leaf}-p{plane}s{spine}"].b_addr))
        out.append(bare(FAB.links[f"{dst_leaf}-p{plane}s{spine}"].a_addr))
    return out, FAB.nic_addr(dst, plane)


def table_of(src: int) -> list[dict]:
    """Host h<src>'s path table as its agent registers it: every peer, plane and spine, all up."""
    rows, pid = [], 1
    for dst in range(4):
        if dst == src:
            continue
        for plane in range(2):
            same_leaf = FAB.leaf_of(src, plane) == FAB.leaf_of(dst, plane)
            for spine in range(1 if same_leaf else 2):  # a same-leaf peer has one path per plane
                h, addr = hops(src, dst, plane, spine)
                rows.append({"id": pid, "peer": f"h{dst}", "plane": plane, "sport": 49152 + pid, "hops": h,
                             "peer_addr": addr, "state": "up", "reason": None})
                pid += 1
    return rows


def identity(i: int) -> dict:
    return {"name": f"h{i}", "agent_id": i + 1, "service": FAB.service_addr(i),
            "nics": {str(p): FAB.nic_addr(i, p) for p in range(2)}, "version": "test"}


def fail_paths(c: Coordinator, now: float, crossing: set[str], reason="hard_failure", state="down") -> int:
    """Every agent reports its paths that cross any of these directed links as failed."""
    n = 0
    for i in range(4):
        changes = [{"id": int(k.split("/")[1]), "state": state, "reason": reason}
                   for k, rec in c.paths.items() if rec.reporter == f"h{i}" and set(rec.links) & crossing]
        n += len(changes)
        c.report({"name": f"h{i}", "changes": changes}, now)
    return n


def four_agents_registered(db_path: str):
    """A Coordinator (no Ray, no sockets) on the shared model with h0..h3 registered at t=1000,
    and its Store, which the caller closes."""
    from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig
    from linkpass.coordinator.store import Store

    store = Store(db_path)
    c = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=0.05), wall_s=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    return c, store

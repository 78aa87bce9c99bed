"""Names of a multi-plane Clos fabric's nodes and links, and the generators of both.

Pure: no I/O. The testbed (`testbed/topology.py`, which adds interfaces, addresses, routes and
namespaces) and the coordinator's model (`core/fabric.py`: `rail_optimized`, `from_testbed`)
build every node and link from `LeafSpine`, so one fabric has the same names in both and a
name is spelled in this file only:

    host i                 h{i}
    leaf l of plane p      p{p}l{l}
    spine s of plane p     p{p}s{s}
    core c of plane p      p{p}c{c}  (3-tier fabrics only)
    link                   {a}-{b}   a: the lower-tier end (host, leaf or spine), b: the upper one

Every plane is the same 2-tier fabric: host i hangs off leaf `host_leaf[i]` in every plane (a
rack holds the same hosts on every rail), and every leaf of a plane meets every spine of that
plane. Two attachments are in use, and they agree when the leaves divide the hosts evenly:

    blocks   the testbed: H hosts over L leaves in contiguous, balanced blocks, host i -> leaf
             i*L//H (a leaf's hosts summarise into a few prefixes)
    racks    a rail-optimized fleet: host i -> leaf i // hosts_per_leaf (the last rack may be short)

`links()` yields, per plane, the host uplinks by host, then the leaf-spine links by (leaf,
spine). That order is part of the contract: the model numbers a plane's spines in the order
their links first appear, and generated addresses follow it.

`ThreeTier` is the large fleets' shape: every plane is pods of `leaves_per_pod` leaves and
`spines_per_pod` spines (each leaf of a pod meets each spine of it, a 2-tier fabric of its own),
joined by a core tier split in `spines_per_pod` groups: spine j of every pod meets every core of
group j (`cores_per_group` cores). Leaves, spines and cores are numbered across the plane (spine
j of pod o is spine o * spines_per_pod + j, core c of group j is core j * cores_per_group + c),
so names stay as above. Its `links()` yields, per plane, host uplinks, then leaf-spine links by
(leaf, spine), then spine-core links by (spine, core).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, NamedTuple

# node roles
HOST = "host"
LEAF = "leaf"
SPINE = "spine"
CORE = "core"
ROLES = (HOST, LEAF, SPINE, CORE)

# link tiers (a link's kind), from the hosts up
HOST_LEAF = "host-leaf"
LEAF_SPINE = "leaf-spine"
SPINE_CORE = "spine-core"
TIERS = (HOST_LEAF, LEAF_SPINE, SPINE_CORE)

_HOST_RE = re.compile(r"h([0-9]+)")
_SWITCH_RE = re.compile(r"p(0|[1-9][0-9]*)([lsc])(0|[1-9][0-9]*)")


def host_name(host: int) -> str:
    return f"h{host}"


def leaf_name(plane: int, leaf: int) -> str:
    return f"p{plane}l{leaf}"


def spine_name(plane: int, spine: int) -> str:
    return f"p{plane}s{spine}"


def core_name(plane: int, core: int) -> str:
    return f"p{plane}c{core}"


def link_name(a: str, b: str) -> str:
    """The link between lower-tier node `a` and upper-tier node `b`: "h0-p0l0", "p0l0-p0s1", "p0s1-p0c3"."""
    return f"{a}-{b}"


def link_ends(link: str) -> tuple[str, str]:
    """("h0", "p0l0") from "h0-p0l0": the inverse of link_name; ValueError if it is not a link name."""
    a, sep, b = link.partition("-")
    if not sep or not (_HOST_RE.fullmatch(a) or _SWITCH_RE.fullmatch(a)) or not _SWITCH_RE.fullmatch(b):
        raise ValueError(f"{link!r} is not a link name (h0-p0l0, p0l0-p0s1, p0s1-p0c3, ...)")
    return a, b


def host_index(name: str) -> int:
    """3 from "h3" (and from "h03"); ValueError if `name` is not a host name."""
    m = _HOST_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a host name (h0, h1, ...)")
    return int(m.group(1))


def plane_of(switch: str) -> int:
    """1 from "p1l0", "p1s3" or "p1c2"; ValueError if `switch` is not a switch's name."""
    m = _SWITCH_RE.fullmatch(switch)
    if m is None:
        raise ValueError(f"{switch!r} is not a leaf, spine or core name (p0l0, p0s0, p0c0, ...)")
    return int(m.group(1))


class GeneratedLink(NamedTuple):
    """One generated link, with the indices its ends were generated from (for address plans).
    A tuple: a 16k-GPU fleet generates 32 768 of them."""

    name: str
    kind: str  # HOST_LEAF | LEAF_SPINE | SPINE_CORE
    plane: int
    a: str
    b: str
    lower: int  # a's index: the host (HOST_LEAF), the leaf (LEAF_SPINE) or the spine (SPINE_CORE)
    upper: int  # b's index: the leaf, the spine or the core


# the testbed's presets as shapes of the generator (LeafSpine.blocks): the testbed builds them, and
# the fleet simulator calibrates against "default", the one its reference figures were measured on
PRESET_SHAPES: dict[str, dict[str, int]] = {
    "default": {"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2},
    "tiny": {"hosts": 2, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 1},
    "rack16": {"hosts": 16, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2},
    "rack32": {"hosts": 32, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2},
    "rail8": {"hosts": 8, "planes": 8, "leaves_per_plane": 2, "spines_per_plane": 2},
}


@dataclass(frozen=True)
class LeafSpine:
    """The shape of a multi-plane 2-tier fabric: which host hangs off which leaf, how many spines."""

    planes: int
    leaves_per_plane: int
    spines_per_plane: int
    host_leaf: tuple[int, ...]  # leaf index of host i, the same in every plane

    def __post_init__(self):
        if min(self.planes, self.leaves_per_plane, self.spines_per_plane, len(self.host_leaf)) < 1:
            raise ValueError("a leaf-spine fabric needs at least one host, plane, leaf and spine")
        if not all(0 <= leaf < self.leaves_per_plane for leaf in self.host_leaf):
            raise ValueError(f"host_leaf {self.host_leaf} names leaves outside 0..{self.leaves_per_plane - 1}")

    @classmethod
    def blocks(cls, hosts: int, planes: int, leaves_per_plane: int, spines_per_plane: int) -> "LeafSpine":
        """`hosts` over `leaves_per_plane` leaves in contiguous, balanced blocks (the testbed's)."""
        return cls(planes, leaves_per_plane, spines_per_plane,
                   tuple(i * leaves_per_plane // hosts for i in range(hosts)))

    @classmethod
    def racks(cls, hosts: int, planes: int, hosts_per_leaf: int, spines_per_plane: int) -> "LeafSpine":
        """Racks of `hosts_per_leaf` hosts, one leaf each, the last rack possibly short."""
        return cls(planes, -(-hosts // hosts_per_leaf), spines_per_plane,
                   tuple(i // hosts_per_leaf for i in range(hosts)))

    @property
    def hosts(self) -> int:
        return len(self.host_leaf)

    @property
    def link_count(self) -> int:
        return self.planes * (self.hosts + self.leaves_per_plane * self.spines_per_plane)

    def host_names(self) -> list[str]:
        return [host_name(i) for i in range(self.hosts)]

    def hosts_of_leaf(self, leaf: int) -> list[int]:
        """Host indices under leaf index `leaf` (of any plane), in order."""
        return [i for i, at in enumerate(self.host_leaf) if at == leaf]

    def nodes(self) -> Iterator[tuple[str, str, int | None]]:
        """(name, role, plane) of every node: the hosts (plane None), then per plane its leaves and spines."""
        return _nodes(self.host_names(), self.planes, self.leaves_per_plane, self.spines_per_plane, 0)

    def links(self) -> Iterator[GeneratedLink]:
        """Every link, per plane: host uplinks by host, then leaf-spine links by (leaf, spine)."""
        hosts = self.host_names()
        for p in range(self.planes):
            leaves = [leaf_name(p, leaf) for leaf in range(self.leaves_per_plane)]
            spines = [spine_name(p, spine) for spine in range(self.spines_per_plane)]
            for i, host in enumerate(hosts):
                leaf = self.host_leaf[i]
                yield GeneratedLink(link_name(host, leaves[leaf]), HOST_LEAF, p, host, leaves[leaf], i, leaf)
            for leaf, a in enumerate(leaves):
                for spine, b in enumerate(spines):
                    yield GeneratedLink(link_name(a, b), LEAF_SPINE, p, a, b, leaf, spine)


def _nodes(hosts: list[str], planes: int, leaves: int, spines: int, cores: int) -> Iterator[tuple[str, str, int | None]]:
    for name in hosts:
        yield name, HOST, None
    for p in range(planes):
        for leaf in range(leaves):
            yield leaf_name(p, leaf), LEAF, p
        for spine in range(spines):
            yield spine_name(p, spine), SPINE, p
        for core in range(cores):
            yield core_name(p, core), CORE, p


@dataclass(frozen=True)
class ThreeTier:
    """The shape of a multi-plane 3-tier fabric (see the module doc): racks of `hosts_per_leaf`
    hosts, one leaf each (the last rack possibly short), pods of `leaves_per_pod` leaves (the last
    pod possibly short) and `spines_per_pod` spines, cores in `spines_per_pod` groups of
    `cores_per_group`."""

    hosts: int
    planes: int
    hosts_per_leaf: int
    leaves_per_pod: int
    spines_per_pod: int
    cores_per_group: int

    def __post_init__(self):
        for field_ in ("hosts", "planes", "hosts_per_leaf", "leaves_per_pod", "spines_per_pod", "cores_per_group"):
            if getattr(self, field_) < 1:
                raise ValueError(f"a 3-tier fabric needs {field_} >= 1 (got {getattr(self, field_)})")

    @property
    def leaves_per_plane(self) -> int:
        return -(-self.hosts // self.hosts_per_leaf)

    @property
    def pods(self) -> int:
        return -(-self.leaves_per_plane // self.leaves_per_pod)

    @property
    def spines_per_plane(self) -> int:
        return self.pods * self.spines_per_pod

    @property
    def cores_per_plane(self) -> int:
        return self.spines_per_pod * self.cores_per_group

    @property
    def host_leaf(self) -> tuple[int, ...]:
        return tuple(i // self.hosts_per_leaf for i in range(self.hosts))

    @property
    def link_count(self) -> int:
        leaves, spines = self.leaves_per_plane, self.spines_per_plane
        return self.planes * (self.hosts + leaves * self.spines_per_pod + spines * self.cores_per_group)

    def host_names(self) -> list[str]:
        return [host_name(i) for i in range(self.hosts)]

    def pod_of_leaf(self, leaf: int) -> int:
        return leaf // self.leaves_per_pod

    def nodes(self) -> Iterator[tuple[str, str, int | None]]:
        """(name, role, plane) of every node: the hosts (plane None), then per plane its leaves,
        spines and cores."""
        return _nodes(self.host_names(), self.planes, self.leaves_per_plane, self.spines_per_plane, self.cores_per_plane)

    def links(self) -> Iterator[GeneratedLink]:
        """Every link, per plane: host uplinks by host, leaf-spine links by (leaf, spine), then
        spine-core links by (spine, core)."""
        hosts = self.host_names()
        per_pod, per_group = self.spines_per_pod, self.cores_per_group
        for p in range(self.planes):
            for i, host in enumerate(hosts):
                leaf = i // self.hosts_per_leaf
                yield GeneratedLink(link_name(host, leaf_name(p, leaf)), HOST_LEAF, p, host, leaf_name(p, leaf), i, leaf)
            for leaf in range(self.leaves_per_plane):
                a = leaf_name(p, leaf)
                first = self.pod_of_leaf(leaf) * per_pod
                for spine in range(first, first + per_pod):
                    yield GeneratedLink(link_name(a, spine_name(p, spine)), LEAF_SPINE, p, a, spine_name(p, spine),
                                        leaf, spine)
            for spine in range(self.spines_per_plane):
                a = spine_name(p, spine)
                first = (spine % per_pod) * per_group
                for core in range(first, first + per_group):
                    yield GeneratedLink(link_name(a, core_name(p, core)), SPINE_CORE, p, a, core_name(p, core),
                                        spine, core)

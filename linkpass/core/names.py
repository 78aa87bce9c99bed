"""Names of a multi-plane leaf-spine fabric's nodes and links, and the one generator of both.

Pure: no I/O. The testbed (`testbed/topology.py`, which adds interfaces, addresses, routes and
namespaces) and the coordinator's model (`core/fabric.py`: `rail_optimized`, `from_testbed`)
build every node and link from `LeafSpine`, so one fabric has the same names in both and a
name is spelled in this file only:

    host i                 h{i}
    leaf l of plane p      p{p}l{l}
    spine s of plane p     p{p}s{s}
    link                   {a}-{b}   a: the lower-tier end (host or leaf), b: the upper one

Every plane is the same 2-tier fabric: host i hangs off leaf `host_leaf[i]` in every plane (a
rack holds the same hosts on every rail), and every leaf of a plane meets every spine of that
plane. Two attachments are in use, and they agree when the leaves divide the hosts evenly:

    blocks   the testbed: H hosts over L leaves in contiguous, balanced blocks, host i -> leaf
             i*L//H (a leaf's hosts summarise into a few prefixes)
    racks    a rail-optimized fleet: host i -> leaf i // hosts_per_leaf (the last rack may be short)

`links()` yields, per plane, the host uplinks by host, then the leaf-spine links by (leaf,
spine). That order is part of the contract: the model numbers a plane's spines in the order
their links first appear, and generated addresses follow it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, NamedTuple

# node roles
HOST = "host"
LEAF = "leaf"
SPINE = "spine"
ROLES = (HOST, LEAF, SPINE)

# link tiers (a link's kind)
HOST_LEAF = "host-leaf"
LEAF_SPINE = "leaf-spine"
TIERS = (HOST_LEAF, LEAF_SPINE)

_HOST_RE = re.compile(r"h([0-9]+)")
_SWITCH_RE = re.compile(r"p(0|[1-9][0-9]*)([ls])(0|[1-9][0-9]*)")


def host_name(host: int) -> str:
    return f"h{host}"


def leaf_name(plane: int, leaf: int) -> str:
    return f"p{plane}l{leaf}"


def spine_name(plane: int, spine: int) -> str:
    return f"p{plane}s{spine}"


def link_name(a: str, b: str) -> str:
    """The link between lower-tier node `a` and upper-tier node `b`: "h0-p0l0", "p0l0-p0s1"."""
    return f"{a}-{b}"


def link_ends(link: str) -> tuple[str, str]:
    """("h0", "p0l0") from "h0-p0l0": the inverse of link_name; ValueError if it is not a link name."""
    a, sep, b = link.partition("-")
    if not sep or not (_HOST_RE.fullmatch(a) or _SWITCH_RE.fullmatch(a)) or not _SWITCH_RE.fullmatch(b):
        raise ValueError(f"{link!r} is not a link name (h0-p0l0, p0l0-p0s1, ...)")
    return a, b


def host_index(name: str) -> int:
    """3 from "h3" (and from "h03"); ValueError if `name` is not a host name."""
    m = _HOST_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a host name (h0, h1, ...)")
    return int(m.group(1))


def plane_of(switch: str) -> int:
    """1 from "p1l0" or "p1s3"; ValueError if `switch` is not a leaf or spine name."""
    m = _SWITCH_RE.fullmatch(switch)
    if m is None:
        raise ValueError(f"{switch!r} is not a leaf or spine name (p0l0, p0s0, ...)")
    return int(m.group(1))


class LeafSpineLink(NamedTuple):
    """One generated link, with the indices its ends were generated from (for address plans).
    A tuple: a 16k-GPU fleet generates 32 768 of them."""

    name: str
    kind: str  # HOST_LEAF | LEAF_SPINE
    plane: int
    a: str
    b: str
    lower: int  # a's index: the host (HOST_LEAF) or the leaf (LEAF_SPINE)
    upper: int  # b's index: the leaf (HOST_LEAF) or the spine (LEAF_SPINE)


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

    def host_names(self) -> list[str]:
        return [host_name(i) for i in range(self.hosts)]

    def hosts_of_leaf(self, leaf: int) -> list[int]:
        """Host indices under leaf index `leaf` (of any plane), in order."""
        return [i for i, at in enumerate(self.host_leaf) if at == leaf]

    def nodes(self) -> Iterator[tuple[str, str, int | None]]:
        """(name, role, plane) of every node: the hosts (plane None), then per plane its leaves and spines."""
        for name in self.host_names():
            yield name, HOST, None
        for p in range(self.planes):
            for leaf in range(self.leaves_per_plane):
                yield leaf_name(p, leaf), LEAF, p
            for spine in range(self.spines_per_plane):
                yield spine_name(p, spine), SPINE, p

    def links(self) -> Iterator[LeafSpineLink]:
        """Every link, per plane: host uplinks by host, then leaf-spine links by (leaf, spine)."""
        hosts = self.host_names()
        for p in range(self.planes):
            leaves = [leaf_name(p, leaf) for leaf in range(self.leaves_per_plane)]
            spines = [spine_name(p, spine) for spine in range(self.spines_per_plane)]
            for i, host in enumerate(hosts):
                leaf = self.host_leaf[i]
                yield LeafSpineLink(link_name(host, leaves[leaf]), HOST_LEAF, p, host, leaves[leaf], i, leaf)
            for leaf, a in enumerate(leaves):
                for spine, b in enumerate(spines):
                    yield LeafSpineLink(link_name(a, b), LEAF_SPINE, p, a, b, leaf, spine)

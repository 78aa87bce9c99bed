"""The fleet topology model the coordinator reasons on: a multi-plane, 2-tier leaf-spine fabric.

Pure: no sockets, no files, no clock reads.

Nodes are named as in the testbed: hosts `h{i}`, leaves `p{p}l{l}`, spines `p{p}s{s}`. A
physical link joins a lower-tier node `a` (host or leaf) to an upper-tier node `b` (leaf or
spine) and is named `"{a}-{b}"` ("h0-p0l0", "p0l0-p0s1"). Every plane is an independent
fabric; a host has one NIC, hence one uplink, per plane.

Faults are often one-directional, so the unit of reasoning is the *directed* link, written
`"{name}:up"` (a -> b, away from the hosts) or `"{name}:down"` (b -> a). That is a link's
direction; a path's (its probes forward, its replies reverse: `states.Direction`) is another
thing: a probe between hosts crosses links up, then down, and its reply the other way.

Path discovery reports, per TTL, the address of the router interface a probe CAME IN ON. That
address belongs to one end of one link, so it names the link and the direction it was crossed
in: an address owned by `b` means the probe went up, one owned by `a` that it went down. The
last link (into the destination host) is named by the destination's NIC address, its uplink's
`a_addr`. `links_of_path` turns such hop lists into directed links.

Spines of a plane are indexed in the order their links first appear (spine index s is
`p{p}s{s}` in generated and testbed fabrics); a path between two leaves is fixed by its spine.
"""
from __future__ import annotations

import ipaddress

from dataclasses import dataclass
from typing import Iterable, Sequence

HOST_LEAF = "host-leaf"
LEAF_SPINE = "leaf-spine"
TIERS = (HOST_LEAF, LEAF_SPINE)
# a link's direction, by tier: these strings are in directed link names and in JSON documents
UP = "up"  # a -> b: away from the hosts
DOWN = "down"  # b -> a: towards the hosts
LINK_DIRECTIONS = (UP, DOWN)
EITHER = "either"  # a finding's direction when the evidence names the link but not which way


class FabricError(ValueError):
    """The model or a question put to it is inconsistent; the message says what and where."""


@dataclass(frozen=True, slots=True)
class FleetLink:
    """A physical link; `a` is the lower-tier node (host or leaf), `b` the upper one."""

    name: str
    kind: str  # HOST_LEAF | LEAF_SPINE
    plane: int
    a: str
    b: str
    a_addr: str | None = None  # address of a's interface, without prefix length
    b_addr: str | None = None


def directed(name: str, direction: str) -> str:
    """`"h0-p0l0:up"` from ("h0-p0l0", "up")."""
    if direction not in LINK_DIRECTIONS:
        raise FabricError(f"direction {direction!r} is unknown; use 'up' or 'down'")
    return f"{name}:{direction}"


def split_directed(s: str) -> tuple[str, str]:
    """("h0-p0l0", "up") from `"h0-p0l0:up"`."""
    name, sep, direction = s.rpartition(":")
    if not sep or direction not in LINK_DIRECTIONS or not name:
        raise FabricError(f"{s!r} is not a directed link; expected 'LINK:up' or 'LINK:down'")
    return name, direction


def opposite(direction: str) -> str:
    """The other way across a link: DOWN for UP, UP for DOWN."""
    if direction not in LINK_DIRECTIONS:
        raise FabricError(f"direction {direction!r} is unknown; use 'up' or 'down'")
    return DOWN if direction == UP else UP


def mirror(s: str) -> str:
    """The same link the other way: `"h0-p0l0:down"` from `"h0-p0l0:up"`."""
    name, direction = split_directed(s)
    return f"{name}:{opposite(direction)}"


def _bare(addr: str | None) -> str | None:
    return addr.split("/")[0] if addr else None


class FabricModel:
    """Hosts, planes and links, with the indexes path questions need."""

    def __init__(self, hosts: Sequence[str], planes: int, links: Iterable[FleetLink]):
        self.hosts: list[str] = list(hosts)
        self.planes = planes
        self.links: dict[str, FleetLink] = {}
        self._uplink: dict[tuple[str, int], str] = {}  # (host, plane) -> link name
        self._spines: list[list[str]] = [[] for _ in range(planes)]
        self._spine_index: dict[str, int] = {}
        self._leaf_spine: dict[tuple[str, int], str] = {}  # (leaf, spine index) -> link name
        self._hosts_of_leaf: dict[str, list[str]] = {}
        self._addr: dict[str, tuple[str, str]] | None = None  # built on first use
        host_set = set(self.hosts)
        if len(host_set) != len(self.hosts):
            raise FabricError("host names repeat")
        for lk in links:
            if lk.name in self.links:
                raise FabricError(f"link {lk.name} appears twice")
            if not 0 <= lk.plane < planes:
                raise FabricError(f"link {lk.name}: plane {lk.plane} outside 0..{planes - 1}")
            self.links[lk.name] = lk
            if lk.kind == HOST_LEAF:
                if lk.a not in host_set:
                    raise FabricError(f"link {lk.name}: {lk.a} is not a host of this fleet")
                if (lk.a, lk.plane) in self._uplink:
                    raise FabricError(f"host {lk.a} has two uplinks on plane {lk.plane}: "
                                     f"{self._uplink[(lk.a, lk.plane)]} and {lk.name}")
                self._uplink[(lk.a, lk.plane)] = lk.name
                self._hosts_of_leaf.setdefault(lk.b, []).append(lk.a)
            elif lk.kind == LEAF_SPINE:
                index = self._spine_index.get(lk.b)
                if index is None:
                    index = self._spine_index[lk.b] = len(self._spines[lk.plane])
                    self._spines[lk.plane].append(lk.b)
                self._leaf_spine[(lk.a, index)] = lk.name
            else:
                raise FabricError(f"link {lk.name}: kind {lk.kind!r} is unknown; one of {', '.join(TIERS)}")

    # ---- lookups ---------------------------------------------------------------------------
    def link(self, name: str) -> FleetLink:
        try:
            return self.links[name]
        except KeyError:
            raise FabricError(f"no link named {name!r} in this fleet") from None

    def tier(self, link_name: str) -> str:
        return self.link(link_name).kind

    def uplink(self, host: str, plane: int) -> FleetLink:
        try:
            return self.links[self._uplink[(host, plane)]]
        except KeyError:
            raise FabricError(f"host {host!r} has no uplink on plane {plane}") from None

    def leaf_of(self, host: str, plane: int) -> str:
        return self.uplink(host, plane).b

    def spines(self, plane: int) -> list[str]:
        """Spine names of `plane`, by spine index."""
        return list(self._spines[plane])

    def hosts_of_leaf(self, leaf: str) -> list[str]:
        return list(self._hosts_of_leaf.get(leaf, ()))

    def leaf_spine(self, leaf: str, spine: int) -> FleetLink:
        try:
            return self.links[self._leaf_spine[(leaf, spine)]]
        except KeyError:
            raise FabricError(f"leaf {leaf} has no link to spine index {spine}") from None

    def owner(self, addr: str) -> tuple[str, str]:
        """(link name, node owning the address) for an interface address."""
        if self._addr is None:
            index: dict[str, tuple[str, str]] = {}
            for lk in self.links.values():
                for addr_, node in ((lk.a_addr, lk.a), (lk.b_addr, lk.b)):
                    if addr_ is None:
                        continue
                    if addr_ in index:
                        raise FabricError(f"address {addr_} is on both {index[addr_][0]} and {lk.name}")
                    index[addr_] = (lk.name, node)
            self._addr = index
        try:
            return self._addr[_bare(addr)]
        except KeyError:
            raise FabricError(f"address {addr} is on no link of this fleet (addresses unknown to the model?)") from None

    def links_by_tier(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {t: [] for t in TIERS}
        for lk in self.links.values():
            out[lk.kind].append(lk.name)
        return out

    # ---- paths -----------------------------------------------------------------------------
    def node_path(self, src_host: str, dst_host: str, plane: int, spine: int | None) -> tuple[str, ...]:
        """Directed links from src to dst on `plane` through spine index `spine`.

        Same-leaf pairs never reach a spine, so `spine` is ignored for them; between leaves it
        is required."""
        up = self.uplink(src_host, plane)
        down = self.uplink(dst_host, plane)
        if up.b == down.b:
            return (directed(up.name, UP), directed(down.name, DOWN))
        if spine is None:
            raise FabricError(f"{src_host} and {dst_host} are on different leaves of plane {plane}: "
                             "a path between them needs a spine index")
        return (directed(up.name, UP), directed(self.leaf_spine(up.b, spine).name, UP),
                directed(self.leaf_spine(down.b, spine).name, DOWN), directed(down.name, DOWN))

    def reverse_definite(self, src_host: str, plane: int, dst_host: str) -> tuple[str, ...]:
        """Links every reply dst -> src crosses, whatever spine ECMP picks for it."""
        up = self.uplink(dst_host, plane)
        down = self.uplink(src_host, plane)
        # between leaves the spine is ECMP's choice; for a same-leaf pair these two are the path
        return (directed(up.name, UP), directed(down.name, DOWN))

    def links_of_path(self, src_host: str, plane: int, hops: Sequence[str | None],
                      dst_addr: str) -> tuple[str, ...]:
        """Directed links a probe crossed, from the hop addresses discovery reported.

        `hops` are the answering interface addresses per TTL, destination excluded, None for a
        TTL nobody answered; `dst_addr` is the destination's NIC address on `plane`. A gap is
        filled when the topology leaves one choice (a leaf, or a spine named by the other side
        of the path); otherwise FabricError."""
        up = self.uplink(src_host, plane)
        dst_link_name, dst_host = self.owner(dst_addr)
        down = self.links[dst_link_name]
        if down.kind != HOST_LEAF or dst_host != down.a:
            raise FabricError(f"destination address {dst_addr} is not a host NIC (it is on {down.name}, owned by {dst_host})")
        if down.plane != plane:
            raise FabricError(f"destination address {dst_addr} is on plane {down.plane}, not {plane}")
        seen = [None if h is None else self._hop(h) for h in hops]
        if up.b == down.b:
            expected = [directed(up.name, UP), directed(down.name, DOWN)]
        else:
            spine = None
            for i, (position, side) in ((1, (up.b, UP)), (2, (down.b, DOWN))):
                if i < len(seen) and seen[i] is not None:
                    lk = self.links[split_directed(seen[i])[0]]
                    if lk.kind != LEAF_SPINE or lk.a != position or split_directed(seen[i])[1] != side:
                        raise FabricError(f"hop {i + 1} ({hops[i]}) is {seen[i]}, which is not on a path "
                                         f"{src_host} -> {dst_host} on plane {plane}")
                    s = self._spine_index[lk.b]
                    if spine is not None and s != spine:
                        raise FabricError(f"hops 2 and 3 name different spines ({hops[1]}, {hops[2]})")
                    spine = s
            if spine is None:
                if len(self._spines[plane]) != 1:
                    raise FabricError(f"hops {list(hops)} from {src_host} to {dst_host} on plane {plane}: "
                                     "no spine answered and the plane has several; the path is ambiguous")
                spine = 0
            expected = list(self.node_path(src_host, dst_host, plane, spine))
        if len(hops) != len(expected) - 1:
            raise FabricError(f"{len(hops)} hops from {src_host} to {dst_host} on plane {plane}; "
                             f"this fabric's path has {len(expected) - 1} routers")
        for i, got in enumerate(seen):
            if got is not None and got != expected[i]:
                raise FabricError(f"hop {i + 1} ({hops[i]}) is {got}; the path {src_host} -> {dst_host} "
                                 f"on plane {plane} crosses {expected[i]} there")
        return tuple(expected)

    def hops_of(self, src_host: str, dst_host: str, plane: int, spine: int | None) -> tuple[list[str], str]:
        """What discovery would report for this path: the address of the interface each router
        takes the probe in on, and the destination's NIC address (the inverse of links_of_path)."""
        out = []
        for d in self.node_path(src_host, dst_host, plane, spine):
            name, direction = split_directed(d)
            lk = self.links[name]
            addr = lk.b_addr if direction == UP else lk.a_addr
            if addr is None:
                raise FabricError(f"link {name} has no addresses (generate the model with addressed=True)")
            out.append(addr)
        return out[:-1], out[-1]

    def _hop(self, addr: str) -> str:
        name, node = self.owner(addr)
        lk = self.links[name]
        return directed(name, UP if node == lk.b else DOWN)

    # ---- persistence -----------------------------------------------------------------------
    LINK_FIELDS = ("name", "kind", "plane", "a", "b", "a_addr", "b_addr")

    def to_dict(self) -> dict:
        """JSON-ready; links as rows of `link_fields` (a 16k-GPU fleet has 32 768 of them)."""
        return {"hosts": list(self.hosts), "planes": self.planes, "link_fields": list(self.LINK_FIELDS),
                "links": [[lk.name, lk.kind, lk.plane, lk.a, lk.b, lk.a_addr, lk.b_addr]
                          for lk in self.links.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "FabricModel":
        fields = d.get("link_fields", list(cls.LINK_FIELDS))
        try:
            links = [FleetLink(**dict(zip(fields, row))) for row in d["links"]]
            return cls(d["hosts"], int(d["planes"]), links)
        except (KeyError, TypeError) as exc:
            raise FabricError(f"not a fleet model document: {exc}") from None


_ADDRESS_BLOCK = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544 benchmarking range


def rail_optimized(hosts: int, rails: int, hosts_per_leaf: int, spines_per_plane: int,
                   addressed: bool = False) -> FabricModel:
    """A generated 2-tier rail-optimized fabric: NIC r of every host on plane r, host i under
    leaf i // hosts_per_leaf of every plane, every leaf linked to every spine of its plane.

    `addressed`: give every link a /31 from 198.18.0.0/15 (lower end on the a side), so the
    model can map discovery hops like a real fabric's (`hops_of` makes them); 16 384 GPUs use
    half the block."""
    if min(hosts, rails, hosts_per_leaf, spines_per_plane) < 1:
        raise FabricError("hosts, rails, hosts_per_leaf and spines_per_plane must all be >= 1")
    leaves = -(-hosts // hosts_per_leaf)
    if addressed and 2 * rails * (hosts + leaves * spines_per_plane) > _ADDRESS_BLOCK.num_addresses:
        raise FabricError(f"addressed: {rails * (hosts + leaves * spines_per_plane)} links need more /31s than "
                         f"{_ADDRESS_BLOCK} holds; generate it without addresses")
    base = int(_ADDRESS_BLOCK.network_address)
    names = [f"h{i}" for i in range(hosts)]
    links = []

    def link(name, kind, plane, a, b):
        if not addressed:
            return FleetLink(name, kind, plane, a, b)
        k = 2 * len(links)
        return FleetLink(name, kind, plane, a, b, str(ipaddress.IPv4Address(base + k)),
                         str(ipaddress.IPv4Address(base + k + 1)))

    for p in range(rails):
        for i, h in enumerate(names):
            leaf = f"p{p}l{i // hosts_per_leaf}"
            links.append(link(f"{h}-{leaf}", HOST_LEAF, p, h, leaf))
        for leaf_i in range(leaves):
            leaf = f"p{p}l{leaf_i}"
            for s in range(spines_per_plane):
                spine = f"p{p}s{s}"
                links.append(link(f"{leaf}-{spine}", LEAF_SPINE, p, leaf, spine))
    return FabricModel(names, rails, links)


def from_testbed(fab) -> FabricModel:
    """The model of a `linkpass.testbed.topology.Fabric`, with its interface addresses."""
    links = [FleetLink(lk.name, lk.kind, lk.plane, lk.a, lk.b, _bare(lk.a_addr), _bare(lk.b_addr))
             for lk in fab.links.values()]
    return FabricModel(fab.hosts, fab.spec.planes, links)

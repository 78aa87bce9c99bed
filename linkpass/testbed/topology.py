"""Multi-plane leaf-spine fabric as plain data: nodes, links, addresses, routes.

Pure: no sockets, no netlink, no files. `build.py` is the only code that turns a
`Fabric` into namespaces; everything here is unit-testable without root.

Address plan (all inside 198.18.0.0/15, the RFC 2544 benchmarking range):

    198.18.0.0/20            service addresses, host i -> 198.18.0.0 + 1 + i (/32 on lo)
    198.18.64.0/18           host uplinks, one /21 per plane p: 198.18.64.0 + p*2048;
                             host i: leaf side .2i, host NIC .2i+1 (/31)
    198.18.128.0/17          leaf-spine links, one /20 per plane p: 198.18.128.0 + p*4096;
                             link (l, s): index l*S+s, leaf side .2idx, spine side .2idx+1 (/31)
    198.19.0.0/16            management networks, one /24 per testbed (root side .1, host i .i+2)

Nodes and links, and their names, come from `linkpass.core.names` (the generator the
coordinator's fabric model uses too), laid out as `LeafSpine.blocks`: hosts attach to leaves in
contiguous blocks (a rack per leaf), host i -> leaf i*L//H, so a leaf's hosts summarise into a
few prefixes and spines need few routes. This module adds what only a testbed has: interfaces,
addresses, MACs, routes, namespace names. A host's NIC is named after its plane ("p0"); a
switch port after the node at its other end: a leaf's port to h3 is "h3", to spine 1 "s1", a
spine's port to leaf 0 "l0".
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from ..core.names import (HOST, HOST_LEAF, LEAF_SPINE, PRESET_SHAPES, LeafSpine, host_index, host_name, leaf_name,
                          link_name, plane_of, spine_name)

SERVICE_BLOCK = ipaddress.IPv4Network("198.18.0.0/20")
HOST_LINK_BLOCK = ipaddress.IPv4Network("198.18.64.0/18")
FABRIC_LINK_BLOCK = ipaddress.IPv4Network("198.18.128.0/17")
MGMT_BLOCK = ipaddress.IPv4Network("198.19.0.0/16")

MAX_PLANES = 8
MAX_HOSTS_PER_PLANE = 1024  # /21 of /31s
MAX_LEAF_SPINE_LINKS = 2048  # /20 of /31s
MAX_HOSTS = 253  # management /24
MAX_RDMA_HOSTS = 3  # each guest is a TCG-emulated VM with its own core's worth of work
# what the guests boot (rdma/guest/build-image.sh): `rdma`, a small init of the project's own;
# `systemd`, the same root with systemd as PID 1, where the fleet package's units run for real
GUEST_IMAGES = ("rdma", "systemd")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")

PRESETS: dict[str, dict] = PRESET_SHAPES  # the shapes are the generator's; the testbed adds addresses

_SPEC_FIELDS = {
    "name": "a short label for this topology",
    "hosts": f"integer 2..{MAX_HOSTS}",
    "planes": f"integer 1..{MAX_PLANES}",
    "leaves_per_plane": "integer >= 1 and <= hosts",
    "spines_per_plane": "integer >= 1",
    "mtu": "integer 1280..9000",
    "management": "mapping with optional 'subnet' (a /24 inside 198.19.0.0/16)",
    "rdma_hosts": f"list of up to {MAX_RDMA_HOSTS} host indices that run as Soft-RoCE guests, e.g. [0, 3]",
    "guest_image": f"what the guests boot: {' or '.join(GUEST_IMAGES)} (systemd as PID 1); default rdma",
}


class TestbedError(RuntimeError):
    """Building or changing the testbed failed; the message says what to do."""

    __test__ = False  # not a pytest class, despite the name


class TopologyError(ValueError):
    """A topology description is invalid. The message names the field and what is allowed."""


@dataclass(frozen=True)
class Spec:
    hosts: int
    planes: int
    leaves_per_plane: int
    spines_per_plane: int
    name: str = "custom"
    mtu: int = 1500
    mgmt_subnet: str | None = None  # None: pick a free /24 at build time
    rdma_hosts: tuple[int, ...] = ()  # hosts that are Soft-RoCE guests (QEMU) instead of namespaces
    guest_image: str = "rdma"  # GUEST_IMAGES: the guests' init, a small one of ours or systemd


@dataclass(frozen=True)
class Link:
    """A point-to-point link; `a` is the lower tier (host or leaf), `b` the upper."""

    name: str
    kind: str  # HOST_LEAF | LEAF_SPINE
    plane: int
    a: str
    a_if: str
    a_addr: str
    b: str
    b_if: str
    b_addr: str

    def end(self, node: str) -> tuple[str, str]:
        """(interface, address) of this link on `node`."""
        if node == self.a:
            return self.a_if, self.a_addr
        if node == self.b:
            return self.b_if, self.b_addr
        raise TopologyError(f"node {node!r} is not an end of link {self.name} (ends: {self.a}, {self.b})")

    def other(self, node: str) -> str:
        self.end(node)
        return self.b if node == self.a else self.a


@dataclass(frozen=True)
class Route:
    dst: str  # CIDR
    via: tuple[tuple[str, str], ...]  # (gateway, interface) per nexthop; >1 means ECMP
    src: str | None = None


@dataclass(frozen=True)
class Node:
    name: str
    role: str  # HOST | LEAF | SPINE
    plane: int | None = None
    sysctls: tuple[tuple[str, str], ...] = ()


@dataclass
class Fabric:
    spec: Spec
    prefix: str
    mgmt_subnet: str
    nodes: dict[str, Node] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)
    routes: dict[str, list[Route]] = field(default_factory=dict)
    uplinks: dict[tuple[str, int], str] = field(default_factory=dict, repr=False)  # (host, plane) -> link name

    # ---- names -------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def is_guest(self, node: str | int) -> bool:
        """Whether a host runs as a Soft-RoCE guest (its NICs are TAPs in its leaves; no namespace)."""
        if isinstance(node, str):
            info = self.nodes.get(node)
            if info is None or info.role != HOST:
                return False
            node = host_index(node)
        return node in self.spec.rdma_hosts

    def guest_tap(self, host: int) -> str:
        """The root-namespace TAP of a guest's management NIC (on the management bridge)."""
        return f"{self.prefix}-g{host}"

    @property
    def mgmt_bridge(self) -> str:
        return f"{self.prefix}-mgmt"

    def mgmt_root_if(self, host: int) -> str:
        return f"{self.prefix}-m{host}"

    # ---- addresses ---------------------------------------------------------------------
    def service_addr(self, host: int) -> str:
        return service_addr(host)

    def nic_addr(self, host: int, plane: int) -> str:
        return str(host_link_addrs(plane, host)[1])

    def mgmt_addr(self, host: int) -> str:
        net = ipaddress.IPv4Network(self.mgmt_subnet)
        return str(net.network_address + 2 + host)

    @property
    def mgmt_root_addr(self) -> str:
        return str(ipaddress.IPv4Network(self.mgmt_subnet).network_address + 1)

    # ---- lookups -----------------------------------------------------------------------
    @property
    def hosts(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.role == HOST]

    def uplink(self, host: str, plane: int) -> Link:
        """The link from host `host` (a name: "h3") to its leaf on `plane`."""
        try:
            return self.links[self.uplinks[(host, plane)]]
        except KeyError:
            raise TopologyError(f"host {host!r} has no uplink on plane {plane} in this testbed "
                                f"(hosts {host_name(0)}..{host_name(self.spec.hosts - 1)}, "
                                f"planes 0..{self.spec.planes - 1})") from None

    def leaf_of(self, host: int, plane: int) -> str:
        """Leaf name of host number `host` on `plane` (addresses are numbered by host, too)."""
        return self.uplink(host_name(host), plane).b

    def leaf_spine(self, leaf: str, spine: int) -> Link:
        """The link from `leaf` to spine index `spine` of its plane."""
        try:
            return self.links[link_name(leaf, spine_name(plane_of(leaf), spine))]
        except (KeyError, ValueError):
            raise TopologyError(f"leaf {leaf!r} has no link to spine index {spine} in this testbed") from None

    def link(self, name: str) -> Link:
        """Find a link by name, in either order of its ends ("h0-p0l0" or "p0l0-h0")."""
        if name in self.links:
            return self.links[name]
        parts = name.split("-")
        if len(parts) == 2 and link_name(parts[1], parts[0]) in self.links:
            return self.links[link_name(parts[1], parts[0])]
        examples = ", ".join(list(self.links)[:3])
        raise TopologyError(f"no link named {name!r} in this testbed (e.g. {examples}; `linkpass testbed show` lists all)")

    def links_of(self, node: str) -> list[Link]:
        return [lk for lk in self.links.values() if node in (lk.a, lk.b)]

    def neighbors(self, node: str) -> list[tuple[str, str, str]]:
        """(interface, peer address, peer MAC) for every fabric link of `node`.

        Installed as permanent entries: ARP timers (up to 1 s after a link returns) would
        otherwise blur what the faults do and add noise to interface counters.
        """
        out = []
        for lk in self.links_of(node):
            my_if, _ = lk.end(node)
            _, peer_addr = lk.end(lk.other(node))
            ip = peer_addr.split("/")[0]
            out.append((my_if, ip, mac_of(ip)))
        return out

    def as_dict(self) -> dict:
        s = self.spec
        return {
            "prefix": self.prefix,
            "name": s.name,
            "hosts": s.hosts,
            "planes": s.planes,
            "leaves_per_plane": s.leaves_per_plane,
            "spines_per_plane": s.spines_per_plane,
            "mtu": s.mtu,
            "rdma_hosts": list(s.rdma_hosts),
            "guest_image": s.guest_image,
            "management": {"subnet": self.mgmt_subnet, "bridge": self.mgmt_bridge, "root_addr": self.mgmt_root_addr},
            "host_list": [
                {
                    "name": host_name(i),
                    "netns": None if self.is_guest(i) else self.netns(host_name(i)),
                    "kind": "soft-roce guest" if self.is_guest(i) else "namespace",
                    "service": self.service_addr(i),
                    "mgmt": self.mgmt_addr(i),
                    "nics": {nic_ifname(p): self.nic_addr(i, p) for p in range(s.planes)},
                    "leaves": [self.leaf_of(i, p) for p in range(s.planes)],
                }
                for i in range(s.hosts)
            ],
            "links": [
                {"name": lk.name, "kind": lk.kind, "plane": lk.plane,
                 "a": lk.a, "a_if": lk.a_if, "a_addr": lk.a_addr,
                 "b": lk.b, "b_if": lk.b_if, "b_addr": lk.b_addr}
                for lk in self.links.values()
            ],
        }


# ---- address arithmetic (module level so other layers reuse it) --------------------------

def mac_of(addr: str) -> str:
    """Deterministic, locally administered MAC of a fabric interface, from its IPv4 address."""
    return "02:00:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(addr.split("/")[0]).packed)


def service_addr(host: int) -> str:
    return str(SERVICE_BLOCK.network_address + 1 + host)


def plane_host_block(plane: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network((int(HOST_LINK_BLOCK.network_address) + plane * 2048, 21))


def host_link_addrs(plane: int, host: int) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """(leaf side, host side) of host `host`'s uplink on `plane`."""
    base = plane_host_block(plane).network_address + 2 * host
    return base, base + 1


def fabric_link_addrs(plane: int, index: int) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """(leaf side, spine side) of leaf-spine link number `index` on `plane`."""
    base = FABRIC_LINK_BLOCK.network_address + plane * 4096 + 2 * index
    return base, base + 1


def mgmt_subnet_for_slot(slot: int) -> str:
    if not 0 <= slot < 256:
        raise TopologyError(f"management slot {slot} out of range 0..255")
    return str(ipaddress.IPv4Network((int(MGMT_BLOCK.network_address) + 256 * slot, 24)))


# ---- parsing and validation -------------------------------------------------------------

def _int_field(raw: dict, key: str, lo: int, hi: int, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{where}.{key}: expected an integer {lo}..{hi}, got {value!r}")
    if not lo <= value <= hi:
        raise TopologyError(f"{where}.{key}: {value} is out of range; allowed {lo}..{hi}")
    return value


def parse_spec(raw: object, where: str = "topology") -> Spec:
    """Validate a topology mapping (from YAML or a preset). Errors name the field and the fix."""
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: expected a mapping with fields {', '.join(_SPEC_FIELDS)}, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_SPEC_FIELDS))
    if unknown:
        allowed = "; ".join(f"{k} ({v})" for k, v in _SPEC_FIELDS.items())
        raise TopologyError(f"{where}.{unknown[0]}: unknown field; allowed fields: {allowed}")
    for key in ("hosts", "planes", "leaves_per_plane", "spines_per_plane"):
        if key not in raw:
            raise TopologyError(f"{where}.{key}: required field is missing ({_SPEC_FIELDS[key]})")
    hosts = _int_field(raw, "hosts", 2, MAX_HOSTS, where)
    planes = _int_field(raw, "planes", 1, MAX_PLANES, where)
    leaves = _int_field(raw, "leaves_per_plane", 1, hosts, where)
    spines = _int_field(raw, "spines_per_plane", 1, MAX_LEAF_SPINE_LINKS // leaves, where)
    mtu = _int_field(raw, "mtu", 1280, 9000, where) if "mtu" in raw else 1500
    name = raw.get("name", "custom")
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{where}.name: expected a non-empty string, got {name!r}")
    subnet = None
    mgmt = raw.get("management")
    if mgmt is not None:
        if not isinstance(mgmt, dict) or set(mgmt) - {"subnet"}:
            raise TopologyError(f"{where}.management: expected a mapping with only 'subnet', got {mgmt!r}")
        if "subnet" in mgmt:
            subnet = _parse_mgmt_subnet(mgmt["subnet"], f"{where}.management.subnet")
    rdma = parse_rdma_hosts(raw.get("rdma_hosts", ()), hosts, f"{where}.rdma_hosts")
    image = raw.get("guest_image", "rdma")
    if image not in GUEST_IMAGES:
        raise TopologyError(f"{where}.guest_image: {image!r} is not an image; use {' or '.join(GUEST_IMAGES)}")
    return Spec(hosts=hosts, planes=planes, leaves_per_plane=leaves, spines_per_plane=spines,
                name=name, mtu=mtu, mgmt_subnet=subnet, rdma_hosts=rdma, guest_image=image)


def parse_rdma_hosts(value: object, hosts: int, where: str = "rdma_hosts") -> tuple[int, ...]:
    """Host indices to run as Soft-RoCE guests: a list (or "0,3") of distinct indices < hosts."""
    if isinstance(value, str):
        parts = [v.strip() for v in value.split(",") if v.strip()]
        try:
            value = [int(v) for v in parts]
        except ValueError:
            raise TopologyError(f"{where}: {value!r} is not a list of host indices; use e.g. 0,3") from None
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TopologyError(f"{where}: expected a list of host indices, e.g. [0, 3], got {value!r}")
    bad = [v for v in value if not 0 <= v < hosts]
    if bad:
        raise TopologyError(f"{where}: host {bad[0]} does not exist; hosts are 0..{hosts - 1}")
    if len(set(value)) != len(value):
        raise TopologyError(f"{where}: {list(value)} names a host twice")
    if len(value) > MAX_RDMA_HOSTS:
        raise TopologyError(f"{where}: {len(value)} guests asked, at most {MAX_RDMA_HOSTS} "
                            f"(each is an emulated VM; this is sized for a 2-core machine)")
    return tuple(sorted(value))


def _parse_mgmt_subnet(value: object, where: str) -> str:
    try:
        net = ipaddress.IPv4Network(str(value))
    except ValueError as exc:
        raise TopologyError(f"{where}: {value!r} is not an IPv4 network ({exc}); use e.g. 198.19.7.0/24") from None
    if net.prefixlen != 24 or not net.subnet_of(MGMT_BLOCK):
        raise TopologyError(f"{where}: {net} must be a /24 inside {MGMT_BLOCK} (testbed addresses stay in 198.18.0.0/15)")
    return str(net)


def load_spec_text(text: str, where: str) -> Spec:
    from ..formats import yaml_doc as yaml  # local: only a file to parse needs YAML

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{where}: not valid YAML: {exc}") from None
    return parse_spec(raw, where)


def preset(name: str) -> Spec:
    if name not in PRESETS:
        raise TopologyError(f"preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return parse_spec(dict(PRESETS[name], name=name), f"preset {name}")


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not PREFIX_RE.match(prefix):
        raise TopologyError(
            f"prefix {prefix!r}: use 1-6 characters, a lowercase letter then lowercase letters or digits "
            "(it starts every namespace and link name, which Linux limits to 15 characters)")
    return prefix


# ---- the fabric ------------------------------------------------------------------------

ROUTER_SYSCTLS = (
    ("net/ipv4/ip_forward", "1"),
    # hash the 5-tuple only, like a switch: with policy 1 a forwarded packet that arrives with the
    # sender's socket hash (veth keeps skb->hash) is hashed by that instead, so a TCP flow's spine
    # was random per socket and moved on every RTO (the kernel re-rolls sk_txhash) — no switch does that
    ("net/ipv4/fib_multipath_hash_policy", "3"),
    ("net/ipv4/fib_multipath_hash_fields", "0x0037"),  # src ip, dst ip, proto, src port, dst port
    ("net/ipv4/icmp_ratelimit", "0"),  # path discovery relies on TTL-exceeded replies
    ("net/ipv4/icmp_msgs_per_sec", "1000000"),  # ... at sweep rates (global ICMP limit)
    ("net/ipv4/icmp_msgs_burst", "100000"),
    ("net/ipv4/icmp_errors_use_inbound_ifaddr", "1"),  # an ICMP error names the link it came in on
    ("net/ipv4/conf/all/rp_filter", "0"),
    ("net/ipv4/conf/default/rp_filter", "0"),
    ("net/ipv6/conf/all/disable_ipv6", "1"),  # IPv4 fabric; keeps RS/MLD noise out of counters
    ("net/ipv6/conf/default/disable_ipv6", "1"),
)
HOST_SYSCTLS = (
    ("net/ipv4/ip_forward", "0"),
    ("net/ipv4/icmp_ratelimit", "0"),  # port-unreachable ends a discovery trace; do not rate-limit it
    ("net/ipv4/icmp_msgs_per_sec", "1000000"),
    ("net/ipv4/icmp_msgs_burst", "100000"),
    ("net/ipv4/fib_multipath_hash_policy", "1"),
    ("net/ipv4/conf/all/rp_filter", "0"),
    ("net/ipv4/conf/default/rp_filter", "0"),
    ("net/ipv6/conf/all/disable_ipv6", "1"),
    ("net/ipv6/conf/default/disable_ipv6", "1"),
)


def _summarise(first: ipaddress.IPv4Address, last: ipaddress.IPv4Address) -> list[str]:
    return [str(n) for n in ipaddress.summarize_address_range(first, last)]


def layout(spec: Spec) -> LeafSpine:
    """The generator's shape of a testbed: hosts in contiguous blocks per leaf."""
    return LeafSpine.blocks(spec.hosts, spec.planes, spec.leaves_per_plane, spec.spines_per_plane)


def nic_ifname(plane: int) -> str:
    """A host's interface on `plane`, named like the plane ("p0")."""
    return f"p{plane}"


def _leaf_port(spine: int) -> str:
    """A leaf's interface to spine index `spine` of its plane."""
    return f"s{spine}"


def _spine_port(leaf: int) -> str:
    """A spine's interface to leaf index `leaf` of its plane."""
    return f"l{leaf}"


def make_fabric(spec: Spec, prefix: str, mgmt_subnet: str) -> Fabric:
    """Expand a spec into nodes, links and per-node routes."""
    check_prefix(prefix)
    mgmt_subnet = _parse_mgmt_subnet(mgmt_subnet, "management.subnet")
    fab = Fabric(spec=spec, prefix=prefix, mgmt_subnet=mgmt_subnet)
    shape = layout(spec)
    P, L, S = spec.planes, spec.leaves_per_plane, spec.spines_per_plane

    for name, role, plane in shape.nodes():
        fab.nodes[name] = Node(name, role, plane, HOST_SYSCTLS if role == HOST else ROUTER_SYSCTLS)
    for lk in shape.links():
        p = lk.plane
        if lk.kind == HOST_LEAF:  # a: host lk.lower, b: its leaf; the leaf's port is named after the host
            leaf_side, host_side = host_link_addrs(p, lk.lower)
            fab.links[lk.name] = Link(lk.name, HOST_LEAF, p, lk.a, nic_ifname(p), f"{host_side}/31",
                                      lk.b, lk.a, f"{leaf_side}/31")
            fab.uplinks[(lk.a, p)] = lk.name
        else:  # a: leaf lk.lower, b: spine lk.upper
            leaf_side, spine_side = fabric_link_addrs(p, lk.lower * S + lk.upper)
            fab.links[lk.name] = Link(lk.name, LEAF_SPINE, p, lk.a, _leaf_port(lk.upper), f"{leaf_side}/31",
                                      lk.b, _spine_port(lk.lower), f"{spine_side}/31")

    # hosts: each plane's NIC block via that plane; service addresses ECMP over all planes,
    # sourced from the host's own service address so replies come back to it.
    for i, host in enumerate(shape.host_names()):
        routes = []
        for p in range(P):
            leaf_side, _ = host_link_addrs(p, i)
            routes.append(Route(str(plane_host_block(p)), ((str(leaf_side), nic_ifname(p)),)))
        hops = tuple((str(host_link_addrs(p, i)[0]), nic_ifname(p)) for p in range(P))
        routes.append(Route(str(SERVICE_BLOCK), hops, src=service_addr(i)))
        fab.routes[host] = routes

    hosts_of_leaf = {l: shape.hosts_of_leaf(l) for l in range(L)}
    for p in range(P):
        for l in range(L):
            routes = []
            for i in hosts_of_leaf[l]:
                _, host_side = host_link_addrs(p, i)
                routes.append(Route(f"{service_addr(i)}/32", ((str(host_side), host_name(i)),)))
            if L > 1:
                ups = tuple((str(fabric_link_addrs(p, l * S + s)[1]), _leaf_port(s)) for s in range(S))
                routes.append(Route(str(plane_host_block(p)), ups))
                routes.append(Route(str(SERVICE_BLOCK), ups))
            fab.routes[leaf_name(p, l)] = routes
        for s in range(S):
            routes = []
            for l in range(L):
                members = hosts_of_leaf[l]
                if not members:
                    continue
                via = ((str(fabric_link_addrs(p, l * S + s)[0]), _spine_port(l)),)
                first, last = members[0], members[-1]
                for net in _summarise(host_link_addrs(p, first)[0], host_link_addrs(p, last)[1]):
                    routes.append(Route(net, via))
                for net in _summarise(ipaddress.IPv4Address(service_addr(first)),
                                      ipaddress.IPv4Address(service_addr(last))):
                    routes.append(Route(net, via))
            fab.routes[spine_name(p, s)] = routes
    return fab

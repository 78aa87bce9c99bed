"""Turn a `Fabric` into real namespaces, veths, addresses, routes and sysctls (and back).

The only module that creates testbed objects. Everything it makes carries the prefix:
namespaces `<prefix>-<node>`, root-namespace links `<prefix>-mgmt` / `<prefix>-m<i>`, so
`clean(prefix)` can reap the leftovers of any crashed run by name alone.
"""
from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import shutil
import signal
import time
from typing import Callable

from ..kernel.rtnl import IPRoute, netns as pr_netns

from ..core.names import HOST, host_index, host_name
from ..kernel import netns as ns_io
from . import guests, state
from .topology import Fabric, Route, Spec, TestbedError, TopologyError, mac_of, make_fabric, mgmt_subnet_for_slot

# pyroute2 speaks in route protocol numbers; 4 = "static" marks testbed baseline routes.
RTPROT_STATIC = 4
NUD_PERMANENT = 0x80


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ---- discovery -------------------------------------------------------------------------

def namespaces_with_prefix(prefix: str) -> list[str]:
    return sorted(n for n in pr_netns.listnetns() if n.startswith(f"{prefix}-"))


def root_links_with_prefix(prefix: str) -> list[str]:
    with IPRoute() as ipr:
        names = [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    return sorted(n for n in names if n and n.startswith(f"{prefix}-"))


def _pick_mgmt_subnet() -> str:
    """First management /24 that no route in the root namespace already uses."""
    with IPRoute() as ipr:
        used = []
        for r in ipr.get_routes(family=2):
            dst = r.get_attr("RTA_DST")
            if dst:
                used.append(ipaddress.IPv4Network(f"{dst}/{r['dst_len']}", strict=False))
    taken_by_state = set()
    for p in state.all_prefixes():
        doc = state.load(p)
        if doc:
            taken_by_state.add(doc.get("mgmt_subnet"))
    for slot in range(256):
        cand = mgmt_subnet_for_slot(slot)
        net = ipaddress.IPv4Network(cand)
        if cand in taken_by_state or any(net.overlaps(u) for u in used):
            continue
        return cand
    raise TestbedError("no free management /24 left in 198.19.0.0/16; remove old testbeds with `linkpass testbed clean --all`")


# ---- build -----------------------------------------------------------------------------

def up(spec: Spec, prefix: str, progress: Progress = _quiet) -> Fabric:
    """Build the testbed; on any failure remove everything built so far and re-raise."""
    t0 = time.perf_counter()
    with state.locked(prefix):
        existing = namespaces_with_prefix(prefix) + root_links_with_prefix(prefix)
        if existing or state.load(prefix):
            raise TestbedError(
                f"a testbed with prefix {prefix!r} already exists ({len(existing)} objects); "
                f"run `linkpass testbed down --prefix {prefix}` first, or choose another --prefix")
        fab = make_fabric(spec, prefix, spec.mgmt_subnet or _pick_mgmt_subnet())
        image = None
        if spec.rdma_hosts:
            progress(f"the {spec.guest_image} guest image for hosts {', '.join(map(str, spec.rdma_hosts))} "
                     f"(built once, minutes; then cached in {guests.IMAGE_CACHE})")
            image = guests.ensure_image(progress, profile=spec.guest_image)
        state.save(prefix, {"status": "building", "spec": spec.__dict__, "mgmt_subnet": fab.mgmt_subnet,
                            "faults": [], "next_fault_id": 1})
        try:
            _build(fab, progress, image)
        except BaseException as exc:
            progress(f"build failed ({exc}); removing what was built")
            _teardown(prefix)
            state.remove(prefix)
            raise
        state.save(prefix, {"status": "up", "spec": spec.__dict__, "mgmt_subnet": fab.mgmt_subnet,
                            "faults": [], "next_fault_id": 1,
                            "built_in_s": round(time.perf_counter() - t0, 3)})
    return fab


def _build(fab: Fabric, progress: Progress, image: "guests.Image | None" = None) -> None:
    names = [n for n in fab.nodes if not fab.is_guest(n)]  # a guest host has no namespace
    progress(f"creating {len(names)} namespaces")
    for node in names:
        ns_io.create_netns(fab.netns(node))
    for node in names:
        ns_io.write_sysctls(fab.netns(node), fab.nodes[node].sysctls)

    sockets: dict[str, IPRoute] = {}
    taps: dict[int, list[int]] = {}
    try:
        for node in names:
            sockets[node] = IPRoute(netns=fab.netns(node))
        progress(f"wiring {len(fab.links)} fabric links")
        for lk in fab.links.values():
            if fab.is_guest(lk.a):
                continue  # its leaf port is the guest's TAP, made below
            sockets[lk.a].link("add", ifname=lk.a_if, kind="veth", address=mac_of(lk.a_addr),
                               peer={"ifname": lk.b_if, "net_ns_fd": fab.netns(lk.b),
                                     "address": mac_of(lk.b_addr)})
        for h in fab.spec.rdma_hosts:
            taps[h] = guests.open_taps(fab, h)
            for p in range(fab.spec.planes):
                lk = fab.links[fab.uplinks[(host_name(h), p)]]
                ipr = sockets[lk.b]
                ipr.link("set", index=ipr.link_lookup(ifname=lk.b_if)[0], address=mac_of(lk.b_addr))
        progress("addresses, neighbours and routes")
        for node, ipr in sockets.items():
            _configure_node(fab, node, ipr)
        progress("wiring the management network")
        _build_mgmt(fab, sockets)
        if taps:
            assert image is not None
            _start_guests(fab, image, taps, progress)
    finally:
        for ipr in sockets.values():
            ipr.close()
        for fds in taps.values():
            for fd in fds:
                os.close(fd)  # the guests hold their own copies; a guest that never started takes its TAPs away


def _start_guests(fab: Fabric, image: "guests.Image", taps: dict[int, list[int]], progress: Progress) -> None:
    procs = {h: guests.launch(fab, h, image, fds) for h, fds in taps.items()}
    progress(f"booting {len(procs)} {image.profile} guest(s) ({', '.join(host_name(h) for h in procs)}; "
             f"emulated, 10-60 s)")
    t0 = time.monotonic()
    for h, proc in procs.items():
        ready = guests.wait_ready(fab.prefix, h, proc)
        progress(f"{host_name(h)} is up after {time.monotonic() - t0:.0f} s: kernel {ready.get('kernel', '?')}, "
                 f"RDMA devices {', '.join(ready.get('rdma', [])) or 'none'}")


def _ifindexes(ipr: IPRoute) -> dict[str, int]:
    return {link.get_attr("IFLA_IFNAME"): link["index"] for link in ipr.get_links()}


def _configure_node(fab: Fabric, node: str, ipr: IPRoute) -> None:
    index = _ifindexes(ipr)
    ipr.link("set", index=index["lo"], state="up")
    if fab.nodes[node].role == HOST:
        ipr.addr("add", index=index["lo"], address=fab.service_addr(host_index(node)), prefixlen=32)
    for lk in fab.links_of(node):
        ifname, addr = lk.end(node)
        ip, plen = addr.split("/")
        ipr.addr("add", index=index[ifname], address=ip, prefixlen=int(plen))
        ipr.link("set", index=index[ifname], mtu=fab.spec.mtu, state="up")
    ensure_neighbors(ipr, fab.neighbors(node), index)
    ensure_routes(ipr, fab.routes.get(node, []), index)


def _build_mgmt(fab: Fabric, sockets: dict[str, IPRoute]) -> None:
    net = ipaddress.IPv4Network(fab.mgmt_subnet)
    with IPRoute() as root:
        root.link("add", ifname=fab.mgmt_bridge, kind="bridge")
        br = root.link_lookup(ifname=fab.mgmt_bridge)[0]
        root.addr("add", index=br, address=fab.mgmt_root_addr, prefixlen=net.prefixlen)
        root.link("set", index=br, state="up")
        for i in range(fab.spec.hosts):
            if fab.is_guest(i):  # its management NIC is a TAP on the bridge; the guest configures its end
                tap = root.link_lookup(ifname=fab.guest_tap(i))[0]
                root.link("set", index=tap, master=br, state="up")
                continue
            root_if = fab.mgmt_root_if(i)
            root.link("add", ifname=root_if, kind="veth",
                      peer={"ifname": "mgmt", "net_ns_fd": fab.netns(host_name(i))})
            idx = root.link_lookup(ifname=root_if)[0]
            root.link("set", index=idx, master=br, state="up")
            host = sockets[host_name(i)]
            hidx = host.link_lookup(ifname="mgmt")[0]
            host.addr("add", index=hidx, address=fab.mgmt_addr(i), prefixlen=net.prefixlen)
            host.link("set", index=hidx, state="up")


def _route_kwargs(index: dict[str, int], route: Route) -> dict:
    dst, plen = route.dst.split("/")
    kw: dict = {"dst": dst, "dst_len": int(plen), "proto": RTPROT_STATIC}
    if route.src:
        kw["prefsrc"] = route.src
    if len(route.via) == 1:
        gw, dev = route.via[0]
        kw["gateway"] = gw
        kw["oif"] = index[dev]
    else:
        kw["multipath"] = [{"gateway": gw, "oif": index[dev]} for gw, dev in route.via]
    return kw


def ensure_neighbors(ipr: IPRoute, neighbors: list[tuple[str, str, str]], index: dict[str, int] | None = None) -> None:
    """Permanent neighbour entries for the node's link peers; idempotent."""
    index = index or _ifindexes(ipr)
    for ifname, ip, mac in neighbors:
        ipr.neigh("replace", dst=ip, lladdr=mac, ifindex=index[ifname], state=NUD_PERMANENT)


def ensure_routes(ipr: IPRoute, routes: list[Route], index: dict[str, int] | None = None) -> None:
    """Install the node's baseline routes; idempotent (route replace)."""
    index = index or _ifindexes(ipr)
    for route in routes:
        ipr.route("replace", **_route_kwargs(index, route))


# ---- teardown --------------------------------------------------------------------------

def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
        time.sleep(0.02)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _flapper_pids(prefix: str) -> list[int]:
    """Flapper processes of this testbed (they run in the root namespace)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"linkpass.testbed.flapper" in argv and b"--prefix" in argv:
            i = argv.index(b"--prefix")
            if i + 1 < len(argv) and argv[i + 1] == prefix.encode():
                found.append(int(entry))
    return found


def _teardown(prefix: str) -> dict:
    """Remove every process, link and namespace that carries `prefix`. Returns counts."""
    namespaces = namespaces_with_prefix(prefix)
    inodes = {i for i in (ns_io.netns_inode(n) for n in namespaces) if i is not None}
    pids = _flapper_pids(prefix) + ns_io.pids_in_netns(inodes)
    _kill(pids)
    links = root_links_with_prefix(prefix)
    with IPRoute() as root:
        # veth peers vanish with their namespace; delete root ends first so nothing dangles
        for name in sorted(links, key=lambda n: n.endswith("-mgmt")):
            idx = root.link_lookup(ifname=name)
            if idx:
                try:
                    root.link("del", index=idx[0])
                except Exception as exc:  # already gone with its peer
                    if getattr(exc, "code", None) != errno.ENODEV:
                        raise
    for name in namespaces:
        ns_io.remove_netns(name)
    guests.remove_dirs(prefix)
    shutil.rmtree(state.agents_dir(prefix), ignore_errors=True)  # `up --agents`: stopped with their namespaces
    return {"processes": len(pids), "links": len(links), "namespaces": len(namespaces)}


def down(prefix: str, progress: Progress = _quiet) -> dict:
    with state.locked(prefix):
        counts = _teardown(prefix)
        state.remove(prefix)
    progress(f"removed {counts['namespaces']} namespaces, {counts['links']} root links, "
             f"{counts['processes']} processes")
    return counts


_TESTBED_NETNS = re.compile(r"^([a-z][a-z0-9]{0,5})-(h\d+|p\d+[ls]\d+)$")


def clean(prefix: str | None = None) -> dict[str, dict]:
    """Reap leftovers: one prefix, or (prefix=None) every testbed found, by state file or by
    namespace names of the testbed's shape (a crash can precede the state file)."""
    prefixes = [prefix] if prefix else find_prefixes()
    return {p: down(p) for p in prefixes}


def find_prefixes() -> list[str]:
    """Prefixes of every testbed on this machine, running or crashed."""
    prefixes = set(state.all_prefixes())
    for name in pr_netns.listnetns():
        m = _TESTBED_NETNS.match(name)
        if m:
            prefixes.add(m.group(1))
    return sorted(prefixes)


def load_fabric(prefix: str) -> Fabric:
    """The Fabric of a running testbed, from its state file."""
    doc = state.load(prefix)
    if not doc:
        raise TestbedError(f"no testbed with prefix {prefix!r} is up; start one with `linkpass testbed up --prefix {prefix}`")
    try:
        spec = Spec(**dict(doc["spec"], rdma_hosts=tuple(doc["spec"].get("rdma_hosts", ()))))
    except TypeError as exc:
        raise TestbedError(f"state file {state.state_path(prefix)} is unreadable ({exc}); "
                           f"run `linkpass testbed clean --prefix {prefix}`") from None
    return make_fabric(spec, prefix, doc["mgmt_subnet"])


__all__ = ["up", "down", "clean", "load_fabric", "ensure_routes", "ensure_neighbors", "TestbedError", "TopologyError"]

"""`linkpass probe SRC DST` and `linkpass trace SRC DST --sport N` on the testbed: the path
checks of linkpass/probe/pathcheck.py between two of its hosts, run inside SRC's namespace, with
every router and link named from the testbed's fabric.

SRC and DST are host names (h0, h3, ...) of a running testbed (`--testbed PREFIX`; default: the
only one running). No agent is needed: the CLI sweeps from SRC's namespace itself. An agent on
DST listens on 4791 and answers no stray datagram, so sweeps to 4791 of a host running an agent
end `lost` after DST's leaf (the output then says so); `linkpass probe DST` run on SRC (inside
its namespace on the testbed) asks SRC's agent instead, which joins in its own probes' answers.
"""
from __future__ import annotations

import os

from ..core import names
from ..core.names import host_name
from ..probe import pathcheck as PC
from .topology import nic_ifname


class UsageError(Exception):
    """The command cannot run as asked (no testbed, unknown host, ...): exit 3."""


def pick_prefix(prefix: str | None, running: list[str]) -> str:
    """The testbed to use: the one named, else the only one running."""
    if prefix:
        if prefix not in running:
            have = f"running: {', '.join(running)}" if running else "none is running"
            raise UsageError(f"no testbed with prefix {prefix!r} is up ({have}); "
                             f"start one with `linkpass testbed up --prefix {prefix}`")
        return prefix
    if not running:
        raise UsageError("no testbed is running; start one with `linkpass testbed up`")
    if len(running) > 1:
        raise UsageError(f"{len(running)} testbeds are running ({', '.join(running)}); choose one with --testbed PREFIX")
    return running[0]


def load_testbed(prefix: str | None):
    from . import build, state
    from ..kernel import netns as ns_io

    chosen = pick_prefix(prefix, state.all_prefixes())
    try:
        fab = build.load_fabric(chosen)
    except (build.TestbedError, build.TopologyError) as exc:
        raise UsageError(str(exc)) from None
    if not os.path.exists(ns_io.netns_path(fab.netns(host_name(0)))):
        raise UsageError(f"testbed {chosen!r} has a state file but no namespaces (a crashed run?); "
                         f"`linkpass testbed clean --prefix {chosen}` removes it")
    return fab


def host_index(fab, name: str) -> int:
    hosts = fab.spec.hosts
    try:
        i = names.host_index(name)
    except ValueError:
        i = -1
    if not 0 <= i < hosts:
        raise UsageError(f"unknown host {name!r}: testbed {fab.prefix} has hosts "
                         f"{host_name(0)}..{host_name(hosts - 1)}")
    return i


class FabricNamer(PC.Namer):
    """Routers and links by name: a router's ICMP names the interface the probe came in on
    (icmp_errors_use_inbound_ifaddr=1), so a hop names the link that brought the probe there."""

    def __init__(self, fab, dst: int):
        self.fab, self.dst = fab, dst
        self.index = {}
        for lk in fab.links.values():
            self.index[lk.a_addr.split("/")[0]] = (lk.a, lk.name)
            self.index[lk.b_addr.split("/")[0]] = (lk.b, lk.name)

    def hop(self, addr: str) -> tuple[str | None, str | None]:
        return self.index.get(addr, (None, None))

    def dst_link(self, plane: int) -> str | None:
        return self.fab.uplink(host_name(self.dst), plane).name

    def dst_leaf(self, plane: int) -> str | None:
        return self.fab.leaf_of(self.dst, plane)


def legs(fab, src: int, dst: int, planes: list[int]) -> list[PC.Leg]:
    return [PC.Leg(p, nic_ifname(p), fab.nic_addr(src, p), fab.nic_addr(dst, p)) for p in planes]


def setup(fab, src_name: str, dst_name: str, plane: int | None) -> tuple[int, int, list[PC.Leg]]:
    """(src, dst, legs) for a check between two of the testbed's hosts, or UsageError."""
    src, dst = host_index(fab, src_name), host_index(fab, dst_name)
    if src == dst:
        raise UsageError(f"SRC and DST are both {src_name}; pick two hosts")
    planes = list(range(fab.spec.planes))
    if plane is not None:
        if plane not in planes:
            raise UsageError(f"--plane {plane}: testbed {fab.prefix} has planes 0..{fab.spec.planes - 1}")
        planes = [plane]
    return src, dst, legs(fab, src, dst, planes)


def probe(fab, src: int, dst: int, legs_: list[PC.Leg], ports: tuple[int, ...], dport: int) -> dict | None:
    """The `probe` document, swept from SRC's namespace; None if no probe socket could be bound."""
    return PC.probe(fab.netns(host_name(src)), host_name(src), host_name(dst), {"testbed": fab.prefix}, legs_, ports,
                    dport, FabricNamer(fab, dst))


def trace(fab, src: int, dst: int, legs_: list[PC.Leg], sport: int, dport: int) -> dict:
    """The `trace` document of SRC's flow from `sport`, swept from SRC's namespace."""
    return PC.trace(fab.netns(host_name(src)), host_name(src), host_name(dst), {"testbed": fab.prefix}, legs_, sport,
                    dport, FabricNamer(fab, dst))

"""From path states to what the data path should use: planes for routes, ports for transports. Pure.

A peer is reached over several planes (one NIC each); within a plane, over several fabric paths
(ECMP through different spines), each probed with its own UDP source port. The kernel route to a
peer spreads flows over planes and the fabric hashes each flow onto one path of the plane, so a
plane is only safe for routed traffic when *every* path of it is usable: one dead spine link
black-holes the flows hashed onto it. Transports that pick their own source port (RDMA QPs, the
NCCL plugin) can do better and use exactly the healthy paths of every plane.

    planes:  all paths usable ("clean") > some usable ("partial", only if no plane is clean) >
             none: the caller keeps what is installed (fail static; never the last path)
    ports:   the ports of the usable paths of (peer, plane); none usable: every port, flagged
             fail-static, so a transport still has somewhere to go

A path gone silent is only held against its plane once the peer answers another path on time
for a probe sent after it was declared DOWN, and no sooner than a host stall's spread after its
silence began (`silence_confirmed`). When every path to a peer goes dark at once, the peer (its
host, its agent, its scheduler) is the likelier culprit than its links, and moving its traffic
from plane to plane would only churn routes: they stay as they are.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .detector import State
from .entropy_table import ENTRY_FAIL_STATIC, MAX_PORTS, PORT_VERIFIED, Entry


@dataclass(frozen=True)
class PathInfo:
    """What the agent knows about one probed path besides its state."""

    path_id: int
    peer: str  # peer name
    plane: int
    sport: int
    peer_addr: str  # the peer's NIC address in this plane (what an RDMA QP connects to)


@dataclass(frozen=True)
class PlaneChoice:
    planes: frozenset[int]
    quality: str  # "clean" | "partial" | "none"


def usable_planes(states_by_plane: Mapping[int, Iterable[State]]) -> PlaneChoice:
    """The planes a peer's route should use, given the states of each plane's paths to it."""
    states = {p: list(ss) for p, ss in states_by_plane.items()}
    clean = frozenset(p for p, ss in states.items() if ss and all(s.usable for s in ss))
    if clean:
        return PlaneChoice(clean, "clean")
    partial = frozenset(p for p, ss in states.items() if any(s.usable for s in ss))
    return PlaneChoice(partial, "partial" if partial else "none")


def silence_confirmed(down_at_ns: int, others_last_on_time_ns: Iterable[int], silent_from_ns: int | None = None,
                      stall_spread_ns: int = 0) -> bool:
    """Whether a path's DOWN is confirmed by the peer answering another path *on time* for a
    probe sent after the DOWN was declared, and at least `stall_spread_ns` after the path's first
    missed probe (`silent_from_ns`, if known) was sent (send times, our clock). A late answer does
    not confirm: when a host is kept waiting, every path's replies are late together, and the DOWN
    path's own late replies are then on their way too. Nor does an answer sent sooner after the
    silence began: a stall reaches a peer's paths up to a spread apart, and that path may just not
    have been reached yet."""
    since = down_at_ns if silent_from_ns is None else max(down_at_ns, silent_from_ns + stall_spread_ns)
    return any(t > since for t in others_last_on_time_ns)


def crosses(hops: Iterable[str | None], peer_addr: str, link_addrs: Iterable[str]) -> bool:
    """Whether a path crosses a link, given that link's interface addresses: a hop names the
    router interface a probe came in on, and the destination's own NIC ends its last link."""
    addrs = set(link_addrs)
    return peer_addr in addrs or any(h in addrs for h in hops if h is not None)


def entropy_entry(paths: Iterable[tuple[PathInfo, State]]) -> Entry:
    """The entropy-table entry of one (peer, plane): the source ports of its usable paths, in
    path order; if none is usable, all of them with ENTRY_FAIL_STATIC."""
    items = sorted(paths, key=lambda ps: ps[0].path_id)
    if not items:
        raise ValueError("entropy_entry: no paths given")
    first = items[0][0]
    good = [p for p, s in items if s.usable]
    flags, use = (0, good) if good else (ENTRY_FAIL_STATIC, [p for p, _ in items])
    seen: dict[int, int] = {}
    for p in use:
        seen.setdefault(p.sport, p.path_id)
    ports = tuple(seen)[:MAX_PORTS]
    return Entry(first.peer_addr, first.plane, ports, tuple(seen[q] for q in ports),
                 tuple((0 if flags else PORT_VERIFIED) for _ in ports), flags)

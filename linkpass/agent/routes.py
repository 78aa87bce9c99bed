"""Route actuator: the host routes to peers' service addresses that LinkPass owns.

One /32 route per peer, multipath over the planes that are usable towards it, marked with
LinkPass's own route protocol number (so nothing else's routes are ever touched), sourced from
this host's service address and carrying `rto_min` so TCP retransmits reach the new path fast.

- **Atomic.** Every change is one RTM_NEWROUTE with NLM_F_REPLACE: the kernel swaps the whole
  multipath set at once; there is never a moment without a route. The message is our own
  (`netlink.py`, tens of µs); pyroute2 reads routes and links, off the fast path.
- **Never the last path.** A decision that leaves a peer no usable plane is not applied: the
  route keeps its current planes (fail static) and the refusal is counted and returned.
- **Journal.** The desired state of each peer is appended to a journal *before* the kernel is
  changed. It has to outlive the agent, not the machine (routes do not survive a reboot either),
  so it lives on tmpfs (/run) and is written, not fsync'ed: a write that returned is in the page
  cache whatever happens to the process, and an fsync would cost milliseconds per failover.
  `reconcile()` on start makes the kernel match the journal: a change cut off by SIGKILL is
  completed, routes of ours for unknown peers are removed, missing ones added. Lines that are
  not a record (cut off by a crash, or of the wrong shape) are skipped and logged.
- **Clean stop.** `leave()`: every route stays as the last decision left it, so a plane known
  bad stays out across a restart (the journal already says what is installed, and the next
  start's reconcile keeps it); every peer has at least one plane, as at any other moment.
- **Rate limit.** A token bucket bounds changes per second; a change over the limit is deferred
  (returned as such), not dropped, so the caller retries on its next tick.
- **Dry run.** Decisions are computed, journaled to memory and returned, and nothing is touched.

The pure part (`desired_route`, `RouteChoice`) decides; `RouteActuator` talks netlink.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.constants import RTPROT_LINKPASS
from ..core.decisions import RouteResult
from ..kernel.rtnl import IPRoute
from .netlink import RouteSocket


DEFAULT_RTO_MIN_MS = 10


@dataclass(frozen=True)
class PeerRoutes:
    """How to reach one peer's service address over each plane from this host."""

    peer: str
    service: str  # the peer's service address (/32)
    hops: dict[int, tuple[str, str]]  # plane -> (gateway, device)


@dataclass(frozen=True)
class RouteChoice:
    peer: str
    planes: tuple[int, ...]  # planes the route will use
    refused: tuple[int, ...] = ()  # planes the caller wanted gone but that stay (last usable path)
    reason: str = ""


def desired_route(peer: PeerRoutes, usable: set[int], current: tuple[int, ...]) -> RouteChoice:
    """Which planes a peer's route should use. Pure.

    Usable planes only; but if none is usable, keep what is installed (fail static): removing
    the last path would turn a degraded peer into an unreachable one.
    """
    want = tuple(sorted(p for p in usable if p in peer.hops))
    if want:
        return RouteChoice(peer.peer, want)
    keep = current or tuple(sorted(peer.hops))
    return RouteChoice(peer.peer, keep, refused=keep, reason="no usable plane: keeping the current route (fail static)")


MAX_PLANE = 63  # as in the agent's config


def journal_record(line: str) -> tuple[str, tuple[int, ...]] | str:
    """One journal line as (peer, planes), or why it is not a record. Pure."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return "not JSON (cut off by a crash?)"
    if not isinstance(rec, dict):
        return f"expected an object, got {type(rec).__name__}"
    peer, planes = rec.get("peer"), rec.get("planes")
    if not isinstance(peer, str) or not peer:
        return f"peer: expected a name, got {peer!r:.40}"
    if not isinstance(planes, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= MAX_PLANE for p in planes):
        return f"planes: expected a list of planes 0..{MAX_PLANE}, got {planes!r:.40}"
    return peer, tuple(planes)


@dataclass
class TokenBucket:
    rate_per_s: float
    burst: int
    tokens: float = 0.0
    last: float | None = None

    def take(self, mono_s: float) -> bool:
        if self.last is None:
            self.tokens, self.last = float(self.burst), mono_s
        self.tokens = min(self.burst, self.tokens + (mono_s - self.last) * self.rate_per_s)
        self.last = mono_s
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass
class RouteActuator:
    netns: str | None
    own_service: str
    peers: dict[str, PeerRoutes]
    journal_path: str
    rto_min_ms: int = DEFAULT_RTO_MIN_MS
    max_changes_per_s: float = 1000.0
    burst: int = 200
    dry_run: bool = False
    log: Callable[..., None] | None = None  # the daemon's JSON-line log (skipped journal lines)
    installed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {"changes": 0, "refused_last_path": 0, "deferred": 0,
                                                            "reconciled": 0})

    def __post_init__(self) -> None:
        if not 0 < self.rto_min_ms <= 1000:
            raise ValueError(f"rto_min_ms: {self.rto_min_ms} is out of range; allowed 1..1000 (ms)")
        self._bucket = TokenBucket(self.max_changes_per_s, self.burst)
        self._ipr: IPRoute | None = None
        self._index: dict[str, int] = {}
        self._journal_file = None
        self._rtsock: RouteSocket | None = None  # the fast path: our own netlink message

    # ---- netlink ---------------------------------------------------------------------------
    def _open(self) -> IPRoute:
        if self._ipr is None:
            # IPRoute(netns=) rather than creating it in a namespace thread: pyroute2 keeps its
            # socket per thread, so one made elsewhere would silently talk to the root namespace
            self._ipr = IPRoute(netns=self.netns) if self.netns else IPRoute()
            self._index = {link.get_attr("IFLA_IFNAME"): link["index"] for link in self._ipr.get_links()}
        return self._ipr

    def _close_journal(self) -> None:
        if self._journal_file is not None:
            self._journal_file.close()
            self._journal_file = None

    def close(self) -> None:
        self._close_journal()
        if self._rtsock is not None:
            self._rtsock.close()
            self._rtsock = None
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    def _kernel_replace(self, peer: PeerRoutes, planes: tuple[int, ...]) -> None:
        self._open()
        if self._rtsock is None:
            self._rtsock = RouteSocket(self.netns)
        hops = [(peer.hops[p][0], self._index[peer.hops[p][1]]) for p in planes]
        self._rtsock.replace(peer.service, self.own_service, hops, RTPROT_LINKPASS, self.rto_min_ms)

    def kernel_routes(self) -> dict[str, tuple[int, ...]]:
        """Our routes as the kernel has them: service address -> planes (by device)."""
        ipr = self._open()
        plane_of_dev = {}
        for peer in self.peers.values():
            for plane, (_, dev) in peer.hops.items():
                plane_of_dev[self._index.get(dev)] = plane
        out = {}
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            if r["proto"] != RTPROT_LINKPASS or r["dst_len"] != 32:
                continue
            mp = r.get_attr("RTA_MULTIPATH")
            oifs = [h["oif"] for h in mp] if mp else [r.get_attr("RTA_OIF")]
            out[r.get_attr("RTA_DST")] = tuple(sorted(plane_of_dev.get(o, -1) for o in oifs))
        return out

    def _kernel_delete(self, service: str) -> None:
        try:
            self._open().route("del", dst=service, dst_len=32, proto=RTPROT_LINKPASS)
        except Exception as exc:  # ESRCH: already gone
            if getattr(exc, "code", None) != 3:
                raise

    # ---- journal -----------------------------------------------------------------------------
    def _journal(self, peer: str, planes: tuple[int, ...]) -> None:
        if self.dry_run:
            return
        if self._journal_file is None:
            os.makedirs(os.path.dirname(self.journal_path) or ".", exist_ok=True)
            self._journal_file = open(self.journal_path, "a")
        self._journal_file.write(json.dumps({"peer": peer, "planes": list(planes), "at": time.time()}) + "\n")
        self._journal_file.flush()  # in the kernel's page cache from here on: a SIGKILL cannot lose it

    def _journal_state(self) -> dict[str, tuple[int, ...]]:
        """Each peer's last record. A line that is not one is skipped: cut off by a crash, the
        change after it never happened; of the wrong shape, it is not ours to guess at."""
        state: dict[str, tuple[int, ...]] = {}
        skipped: list[str] = []
        try:
            with open(self.journal_path, errors="replace") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    rec = journal_record(line)
                    if isinstance(rec, str):
                        skipped.append(f"line {n}: {rec}")
                        continue
                    state[rec[0]] = rec[1]
        except FileNotFoundError:
            pass
        if skipped:
            self.stats["journal_skipped"] = self.stats.get("journal_skipped", 0) + len(skipped)
            if self.log is not None:
                self.log("route_journal_lines_skipped", journal=self.journal_path, count=len(skipped),
                         first=skipped[:5], note="those peers' routes follow their other lines, or the baseline")
        return state

    # ---- the verbs ---------------------------------------------------------------------------
    def reconcile(self) -> dict[str, tuple[int, ...]]:
        """Make the kernel match the journal (or the baseline: all planes) for every known peer,
        and remove routes of ours to unknown destinations. Returns what is installed."""
        journal = self._journal_state()
        kernel = self.kernel_routes() if not self.dry_run else {}
        known = {p.service for p in self.peers.values()}
        for service in kernel:
            if service not in known and not self.dry_run:
                self._kernel_delete(service)
                self.stats["reconciled"] += 1
        for name, peer in self.peers.items():
            want = tuple(p for p in journal.get(name, tuple(sorted(peer.hops))) if p in peer.hops) or \
                tuple(sorted(peer.hops))
            if kernel.get(peer.service) != want and not self.dry_run:
                self._kernel_replace(peer, want)
                self.stats["reconciled"] += 1
            self.installed[name] = want
        # compact the journal to the reconciled state
        if not self.dry_run:
            self._close_journal()
            os.makedirs(os.path.dirname(self.journal_path) or ".", exist_ok=True)
            tmp = self.journal_path + ".tmp"
            with open(tmp, "w") as f:
                for name, planes in self.installed.items():
                    f.write(json.dumps({"peer": name, "planes": list(planes), "at": time.time()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.journal_path)
        return dict(self.installed)

    def set_usable(self, peer: str, usable: set[int], mono_s: float | None = None) -> RouteResult:
        """Point `peer`'s route at its usable planes. Returns what happened, as data."""
        pr = self.peers[peer]
        current = self.installed.get(peer, tuple(sorted(pr.hops)))
        plan = desired_route(pr, usable, current)
        result = RouteResult(peer, plan.planes, refused=plan.refused, reason=plan.reason, dry_run=self.dry_run)
        if plan.refused:
            self.stats["refused_last_path"] += 1
        if plan.planes == current:
            return result
        if not self._bucket.take(time.monotonic() if mono_s is None else mono_s):
            self.stats["deferred"] += 1
            return replace(result, deferred=True)
        self._journal(peer, plan.planes)
        if not self.dry_run:
            self._kernel_replace(pr, plan.planes)
        self.installed[peer] = plan.planes
        self.stats["changes"] += 1
        # stamped when the route was replaced: the route_change log's time
        return replace(result, changed=True, mono_ns=time.monotonic_ns())

    def leave(self) -> dict[str, tuple[int, ...]]:
        """A clean stop: every route stays as it is, planes known bad left out. Nothing to write:
        the journal was written before each change, so it already says what is installed, and
        the next start's reconcile keeps it. Returns what stays."""
        self._close_journal()
        return dict(self.installed)

    def remove_all(self) -> None:
        """Withdraw every route of ours (uninstall); the testbed's baseline ECMP route remains."""
        if not self.dry_run:
            for service in self.kernel_routes():
                self._kernel_delete(service)
        self.installed.clear()
        self._close_journal()
        if os.path.exists(self.journal_path) and not self.dry_run:
            os.unlink(self.journal_path)

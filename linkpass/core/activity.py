"""Which paths carry traffic, and so how often each is probed: paths of an active peer at the
active rate (millisecond detection), the others at the idle rate (their state known within
about a second, at a tenth of a percent of the cost).

Pure: the caller samples what the host can see (`linkpass/kernel/sockdiag.py`: TCP sockets that
moved data, to any address of the peer) and passes the peers seen moving, with the time.

Per peer, not per path: a peer is active from the first sample that sees data move to or from
it until `idle_after_ns` pass without any. Every path to an active peer is active, the standby
planes and ECMP paths included, because failover may move the traffic onto any of them at once
and must find them known-good to the millisecond. A peer's paths are promoted at the first
sample that sees it move data (the caller samples once per idle interval). New paths are added
at the active rate; the next sample sets their rate.

What the detector makes of a slower rate: its thresholds count probes, its timeouts follow each
probe's round trip, so a slow path is judged by the same rules, only later (three misses at 10 Hz
are ~300 ms); its recovery takes `recovery_good_probes` probes (100 at 10 Hz: 10 s), which is
why a path that goes active is promoted before traffic is moved onto it, not after.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ACTIVE, IDLE = "active", "idle"
RATES = (ACTIVE, IDLE)


@dataclass(frozen=True)
class RateChange:
    path: int
    peer: str
    rate: str  # ACTIVE or IDLE


class Activity:
    """When each peer last moved data, and the rate each probed path has been given."""

    def __init__(self, idle_after_ns: int):
        if idle_after_ns <= 0:
            raise ValueError(f"idle_after_ns must be > 0, got {idle_after_ns}")
        self.idle_after_ns = idle_after_ns
        self.last_moved: dict[str, int] = {}  # peer -> time its traffic was last seen
        self.rate: dict[int, str] = {}  # path -> the rate it is probed at now

    def saw(self, peers: Iterable[str], now_ns: int) -> None:
        """These peers moved data in the sample taken at `now_ns`."""
        for peer in peers:
            self.last_moved[peer] = now_ns

    def active(self, peer: str, now_ns: int) -> bool:
        last = self.last_moved.get(peer)
        return last is not None and now_ns - last <= self.idle_after_ns

    def update(self, paths: Mapping[int, str], now_ns: int) -> list[RateChange]:
        """The rate of every path in `paths` (path -> peer) now; returns the paths whose rate
        changed. Paths not seen before count as active (new paths start at the full rate);
        paths gone from `paths` are forgotten, and so are peers without paths."""
        changes = []
        for pid, peer in paths.items():
            want = ACTIVE if self.active(peer, now_ns) else IDLE
            if self.rate.get(pid, ACTIVE) != want:
                changes.append(RateChange(pid, peer, want))
            self.rate[pid] = want
        for pid in [p for p in self.rate if p not in paths]:
            del self.rate[pid]
        peers = set(paths.values())
        for peer in [p for p in self.last_moved if p not in peers]:
            del self.last_moved[peer]
        return changes

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(RATES, 0)
        for rate in self.rate.values():
            out[rate] += 1
        return out

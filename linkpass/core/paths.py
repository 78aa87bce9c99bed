"""ECMP path table: which UDP source ports take which path to a peer, from Paris-style traces.

Pure: no sockets, no clock reads, no randomness. `linkpass/probe/discovery.py` sends the
TTL-limited probes and hands the answers in; everything that turns answers into traces, traces
into a table, and two tables into a diff lives here and is unit-tested without root.

A *trace* is one flow (fixed 5-tuple: local NIC address, source port, peer address, port 4791)
probed with TTL 1, 2, 3, ...; each TTL is answered by a router (ICMP time exceeded, naming the
router interface the probe came in on, so a hop names a link), by the peer itself (it was
reached), by a router that has no route (ICMP unreachable), or by nobody (lost).

A *path* is what a trace saw: the hop sequence and how it ended. Its id is a short hash of
both, so the same path has the same id on every host, in every run, in every table.

    Path.hops   answering address per TTL, peer excluded; None = no answer at that TTL
    Path.end    "reached" | "unreachable" (last hop said no route) | "lost" (answers stopped)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping

# answer kinds (what came back for one TTL)
TIME_EXCEEDED = "time-exceeded"
REACHED = "reached"
UNREACHABLE = "unreachable"
ANSWER_KINDS = (TIME_EXCEEDED, REACHED, UNREACHABLE)

# how a trace ended
END_REACHED = "reached"
END_UNREACHABLE = "unreachable"
END_LOST = "lost"
_END_ORDER = {END_REACHED: 0, END_UNREACHABLE: 1, END_LOST: 2}

DEFAULT_K = 4


class PathError(ValueError):
    """Inputs to the path table are inconsistent (a caller's mistake, not the network's)."""


@dataclass(frozen=True)
class Answer:
    """What came back for the probe with this TTL."""

    ttl: int
    kind: str  # TIME_EXCEEDED | REACHED | UNREACHABLE
    addr: str  # the router interface the probe came in on, or the peer

    def __post_init__(self) -> None:
        if self.kind not in ANSWER_KINDS:
            raise PathError(f"answer kind {self.kind!r} is unknown; one of {', '.join(ANSWER_KINDS)}")
        if self.ttl < 1:
            raise PathError(f"answer ttl must be >= 1, got {self.ttl}")


@dataclass(frozen=True)
class Trace:
    """One flow's result: the hops per TTL and how the trace ended."""

    local: str  # local NIC (device name, one per plane)
    src: str  # local NIC address
    peer: str  # peer address on that plane
    sport: int
    hops: tuple[str | None, ...]  # TTL 1.. (peer excluded; "unreachable" ends with the refusing router)
    end: str  # END_REACHED | END_UNREACHABLE | END_LOST
    end_ttl: int | None = None  # TTL of the answer that ended it (reached / unreachable)
    probes: int = 0  # probes sent for this trace, retries included
    lost: int = 0  # TTLs that got no answer after every retry

    @property
    def reached(self) -> bool:
        return self.end == END_REACHED

    @property
    def key(self) -> tuple[tuple[str | None, ...], str]:
        return self.hops, self.end


def make_trace(local: str, src: str, peer: str, sport: int, answers: Iterable[Answer], *,
               probes: int = 0, lost: int = 0) -> Trace:
    """Assemble a trace from the answers of its probes (any order, at most one per TTL used).

    The lowest TTL answered by the peer (or by an unreachable) ends the trace; answers for higher
    TTLs are ignored. Without such an answer the trace is `lost` after its last answering hop.
    """
    by_ttl: dict[int, Answer] = {}
    for a in answers:
        prev = by_ttl.get(a.ttl)
        # a terminal answer wins over a time-exceeded one for the same TTL (cannot both be true
        # for one probe; if retries disagree, the route changed and the end is what matters)
        if prev is None or (prev.kind == TIME_EXCEEDED and a.kind != TIME_EXCEEDED):
            by_ttl[a.ttl] = a
    terminal = sorted(t for t, a in by_ttl.items() if a.kind != TIME_EXCEEDED)
    if terminal:
        end_ttl = terminal[0]
        last = by_ttl[end_ttl]
        hops: list[str | None] = [by_ttl[t].addr if t in by_ttl else None for t in range(1, end_ttl)]
        if last.kind == REACHED:
            return Trace(local, src, peer, sport, tuple(hops), END_REACHED, end_ttl, probes, lost)
        hops.append(last.addr)
        return Trace(local, src, peer, sport, tuple(hops), END_UNREACHABLE, end_ttl, probes, lost)
    top = max(by_ttl, default=0)
    hops = [by_ttl[t].addr if t in by_ttl else None for t in range(1, top + 1)]
    return Trace(local, src, peer, sport, tuple(hops), END_LOST, None, probes, lost)


def path_id(hops: Iterable[str | None], end: str) -> str:
    """Stable short id of a path: 8 hex digits of a hash of its hops and its end."""
    if end not in _END_ORDER:
        raise PathError(f"path end {end!r} is unknown; one of {', '.join(_END_ORDER)}")
    text = end + ":" + ",".join("*" if h is None else h for h in hops)
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def _path_order(hops: tuple[str | None, ...], end: str) -> tuple:
    return (_END_ORDER[end], len(hops), tuple("" if h is None else h for h in hops))


@dataclass(frozen=True)
class Path:
    id: str
    hops: tuple[str | None, ...]
    end: str
    ports: tuple[int, ...]  # up to K source ports that take it, lowest first
    seen: int  # how many swept ports took it

    @property
    def reached(self) -> bool:
        return self.end == END_REACHED

    def describe(self) -> str:
        hops = " > ".join("*" if h is None else h for h in self.hops) or "(no answer)"
        return f"{self.id} [{self.end}] {hops}  ports {list(self.ports)} ({self.seen} seen)"

    def to_dict(self) -> dict:
        return {"id": self.id, "hops": list(self.hops), "end": self.end, "ports": list(self.ports),
                "seen": self.seen}


@dataclass(frozen=True)
class PeerPaths:
    """The distinct paths from one local NIC to one peer, and which swept port took which."""

    peer: str
    local: str
    src: str
    paths: Mapping[str, Path]  # id -> path, ordered: reached first, then by hops
    ports: Mapping[int, str] = field(default_factory=dict)  # every swept port -> path id

    def reached(self) -> list[Path]:
        return [p for p in self.paths.values() if p.reached]

    def path_of(self, sport: int) -> Path | None:
        pid = self.ports.get(sport)
        return self.paths.get(pid) if pid is not None else None

    def to_dict(self, all_ports: bool = False) -> dict:
        out = {"peer": self.peer, "local": self.local, "src": self.src, "swept": len(self.ports),
               "paths": [p.to_dict() for p in self.paths.values()]}
        if all_ports:
            out["ports"] = {str(s): pid for s, pid in sorted(self.ports.items())}
        return out


@dataclass(frozen=True)
class PathTable:
    """(peer address, local NIC) -> PeerPaths, for one host; `stats` are the sweep's counters."""

    entries: Mapping[tuple[str, str], PeerPaths]
    k: int = DEFAULT_K
    host: str | None = None
    stats: Mapping[str, object] = field(default_factory=dict)

    def get(self, peer: str, local: str) -> PeerPaths | None:
        return self.entries.get((peer, local))

    def paths(self, peer: str, local: str) -> list[Path]:
        entry = self.entries.get((peer, local))
        return list(entry.paths.values()) if entry else []

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self, all_ports: bool = False) -> dict:
        return {"host": self.host, "k": self.k, "stats": dict(self.stats),
                "entries": [e.to_dict(all_ports) for _, e in sorted(self.entries.items())]}


def build_table(traces: Iterable[Trace], k: int = DEFAULT_K, *, host: str | None = None,
                stats: Mapping[str, object] | None = None) -> PathTable:
    """Group traces by (peer, local NIC), then by path; keep up to `k` ports per path."""
    if k < 1:
        raise PathError(f"k (ports kept per path) must be >= 1, got {k}")
    groups: dict[tuple[str, str], list[Trace]] = {}
    srcs: dict[tuple[str, str], str] = {}
    for t in traces:
        key = (t.peer, t.local)
        if srcs.setdefault(key, t.src) != t.src:
            raise PathError(f"traces to {t.peer} over {t.local} come from two addresses: {srcs[key]} and {t.src}")
        groups.setdefault(key, []).append(t)
    entries: dict[tuple[str, str], PeerPaths] = {}
    for key in sorted(groups):
        by_path: dict[tuple, list[int]] = {}
        port_key: dict[int, tuple] = {}
        for t in groups[key]:
            if t.sport in port_key:
                raise PathError(f"source port {t.sport} traced twice to {t.peer} over {t.local}")
            port_key[t.sport] = t.key
            by_path.setdefault(t.key, []).append(t.sport)
        paths: dict[str, Path] = {}
        ids: dict[tuple, str] = {}
        for hops, end in sorted(by_path, key=lambda pk: _path_order(*pk)):
            ports = sorted(by_path[(hops, end)])
            pid = path_id(hops, end)
            ids[(hops, end)] = pid
            paths[pid] = Path(pid, hops, end, tuple(ports[:k]), len(ports))
        entries[key] = PeerPaths(key[0], key[1], srcs[key], paths,
                                 {s: ids[pk] for s, pk in sorted(port_key.items())})
    return PathTable(entries, k, host, dict(stats or {}))


# ---- diff ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PortMove:
    sport: int
    old: str  # path id before
    new: str  # path id after


@dataclass(frozen=True)
class EntryDiff:
    """What changed between two sweeps from one local NIC to one peer."""

    peer: str
    local: str
    added: tuple[Path, ...]  # paths only in the new table
    removed: tuple[Path, ...]  # paths only in the old table
    moved: tuple[PortMove, ...]  # ports swept in both whose path changed

    def to_dict(self) -> dict:
        return {"peer": self.peer, "local": self.local,
                "added": [p.to_dict() for p in self.added], "removed": [p.to_dict() for p in self.removed],
                "moved": [{"sport": m.sport, "old": m.old, "new": m.new} for m in self.moved]}


@dataclass(frozen=True)
class TableDiff:
    entries: tuple[EntryDiff, ...]  # only (peer, local) pairs that changed
    new_pairs: tuple[tuple[str, str], ...]  # (peer, local) only in the new table
    gone_pairs: tuple[tuple[str, str], ...]  # (peer, local) only in the old table

    @property
    def changed(self) -> bool:
        return bool(self.entries or self.new_pairs or self.gone_pairs)

    def get(self, peer: str, local: str) -> EntryDiff | None:
        for e in self.entries:
            if (e.peer, e.local) == (peer, local):
                return e
        return None

    def to_dict(self) -> dict:
        return {"changed": self.changed, "entries": [e.to_dict() for e in self.entries],
                "new_pairs": [list(p) for p in self.new_pairs], "gone_pairs": [list(p) for p in self.gone_pairs]}


def diff_tables(old: PathTable, new: PathTable) -> TableDiff:
    """New/removed paths and moved ports per (peer, local NIC), for a refresh after a change."""
    changes = []
    for key in sorted(set(old.entries) & set(new.entries)):
        a, b = old.entries[key], new.entries[key]
        added = tuple(p for pid, p in b.paths.items() if pid not in a.paths)
        removed = tuple(p for pid, p in a.paths.items() if pid not in b.paths)
        moved = tuple(PortMove(s, a.ports[s], b.ports[s]) for s in sorted(set(a.ports) & set(b.ports))
                      if a.ports[s] != b.ports[s])
        if added or removed or moved:
            changes.append(EntryDiff(key[0], key[1], added, removed, moved))
    return TableDiff(tuple(changes), tuple(sorted(set(new.entries) - set(old.entries))),
                     tuple(sorted(set(old.entries) - set(new.entries))))

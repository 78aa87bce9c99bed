"""What the failover decides, as data: the agent carries it out, the simulator reads it. Pure.

`Failover.step` (and `decide`, `set_drained`, `remove_peer`) return `Decisions`; nothing in
core touches a route, a table or a log. The agent hands the decisions to its data path
(agent/data_path.py) and feeds what the route actuator did back (`Failover.routes_done`): a
route change a rate limit deferred keeps its peer pending, so the next step decides it again.

    Decisions.routes    a RouteWant per re-decided peer: the planes its route should use
    Decisions.entropy   entropy-table entries that changed (ports per peer and plane)
    Decisions.removed   (peer, plane) entries to drop: the peer left the config
    Decisions.rto       (path, timeout) pairs for the probe core, which judges deadlines
    Decisions.logs      log records of the decisions, in the order they were made
    Decisions.path_logs log records of path state changes: written after the route change,
                        which should not wait for them (each costs tens of µs)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .detector import Transition
from .entropy_table import Entry


@dataclass(frozen=True)
class LogRecord:
    """One log line to be: its event name and fields (observe/log.py writes it)."""

    event: str
    fields: Mapping[str, Any]

    @classmethod
    def of(cls, event: str, **fields) -> "LogRecord":
        return cls(event, MappingProxyType(fields))


@dataclass(frozen=True)
class RouteWant:
    """The planes a peer's route should use, and how good they are (decide.usable_planes)."""

    peer: str
    planes: tuple[int, ...]
    quality: str


@dataclass(frozen=True)
class RouteResult:
    """What the route actuator did with a RouteWant (agent/routes.py `set_usable`)."""

    peer: str
    planes: tuple[int, ...]  # the planes the route uses now
    changed: bool = False
    deferred: bool = False  # a rate limit held the change back: decide again on the next step
    refused: tuple[int, ...] = ()  # planes asked away that stay (the last usable path)
    reason: str = ""
    mono_ns: int | None = None  # when the route was replaced (the route_change log's time)
    dry_run: bool = False

    @classmethod
    def not_routed(cls, want: RouteWant) -> "RouteResult":
        """No route to rewrite for this peer (routes off, or a peer without a service route):
        the decision stands as the planes the data path would use."""
        return cls(want.peer, tuple(sorted(want.planes)))


@dataclass
class Decisions:
    transitions: list[Transition] = field(default_factory=list)
    routes: list[RouteWant] = field(default_factory=list)
    entropy: list[Entry] = field(default_factory=list)
    removed: list[tuple[str, int]] = field(default_factory=list)
    rto: list[tuple[int, int]] = field(default_factory=list)
    logs: list[LogRecord] = field(default_factory=list)
    path_logs: list[LogRecord] = field(default_factory=list)

    def log(self, event: str, **fields) -> None:
        self.logs.append(LogRecord.of(event, **fields))


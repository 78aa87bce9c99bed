"""Carries out the failover's decisions on this host: routes, the entropy table, the probe core's
deadlines, the log.

`Failover` (core/failover.py) decides and returns `Decisions`; this is the one place they touch
the kernel and the shared table. Order matters for the reroute time: the route changes first,
then the table, then the deadlines, and the log lines last (each costs tens of µs, the route
change should not wait for them). While a failure is in flight (`Failover.in_flight`: its
confirming answers are due within a few ms) the log lines wait, up to `LOG_HOLD_MAX` of them,
and are written once it is decided: the step that acts on those answers must not queue behind
the DOWN's own log lines. What the route actuator did goes back to `Failover.routes_done` as
input: a change its rate limit deferred is decided again on the next step.
"""
from __future__ import annotations

from collections.abc import Callable

from ..core.decisions import Decisions, LogRecord, RouteResult, RouteWant
from ..core.failover import Failover

LOG_HOLD_MAX = 256  # log records held while a failure is in flight; more are written at once


class DataPath:
    """The actuators a host has; any may be None (routes off, no entropy table, no deadlines)."""

    def __init__(self, routes=None, entropy=None, set_rto: Callable[[int, int], None] | None = None,
                 log: Callable[..., None] | None = None):
        self.routes = routes  # RouteActuator
        self.entropy = entropy  # EntropyWriter
        self.set_rto = set_rto
        self.write_log = log  # writes records whose event names were checked where they were made
        self.held: list[LogRecord] = []  # records waiting for the decision in flight

    def carry_out(self, failover: Failover, decided: Decisions, mono_ns: int) -> None:
        """Apply `decided`, and tell `failover` what the routes did."""
        results = [self._route(want) for want in decided.routes]
        route_logs = failover.routes_done(results, mono_ns)
        if self.entropy is not None:
            for e in decided.entropy:
                self.entropy.update(e.peer, e.plane, e.ports, e.path_ids, e.port_flags, e.flags)
            for peer, plane in decided.removed:
                self.entropy.remove(peer, plane)
        if self.set_rto is not None:
            for pid, rto_ns in decided.rto:
                self.set_rto(pid, rto_ns)
        if self.write_log is None:
            return
        self.held += (*decided.logs, *route_logs, *decided.path_logs)
        if self.held and (len(self.held) >= LOG_HOLD_MAX or not failover.in_flight()):
            self.flush_logs()

    def flush_logs(self) -> None:
        """Write the held log records, in order (on a stop too)."""
        held, self.held = self.held, []
        for rec in held:
            self.write_log(rec.event, **rec.fields)

    def _route(self, want: RouteWant) -> RouteResult:
        if self.routes is None or want.peer not in self.routes.peers:
            return RouteResult.not_routed(want)
        return self.routes.set_usable(want.peer, set(want.planes))

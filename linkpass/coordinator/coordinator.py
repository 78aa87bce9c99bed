"""The coordinator as a plain class: what the fleet's agents report, what it means, what to do.

    agents ── register / report (path verdicts: changes at once, summaries periodically) ──►
    Coordinator ── path table ─► Localizer (which link, which direction) ─► findings, events
                ── drains (operator) ─► every agent: the router addresses to steer away from
                ── probe plan (which peers each agent probes) ─► agents, revised on join/leave

No Ray, no sockets and no clock here (`ray_actor.py` hosts it, `http.py` serves it): the time
comes in as arguments, and the host hands in the clock that measures how long localization and
planning take (`cost_clock`), so tests drive it directly. Calls are serialised by the host (one lock): the class
itself is not thread-safe. Everything that must survive a restart goes through `Store`.

Path verdicts map to localization evidence (`core/states.py`: BAD and GOOD): a path is *bad*
when down, damped (flapping) or degraded, *good* when up; suspect and recovering are passing
states that leave the path's last evidence standing (a finding clears when its paths are up
again, as the agents see it). The reason names the path's direction when the detector knows it
(gray loss and latency are judged per direction).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.fabric import (DOWN, EITHER, LINK_DIRECTIONS, UP, FabricError, FabricModel, directed, mirror,
                           split_directed)
from ..core.localize import Localizer, Observation, path_evidence
from ..core.plan import plan_cap, plan_probes
from ..core.report_digest import digest_of, row_hash
from ..core.shards import ShardedLocalizer
from ..core.states import Level, health_of, is_bad, is_good, worst
from ..control.bodies import (ChangeIn, PathIn, ProbeBudget, RegisterIn, ReportIn, is_decimal,
                                parse_register, parse_report)
from ..control.errors import NOT_REGISTERED, CoordinatorError, NotFound, Refused
from ..kernel.heap import collector_paused
from .store import EventRow, PathRow, StateRow, Store

PLAN_REVISE_S = 1.0
PLAN_HISTORY = 16  # plan versions kept to answer agents with a delta from theirs
TOUCH_S = 10.0
RETAIN_EVERY_S = 60.0  # old events are pruned this often
# a reporter's detections and recoveries reach the history one by one up to this many per window;
# the rest of the window as one summary event (one agent's flapping table must not bury the rest)
DETECTION_EVENTS_PER_WINDOW = 64
DETECTION_WINDOW_S = 10.0
def _no_cost() -> float:
    """The cost clock when the host gives none: localization and planning count as free."""
    return 0.0


@dataclass
class CoordinatorConfig:
    max_drain_share: float = 0.05  # of one tier's links in one plane; at least one is always allowed
    agent_timeout_s: float = 10.0  # an agent silent this long is reported lost
    agent_expire_s: float = 86400.0  # ... and this long, removed (as by decommission)
    full_mesh_max: int = 16  # probe plans: full mesh up to this many hosts
    event_retention_s: float = 90 * 86400.0  # events older than this are deleted
    event_retention_count: int = 1_000_000  # and beyond this many, the oldest


@dataclass
class PathRecord:
    key: str
    reporter: str
    peer: str
    plane: int
    sport: int
    hops: tuple
    peer_addr: str
    state: str
    reason: str | None
    updated: float
    links: tuple[str, ...] = ()  # forward directed links (empty: unknown to the fabric model)
    fed: tuple | None = None  # (bad, direction) the localizer last got for this path

    @property
    def id(self) -> int:
        """The path's id at its reporter (the key's last part)."""
        return int(self.key.rsplit("/", 1)[1])

    def info(self) -> dict:
        return {"peer": self.peer, "plane": self.plane, "sport": self.sport, "hops": list(self.hops),
                "peer_addr": self.peer_addr}


@dataclass
class AgentRecord:
    name: str
    agent_id: int
    info: dict
    first_seen: float
    last_seen: float
    lost: bool = False


@dataclass
class _Changes:
    events: list[EventRow] = field(default_factory=list)
    paths: list[PathRow] = field(default_factory=list)
    states: list[StateRow] = field(default_factory=list)


class Coordinator:
    def __init__(self, store: Store, model: FabricModel | None = None, config: CoordinatorConfig | None = None, *,
                 wall_s: float, cost_clock: Callable[[], float] = _no_cost,
                 localizer: Localizer | ShardedLocalizer | None = None):
        """`wall_s`: the host's wall clock in seconds (time.time()), the clock of every later call's `wall_s`;
        `cost_clock`: a monotonic clock in seconds (the host passes time.perf_counter) that
        bounds how much of the time localization and plan revision may take; `localizer`: one
        for the whole fleet by default, or a sharded coordinator's root's, split over its
        shards (core/shards.py)."""
        self.store = store
        self._cost_clock = cost_clock
        self.config = config or CoordinatorConfig()
        self.model = model
        self.localizer = localizer if localizer is not None else Localizer(model, pause=collector_paused) if model is not None else None
        self.paths: dict[str, PathRecord] = {}
        # kept as paths come, change and go, so counting them costs no walk of every path (and
        # no lock: /metrics reads a copy)
        self.state_counts: dict[str, int] = defaultdict(int)
        self.paths_unmapped = 0  # held paths whose hops fit no path of the fleet model
        self.digest_sums: dict[str, int] = defaultdict(int)  # reporter -> its verdicts' digest (core/report_digest.py)
        self.by_reporter: dict[str, set[str]] = defaultdict(set)
        self.agents: dict[str, AgentRecord] = {}
        self.findings: dict[str, dict] = {}  # directed link -> finding dict
        self.counters: dict[str, int] = defaultdict(int)
        # reporter -> [window start, events written in it, {kind: events held back}] (see _flush)
        self._detections: dict[str, list] = {}
        self.started = wall_s
        self._dirty = False
        self._recover()

    # ---- restart -----------------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the in-memory view from the store (a restarted actor loses nothing)."""
        for name, a in self.store.agents().items():
            info = {k: v for k, v in a.items() if k not in ("agent_id", "first_seen", "last_seen")}
            self.agents[name] = AgentRecord(name, a["agent_id"], info, a["first_seen"], a["last_seen"])
        for row in self.store.paths():
            rec = PathRecord(row["key"], row["reporter"], row["peer"], row["plane"], row["sport"], tuple(row["hops"]),
                             row["peer_addr"], row["state"], row["reason"], row["updated"])
            self._index(rec)
        self.drains = self.store.drains()
        self.drain_version = int(self.store.get_meta("drain_version") or 0)
        self.plan_version = int(self.store.get_meta("plan_version") or 0)
        self._plan_hosts: tuple[str, ...] = ()
        self._plan_members: frozenset[str] = frozenset()
        # version -> (members, plan, names whose reachability info changed into that version)
        self._plan_log: dict[int, tuple[frozenset, object, frozenset]] = {}
        self._info_changed: set[str] = set()  # since the last plan version
        self._delta_cache: dict[tuple[int, int], tuple[frozenset, frozenset]] = {}
        self._plan = None
        self._plan_caps: dict[str, int] = {}  # the caps the current plan was made with
        self._under_covered: tuple[str, ...] = ()  # its links short of 2 reporters (logged when it changes)
        self._plan_at: float | None = None
        self._members_changed = True  # an agent joined, was lost or returned since the last plan
        self._touched_at = 0.0
        self._plan_every_s = PLAN_REVISE_S
        self._localize_at = 0.0  # next time relocalize may run (bounded duty cycle, see tick)
        self._retain_at = 0.0  # next time old events are pruned
        self._dirty = True
        if self.agents or self.paths:
            self.counters["recovered_paths"] = len(self.paths)
            self.store.event("coordinator", "coordinator", "start", recovered_agents=len(self.agents),
                             recovered_paths=len(self.paths), drains=sorted(self.drains))

    def _index(self, rec: PathRecord) -> None:
        if self.model is not None:
            try:
                rec.links = self.model.links_of_path(rec.reporter, rec.plane, rec.hops, rec.peer_addr)
            except FabricError:
                rec.links = ()
                self.counters["paths_unmapped"] += 1
        old = self.paths.get(rec.key)
        if old is not None:
            self._tally(old, -1)
        self.paths[rec.key] = rec
        self._tally(rec, 1)
        self.by_reporter[rec.reporter].add(rec.key)
        self._observe(rec)

    def _tally(self, rec: PathRecord, n: int) -> None:
        self.digest_sums[rec.reporter] += n * row_hash(rec.id, rec.state, rec.reason)
        self.state_counts[rec.state] += n
        if not self.state_counts[rec.state]:
            del self.state_counts[rec.state]
        if self.model is not None and not rec.links:
            self.paths_unmapped += n

    def _observe(self, rec: PathRecord) -> None:
        if self.localizer is None or not rec.links:
            return
        evidence = path_evidence(rec.state, rec.reason)
        if evidence is None or rec.fed == evidence:
            return  # e.g. up -> suspect -> up: nothing the localizer does not know
        if evidence[0] or (rec.fed is not None and rec.fed[0]):
            self._dirty = True  # findings depend on bad evidence; good alone changes none
        rec.fed = evidence
        # reply paths are ECMP-hashed by the peer and not traced: reverse=None lets the localizer use
        # only the links every reply must cross
        self.localizer.update(Observation(rec.reporter, rec.key, rec.links, None, *evidence))

    # ---- agents ------------------------------------------------------------------------
    def register(self, body, wall_s: float) -> dict:
        """An agent (re)starts or the coordinator came back: its identity and its whole path table.
        The body is checked whole first: a refused registration changes nothing."""
        req = body if isinstance(body, RegisterIn) else parse_register(body)
        name = req.name
        info = {"service": req.service, "nics": dict(req.nics), "version": req.version, "api_port": req.api_port,
                "probe_budget": _budget_doc(req.probe_budget)}
        known = self.agents.get(name)
        if known is None or known.lost:
            self.store.event("agent", name, name, what="registered" if known is None else "returned",
                             agent_id=req.agent_id, paths=len(req.paths))
            self._members_changed = True
        if known is not None and (known.agent_id, known.info["service"], known.info["nics"]) != \
                (req.agent_id, req.service, info["nics"]):
            self._info_changed.add(name)  # its peers must learn its new addresses (even if it was away)
            self._members_changed = True
        if known is not None and known.info.get("probe_budget") != info["probe_budget"]:
            self._members_changed = True  # its cap changed: the plan is revised (see _current_plan)
        first = known.first_seen if known else wall_s
        self.agents[name] = AgentRecord(name, req.agent_id, info, first, wall_s)
        self.store.upsert_agent(name, req.agent_id, info, wall_s)
        changes = _Changes()
        keep = {self._put_path(name, p, wall_s, changes) for p in req.paths}
        for key in self.by_reporter.get(name, set()) - keep:
            self._drop_path(key)
        self.store.drop_paths(name, keep)
        self._flush(changes)
        return self._answer(name, req, wall_s)

    def report(self, body, wall_s: float) -> dict:
        """Path verdicts from one agent: `changes` (state moves since the last report) and, now
        and then, `paths` (the full table: a summary that heals anything a lost report missed)
        or `digest` (core/report_digest.py: the same check for an agent that sends digests; one
        that does not match what is held here, or a change of a path not held, gets `send_paths`
        and sends its table with its next report). The body is checked whole first: a refused
        report changes nothing."""
        req = body if isinstance(body, ReportIn) else parse_report(body)
        name = req.name
        agent = self.agents.get(name)
        if agent is None:
            raise NotFound(f"agent {name!r} has not registered; it registers by itself on start "
                           "(restart it if this persists)", kind=NOT_REGISTERED)
        self._alive(agent, wall_s)
        budget = _budget_doc(req.probe_budget)
        if budget is not None and budget != agent.info.get("probe_budget"):
            agent.info["probe_budget"] = budget
            self.store.upsert_agent(name, agent.agent_id, agent.info, wall_s)
            self._members_changed = True  # its cap changed: the plan is revised (see _current_plan)
        changes = _Changes()
        if req.paths is not None:
            keep = {self._put_path(name, p, wall_s, changes) for p in req.paths}
            for key in self.by_reporter.get(name, set()) - keep:
                self._drop_path(key)
            self.store.drop_paths(name, keep)
        for c in req.changes:
            self._change(name, c, wall_s, changes)
        self._flush(changes)
        answer = self._answer(name, req, wall_s)
        if req.digests and req.paths is None:
            stale = any(f"{name}/{c.id}" not in self.paths for c in req.changes)
            if req.digest is not None and not stale:
                stale = digest_of(self.digest_sums[name]) != req.digest  # kept as verdicts change: no pass
                self.counters["digests"] += 1
            if stale:
                self.counters["digest_mismatches"] += 1
                answer["send_paths"] = True
        return answer

    def heard_from(self, names, wall_s: float) -> None:
        """Agents a coordinator shard heard from (reports it answered itself, having nothing new):
        alive now, as a report would make them. Names not registered here are skipped (the shard
        sends them to register)."""
        for name in names:
            agent = self.agents.get(name)
            if agent is not None:
                self._alive(agent, max(agent.last_seen, wall_s))

    def _alive(self, agent: AgentRecord, wall_s: float) -> None:
        """The agent was heard from at `wall_s`: a lost one has returned."""
        if agent.lost:
            agent.lost = False
            self._members_changed = True
            self.store.event("agent", agent.name, agent.name, what="returned")
        agent.last_seen = wall_s

    def _put_path(self, reporter: str, p: PathIn, wall_s: float, changes: _Changes) -> str:
        key = f"{reporter}/{p.id}"
        old = self.paths.get(key)
        if old is not None and old.hops == p.hops and old.peer == p.peer and old.plane == p.plane \
                and old.sport == p.sport and old.peer_addr == p.peer_addr:
            if old.state != p.state or old.reason != p.reason:
                self._set_state(old, p.state, p.reason, wall_s, changes)
            return key
        rec = PathRecord(key, reporter, p.peer, p.plane, p.sport, p.hops, p.peer_addr, p.state, p.reason, wall_s)
        if old is not None:
            self._drop_path(key)
        self._index(rec)
        changes.paths.append(PathRow(key, reporter, rec.info(), p.state, p.reason, wall_s))
        if is_bad(p.state):
            changes.events.append(EventRow(wall_s, "detection", reporter, key, {"peer": rec.peer, "plane": rec.plane,
                                                                             "state": p.state, "reason": p.reason}))
        return key

    def _change(self, reporter: str, c: ChangeIn, wall_s: float, changes: _Changes) -> None:
        rec = self.paths.get(f"{reporter}/{c.id}")
        if rec is None:
            self.counters["changes_unknown_path"] += 1  # the next summary brings the path (or at once: send_paths)
            return
        self._set_state(rec, c.state, c.reason, wall_s, changes)

    def _set_state(self, rec: PathRecord, state: str, reason: str | None, wall_s: float, changes: _Changes) -> None:
        was_bad = is_bad(rec.state)
        self._tally(rec, -1)
        rec.state, rec.reason, rec.updated = state, reason, wall_s
        self._tally(rec, 1)
        self.counters["path_changes"] += 1
        changes.states.append(StateRow(rec.key, state, reason, wall_s))
        self._observe(rec)
        now_bad = is_bad(state)
        if now_bad != was_bad:
            changes.events.append(EventRow(wall_s, "detection" if now_bad else "recovery", rec.reporter, rec.key,
                                           {"peer": rec.peer, "plane": rec.plane, "state": state, "reason": reason}))

    def _drop_path(self, key: str) -> None:
        rec = self.paths.pop(key, None)
        if rec is None:
            return
        self._tally(rec, -1)
        self.by_reporter[rec.reporter].discard(key)
        if self.localizer is not None:
            self.localizer.forget(key)
            self._dirty = self._dirty or is_bad(rec.state)

    def _flush(self, changes: _Changes) -> None:
        # one transaction: states stored without their events would stay so after a restart,
        # since the agent's retry of the same change then changes nothing
        events = [e for e in changes.events if self._record_detection(e)]
        with self.store.transaction():
            self.store.put_paths(changes.paths)
            self.store.put_states(changes.states)
            self.store.add_events(events)

    def _record_detection(self, event: tuple) -> bool:
        """Whether a detection or recovery goes into the history one by one: up to
        DETECTION_EVENTS_PER_WINDOW per reporter and window; the rest is counted, and written as
        one summary event when the window ends (_summarize_detections)."""
        ts, kind, reporter = event[0], event[1], event[2]
        if kind not in ("detection", "recovery"):
            return True
        w = self._detections.get(reporter)
        if w is None or ts - w[0] >= DETECTION_WINDOW_S:
            self._summarize_detections(ts, only=reporter)
            w = self._detections[reporter] = [ts, 0, {}]
        if w[1] < DETECTION_EVENTS_PER_WINDOW:
            w[1] += 1
            return True
        w[2][kind] = w[2].get(kind, 0) + 1
        self.counters["detections_summarized"] += 1
        return False

    def _summarize_detections(self, wall_s: float, only: str | None = None) -> None:
        """One event per reporter whose window ended with detections held back."""
        for reporter in [only] if only is not None else list(self._detections):
            w = self._detections.get(reporter)
            if w is None or wall_s - w[0] < DETECTION_WINDOW_S:
                continue
            del self._detections[reporter]
            if w[2]:
                self.store.event("detection", reporter, reporter, summary=True, window_s=DETECTION_WINDOW_S,
                                 detections=w[2].get("detection", 0), recoveries=w[2].get("recovery", 0),
                                 note=f"beyond {DETECTION_EVENTS_PER_WINDOW} a window one by one, this reporter's "
                                      "changes are counted here; its paths' states are current all the same")

    def _answer(self, name: str, req: RegisterIn | ReportIn, wall_s: float) -> dict:
        """What the agent needs back: drains and its probe plan, when its copies are stale."""
        out: dict = {"drain_version": self.drain_version, "plan_version": self.plan_version}
        if req.digests:  # only to agents that asked: an older one refuses an answer with a field it does not know
            out["digests"] = True
        if req.drain_version != self.drain_version:
            out["drains"] = self.drain_addresses()
        self._current_plan(wall_s)
        planned = name in self._plan_members
        if planned and req.plan_version != self.plan_version:
            delta = self._plan_delta(name, req.plan_version) if req.plan_deltas else None
            if delta is not None:
                out["plan_delta"] = delta
            else:
                out["plan"] = self.plan_for(name, wall_s)
        out["plan_version"] = self.plan_version if planned else None
        return out

    def decommission(self, host: str, reason: str, by: str, wall_s: float, dry_run: bool = False) -> dict:
        """Forget an agent: its record, its paths and what they told the localizer. A host that
        still runs an agent comes back by itself at its next registration."""
        a = self.agents.get(host)
        if a is None:
            raise NotFound(f"no agent named {host!r} is known (`linkpass status -o wide` lists the fleet)")
        result = {"host": host, "paths": len(self.by_reporter.get(host, ())), "was_lost": a.lost, "dry_run": dry_run,
                  "changed": False}
        if dry_run:
            return result
        with self.store.transaction():
            self._forget_agent(host)
            self.store.event("agent", by, host, what="decommissioned", reason=reason, paths=result["paths"],
                             silent_s=round(wall_s - a.last_seen, 1))
        result["changed"] = True
        return result

    def _forget_agent(self, host: str) -> None:
        for key in list(self.by_reporter.get(host, ())):
            self._drop_path(key)
        self.by_reporter.pop(host, None)
        self.agents.pop(host, None)
        self.store.forget_agent(host)
        self._members_changed = True
        self._info_changed.add(host)  # back within the same plan revision, it may have new addresses

    # ---- periodic ----------------------------------------------------------------------
    def tick(self, wall_s: float) -> None:
        """Liveness, expiry, retention and localization; the host calls it every ~100 ms."""
        expired = [a for a in self.agents.values() if wall_s - a.last_seen > self.config.agent_expire_s]
        for a in expired:
            n = len(self.by_reporter.get(a.name, ()))
            self._forget_agent(a.name)
            self.store.event("agent", "coordinator", a.name, what="expired", paths=n,
                             silent_s=round(wall_s - a.last_seen, 1),
                             note=f"silent longer than agent_expire_s ({self.config.agent_expire_s:g} s): forgotten; "
                                  "it registers again if it comes back")
        self._summarize_detections(wall_s)
        if wall_s >= self._retain_at:
            self._retain_at = wall_s + RETAIN_EVERY_S
            removed = self.store.prune_events(wall_s - self.config.event_retention_s, self.config.event_retention_count)
            self.counters["events_pruned"] += removed
        for a in self.agents.values():
            if not a.lost and wall_s - a.last_seen > self.config.agent_timeout_s:
                a.lost = True
                self._members_changed = True
                self.store.event("agent", "coordinator", a.name, what="lost",
                                 silent_s=round(wall_s - a.last_seen, 1),
                                 note="no report from this agent: it keeps failing over locally if it runs")
        for name, d in sorted(self.drains.items()):
            if d.get("until") is not None and wall_s >= d["until"]:  # a timed drain ran out
                self.undrain(name, "coordinator", wall_s,
                             note=f"drain --for ran out (drained by {d['by']}: {d['reason']})")
        if wall_s - self._touched_at >= TOUCH_S:  # last-seen times reach the disk coarsely
            self._touched_at = wall_s
            self.store.touch_agents({a.name: a.last_seen for a in self.agents.values()})
        self._current_plan(wall_s)  # joins and leaves since the last revision
        if isinstance(self.localizer, ShardedLocalizer):
            self.localizer.send()  # the shards take this tick's evidence in now, side by side
        if self._dirty and wall_s >= self._localize_at:
            t = self._cost_clock()
            self.relocalize(wall_s)
            # under a storm of bad reports findings() grows; keep it under ~20 % of the lock
            self._localize_at = wall_s + 4 * (self._cost_clock() - t)

    def relocalize(self, wall_s: float) -> list[dict]:
        """Recompute findings; log the ones that appeared and the ones that cleared."""
        self._dirty = False
        if self.localizer is None:
            return []
        found = {}
        for f in self.localizer.findings():
            d = f.as_dict()
            other_way = mirror(f.directed)
            if other_way in f.alternatives:
                # hard failures rarely say which way packets died: the link is named, its
                # direction is not, and its confidence is the sum over both
                d["alternatives"] = [x for x in d["alternatives"] if x != other_way]
                d["direction"] = EITHER
                d["confidence"] = min(1.0, round(f.confidence * 2, 4))
            lk = self.model.links[f.link]
            d["a"], d["b"] = lk.a, lk.b
            host_end = lk.a
            if host_end in self.agents and self.agents[host_end].lost:
                d["note"] = f"agent {host_end} is not reporting: the host may be down rather than the link"
            found[f.directed] = d
        events = []
        for dl, d in found.items():
            if dl not in self.findings:
                events.append(EventRow(wall_s, "localization", "coordinator", dl, d))
        for dl, d in self.findings.items():
            if dl not in found:
                events.append(EventRow(wall_s, "cleared", "coordinator", dl, {"was": d}))
        self.findings = found
        self.store.add_events(events)
        return list(found.values())

    # ---- probe plans -------------------------------------------------------------------
    def _current_plan(self, wall_s: float):
        """The plan for the agents present now; recomputed when hosts joined or left, but at most
        every PLAN_REVISE_S (hosts start in waves: one plan per joiner would be quadratic)."""
        if not self._members_changed or (self._plan_at is not None and wall_s - self._plan_at < self._plan_every_s):
            return self._plan
        self._members_changed = False
        hosts = tuple(sorted(n for n, a in self.agents.items() if not a.lost))
        caps = self._caps(hosts)
        if hosts != self._plan_hosts or self._info_changed or caps != self._plan_caps:
            self._plan_hosts = hosts
            self._plan_members = frozenset(hosts)
            self._plan_caps = caps
            self._plan_at = wall_s
            if self.model is not None:
                known = [h for h in hosts if h in self.model.hosts]
                t = self._cost_clock()
                self._plan = plan_probes(self.model, known, full_mesh_max=self.config.full_mesh_max, caps=caps)
                # a 16k-GPU plan takes ~0.7 s here: revise no more than a tenth of the time
                self._plan_every_s = max(PLAN_REVISE_S, 10 * (self._cost_clock() - t))
            else:
                self._plan = None
            self.plan_version += 1
            self.store.set_meta("plan_version", str(self.plan_version))
            self._note_coverage(tuple(self._plan.under_covered) if self._plan is not None else ())
            self._plan_log[self.plan_version] = (self._plan_members, self._plan, frozenset(self._info_changed))
            self._info_changed.clear()
            for v in [v for v in self._plan_log if v <= self.plan_version - PLAN_HISTORY]:
                del self._plan_log[v]
            self._delta_cache.clear()
        return self._plan

    def _caps(self, hosts) -> dict[str, int]:
        """Planned paths each agent may take, from the probe budget it reported (none: no cap)."""
        out = {}
        for h in hosts:
            b = self.agents[h].info.get("probe_budget")
            cap = None if not b else plan_cap(b["pps"], b["idle_interval_ms"])
            if cap is not None:
                out[h] = cap
        return out

    def _note_coverage(self, under: tuple[str, ...]) -> None:
        """An event (and a log line) when the links the budgets leave short of 2 reporters change."""
        if under == self._under_covered:
            return
        self._under_covered = under
        self.store.event("coordinator", "coordinator", "plan", what="under_covered" if under else "covered",
                         links=list(under[:20]), count=len(under), plan_version=self.plan_version,
                         note="the probe budgets agents report leave these links fewer than 2 reporters: "
                              "a fault there cannot be localized; raise probe.budget_pps on their hosts"
                              if under else "every link has 2 reporters again")

    def _plan_delta(self, host: str, since: int | None) -> dict | None:
        """The change from plan version `since` (which the agent holds) to the current one, for
        `host`: the peers to add or refresh and the names to drop. So an answer after a plan
        change costs what changed, not the whole fleet. None when `since` is too old (or unknown,
        as after a restart): the agent then gets the whole plan."""
        old, cur = self._plan_log.get(since), self._plan_log.get(self.plan_version)
        if old is None or cur is None:
            return None
        members, plan, _ = cur
        joined_or_left, info = self._changed_between(since, self.plan_version)
        if plan is not None and host in self.model.hosts:
            new_peers = set(plan.peers_of(host))
            old_peers = set(old[1].peers_of(host)) if old[1] is not None else set()
            add = (new_peers - old_peers) | (info & new_peers)
            remove = old_peers - new_peers
        else:  # no fabric model: every member probes every other; what changed is who is a member
            changed = joined_or_left | info
            add = {n for n in changed if n in members}
            remove = set(changed - members)
        add.discard(host)
        remove.discard(host)
        return {"from": since, "version": self.plan_version, "peers": self._peer_docs(sorted(add)),
                "remove": sorted(remove)}

    def _changed_between(self, since: int, now_v: int) -> tuple[frozenset, frozenset]:
        """Between plan versions `since` and `now_v`: the names that joined or left, and those
        whose reachability info changed; computed once per pair of versions, however many agents
        ask (each answer then costs what changed)."""
        key = (since, now_v)
        if key not in self._delta_cache:
            info: set[str] = set()
            for v in range(since + 1, now_v + 1):
                if v in self._plan_log:
                    info |= self._plan_log[v][2]
            self._delta_cache[key] = (self._plan_log[since][0] ^ self._plan_log[now_v][0], frozenset(info))
        return self._delta_cache[key]

    def _peer_docs(self, names) -> list[dict]:
        out = []
        for n in names:
            a = self.agents.get(n)
            if a is not None:
                out.append({"name": n, "agent_id": a.agent_id, "service": a.info["service"],
                            "nics": {str(k): v for k, v in a.info["nics"].items()}})
        return out

    def plan_for(self, host: str, wall_s: float) -> dict | None:
        """Which peers `host` should probe, with what the agent needs to reach them; None if
        the host is not in the current plan yet (it gets one with a later answer)."""
        if host not in self.agents:
            return None
        plan = self._current_plan(wall_s)
        if host not in self._plan_members:
            return None
        if plan is not None and host in self.model.hosts:
            names = plan.peers_of(host)
        else:  # no fabric model: everyone probes everyone it can reach
            names = [n for n in self._plan_hosts if n != host]
        return {"version": self.plan_version, "peers": self._peer_docs(names)}

    # ---- drains ------------------------------------------------------------------------
    def drain_addresses(self) -> list[dict]:
        """Per drained link, the addresses that identify crossing it: a path crosses a link when
        one of its hops, or its destination, is an interface address of that link."""
        out = []
        for name in sorted(self.drains):
            lk = self.model.links.get(name) if self.model else None
            addrs = [a for a in ((lk.a_addr, lk.b_addr) if lk else ()) if a]
            out.append({"link": name, "addrs": addrs})
        return out

    def _link(self, name: str) -> str:
        if self.model is None:
            raise CoordinatorError("no fabric model is loaded, so links have no names here; start the coordinator "
                                   "with --testbed PREFIX or --fabric FILE")
        if name in self.model.links:
            return name
        parts = name.split("-")
        if len(parts) == 2 and f"{parts[1]}-{parts[0]}" in self.model.links:
            return f"{parts[1]}-{parts[0]}"
        raise NotFound(f"no link named {name!r} in the fabric (names look like "
                       f"{', '.join(list(self.model.links)[:2])}; `linkpass links` lists them)")

    def what_if(self, drained: set[str]) -> dict:
        """Which paths would move and which (host, peer) pairs would lose their last path if
        exactly `drained` were drained (paths already down count as unusable too)."""
        dl = {directed(n, d) for n in drained for d in LINK_DIRECTIONS}
        moved = defaultdict(list)
        usable = defaultdict(int)
        total = defaultdict(int)
        for rec in self.paths.values():
            pair = (rec.reporter, rec.peer)
            total[pair] += 1
            crosses = any(x in dl for x in rec.links)
            if crosses:
                moved[rec.reporter].append({"path": rec.key, "peer": rec.peer, "plane": rec.plane, "sport": rec.sport})
            elif not is_bad(rec.state):
                usable[pair] += 1
        stranded = sorted(f"{h} -> {p}" for (h, p) in total if usable[(h, p)] == 0)
        return {"hosts": sorted(moved), "paths": {h: v for h, v in sorted(moved.items())},
                "paths_moved": sum(len(v) for v in moved.values()), "stranded": stranded}

    def drain(self, link: str, reason: str, by: str, wall_s: float, dry_run: bool = False, force: bool = False,
              for_s: float | None = None) -> dict:
        """Steer every agent off `link` (guarded; recorded with `by` and `reason`). `for_s`: the
        drain ends by itself that long from now (the tick undrains it, recorded as the coordinator's)."""
        name = self._link(link)
        if not reason or not reason.strip():
            raise CoordinatorError("a drain needs --reason (it goes into the history on-call reads later)")
        if name in self.drains:
            return {"link": name, "changed": False, "drain": self.drains[name], "dry_run": dry_run}
        lk = self.model.links[name]
        same = [n for n, x in self.model.links.items() if x.kind == lk.kind and x.plane == lk.plane]
        limit = max(1, math.floor(self.config.max_drain_share * len(same)))
        drained_here = [n for n in self.drains if n in set(same)]
        impact = self.what_if(set(self.drains) | {name})
        # only pairs this drain strands count: pairs whose paths are all down already are not its doing
        already = set(self.what_if(set(self.drains))["stranded"])
        impact["stranded"] = [p for p in impact["stranded"] if p not in already]
        problem = None
        if len(drained_here) + 1 > limit:
            problem = (f"blast-radius guard: {len(drained_here)} of {len(same)} {lk.kind} links in plane {lk.plane} "
                       f"are drained already ({', '.join(sorted(drained_here))}); at most {limit} "
                       f"({self.config.max_drain_share:.0%}) may be. Undrain one first, or raise max_drain_share")
        elif impact["stranded"] and not force:
            problem = (f"draining {name} would leave {len(impact['stranded'])} host pairs without a usable path "
                       f"({', '.join(impact['stranded'][:5])}); agents never remove a last path, so these would keep "
                       "using it anyway. Fix or undrain the other links first (or --force to record it regardless)")
        until = None if for_s is None else wall_s + for_s
        result = {"link": name, "kind": lk.kind, "plane": lk.plane, "dry_run": dry_run, "impact": impact,
                  "limit": limit, "drained_in_tier": sorted(drained_here), "until": until}
        if problem:
            self.store.event("refused", by, name, action="drain", reason=reason, why=problem, dry_run=dry_run)
            if not dry_run:
                raise Refused(problem)
            result["refused"] = problem
            return result
        if dry_run:
            return result
        # the drain, its version and its event in one transaction: a drain stored without its new
        # version would reach no agent (they hold the old version; the retry finds it drained)
        with self.store.transaction():
            self.store.set_drain(name, reason, by, wall_s, until)
            self._bump_drains()
            self.store.event("drain", by, name, reason=reason, hosts=impact["hosts"],
                             paths_moved=impact["paths_moved"], **({} if for_s is None else {"for_s": for_s,
                                                                                             "until": until}))
        self.drains[name] = {"reason": reason, "by": by, "since": wall_s, "until": until}
        result["changed"] = True
        return result

    def undrain(self, link: str, by: str, wall_s: float, dry_run: bool = False, note: str | None = None) -> dict:
        name = self._link(link)
        if name not in self.drains:
            return {"link": name, "changed": False, "dry_run": dry_run}
        impact = self.what_if(set(self.drains) - {name})
        back = self.what_if({name})
        result = {"link": name, "dry_run": dry_run, "impact": {"hosts": back["hosts"], "paths_moved": back["paths_moved"],
                                                                "stranded": impact["stranded"]}}
        if dry_run:
            return result
        was = self.drains[name]
        with self.store.transaction():
            self.store.clear_drain(name)
            self._bump_drains()
            self.store.event("undrain", by, name, drained_by=was["by"], drained_for_s=round(wall_s - was["since"], 1),
                             **({"note": note} if note else {}))
        del self.drains[name]
        result["changed"] = True
        return result

    def _bump_drains(self) -> None:
        self.drain_version += 1
        self.store.set_meta("drain_version", str(self.drain_version))

    # ---- views (the CLI and dashboards) -------------------------------------------------
    def status(self, wall_s: float) -> dict:
        states = dict(self.state_counts)
        lost = sorted(n for n, a in self.agents.items() if a.lost)
        # a fault is critical for the fleet once it is localized (or an agent is lost); before
        # that, paths that are not ok are a warning, however bad each one is
        paths = Level.OK if worst(health_of(s) for s in states) is Level.OK else Level.WARNING
        health = Level.CRITICAL if self.findings or lost else paths
        return {"health": health.value, "agents": len(self.agents), "agents_lost": lost,
                "paths": len(self.paths), "paths_by_state": dict(sorted(states.items())),
                "findings": sorted(self.findings.values(), key=lambda d: -d["confidence"]),
                "drains": [{"link": k, **v} for k, v in sorted(self.drains.items())],
                "fabric": None if self.model is None else {"hosts": len(self.model.hosts), "planes": self.model.planes,
                                                           "links": len(self.model.links)},
                "plan_version": self.plan_version, "drain_version": self.drain_version,
                "uptime_s": round(wall_s - self.started, 1)}

    def links(self, only_problems: bool = False) -> list[dict]:
        if self.model is None:
            raise CoordinatorError("no fabric model is loaded; start the coordinator with --testbed PREFIX or "
                                   "--fabric FILE to see links")
        good = defaultdict(int)
        bad = defaultdict(int)
        for rec in self.paths.values():
            for dl in rec.links:
                if is_bad(rec.state):
                    bad[dl] += 1
                elif is_good(rec.state):
                    good[dl] += 1
        rows = []
        for name, lk in self.model.links.items():
            faults = [self.findings[directed(name, d)] for d in LINK_DIRECTIONS if directed(name, d) in self.findings]
            drain = self.drains.get(name)
            up, down = directed(name, UP), directed(name, DOWN)
            health = ("faulty" if faults else "drained" if drain else
                      "unwatched" if not (good[up] + bad[up]) or not (good[down] + bad[down]) else "ok")
            if only_problems and health == "ok":
                continue
            rows.append({"link": name, "tier": lk.kind, "plane": lk.plane, "a": lk.a, "b": lk.b, "health": health,
                         "faults": [{"direction": f["direction"], "confidence": f["confidence"],
                                     "alternatives": f.get("alternatives", []),
                                     **({"note": f["note"]} if "note" in f else {})} for f in faults],
                         "drain": drain, "paths_up": {"good": good[up], "bad": bad[up]},
                         "paths_down": {"good": good[down], "bad": bad[down]}})
        return rows

    def path_rows(self, host: str | None = None, peer: str | None = None) -> list[dict]:
        if host is not None and host not in self.agents:
            raise NotFound(f"no agent named {host!r} has registered (`linkpass status` lists the fleet)")
        rows = []
        for key in sorted(self.paths, key=_key_order):
            rec = self.paths[key]
            if (host and rec.reporter != host) or (peer and rec.peer != peer):
                continue
            rows.append({"key": key, "host": rec.reporter, "peer": rec.peer, "plane": rec.plane, "sport": rec.sport,
                         "state": rec.state, "reason": rec.reason, "updated": rec.updated,
                         "links": [_pretty(self.model, dl) for dl in rec.links] if self.model else []})
        return rows

    def agent_rows(self, wall_s: float) -> list[dict]:
        return [{"name": a.name, "agent_id": a.agent_id, "lost": a.lost, "last_seen_s": round(wall_s - a.last_seen, 1),
                 "paths": len(self.by_reporter.get(a.name, ())), "version": a.info.get("version"),
                 "service": a.info.get("service")} for a in sorted(self.agents.values(), key=lambda a: a.name)]


def _budget_doc(b: ProbeBudget | None) -> dict | None:
    return None if b is None else {"pps": b.pps, "idle_interval_ms": b.idle_interval_ms}


def _pretty(model: FabricModel, dl: str) -> str:
    name, d = split_directed(dl)
    lk = model.links[name]
    return f"{lk.a}>{lk.b}" if d == UP else f"{lk.b}>{lk.a}"


def _key_order(key: str):
    host, _, pid = key.rpartition("/")
    return host, int(pid) if is_decimal(pid) else 0

"""A coordinator shard: the endpoint a share of the fleet's agents register and report to.

    agents of shard k ── register / report ──► ShardFront k ──(only what is new)──► the root
                                                    │ answers the rest itself
    the root: the fleet's state, plan, drains, localization, history, the CLI's views

A sharded coordinator is a root and S shards (core/shards.py maps hosts to shards by pod or
leaf group). What scales with the fleet is the stream of reports: every agent reports at least
once a second, and nearly all of those reports say nothing new (a heartbeat, or a digest of the
verdicts the coordinator already holds). A shard takes its agents' reports, checks their tokens,
keeps each agent's verdicts to check digests against, and answers a report that brings nothing
new itself. A report whose news is only changes of paths it holds is answered too, and queued
for the root: a flusher sends the queue in batches, one call for many reports, so the root's
cost per change is its own work, not a round trip. The queue is bounded (`max_queue`): full, the
shard answers 503 and the agent backs off and sends again, keeping its registration (back
pressure, as a busy coordinator applies it). Registrations, whole tables, budget changes, digests
that differ and agents whose plan or drains are stale go to the root at once (after what is
queued, so the root applies an agent's reports and registrations in order), and the shard relays
its answer. Once
a tick the shard tells the root which agents it heard from (liveness) and learns the current
plan and drain versions.

An agent that registers or reports at the wrong endpoint (the root, or another shard) is sent to
its own with a redirect (307 and the URL), so an agent configured with the root's address finds
its shard, and moves by itself when the shard map changes.

A shard holds nothing that must survive it: restarted, it knows no agent's verdicts, forwards
their reports and asks each for its whole table once (`send_paths`), which also brings the root
whatever changes were queued when it died. When the root is away the shard still answers
heartbeats and queues changes until the queue is full; what needs the root's answer is answered
503, and the agent keeps failing over locally and backs off, its registration standing.

Each shard also localizes its part of the fabric (core/shards.py): it holds a `Part`, the
evidence of every path that may cross a link it owns, and answers the root's rounds. The root
sends each part the changes of its evidence every tick, not awaiting them, and with its next
question whatever came since (`ShardParts`), so evidence crosses once and the shards take it in
and explain side by side in their own processes. Every call says how far the part should be: a
part that is not (its shard restarted, a send was lost) gets its whole evidence again, which the
root keeps; for a shard that does not answer the root explains that part itself until it does.

No Ray and no sockets here: the root is reached through a `RootLink`, the shards through a
`ShardLink` (in process for tests, `ray_actor.RayRoot` and `RayShards` in a cluster); the
shard's endpoint is `http.CoordinatorServer`.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

from ..core.report_digest import RunningDigest
from ..core.fabric import FabricModel
from ..kernel.heap import collector_paused
from ..core.localize import Observation
from ..core.shards import ROOT, Call, Part, ShardError, ShardMap
from ..control.errors import Moved, NotFound, Unavailable
from ..control.bodies import RegisterIn, ReportIn, parse_register, parse_report


class RootUnreachable(ConnectionError):
    """The root did not answer (a RootLink raises it, whatever its transport)."""


class RootLink(Protocol):
    """What a shard asks of the root."""

    def register(self, req: RegisterIn) -> dict: ...

    def report(self, req: ReportIn) -> dict: ...

    def reports(self, batch: list[ReportIn]) -> list[str | None]:
        """Apply queued reports in order; per report None, or the refusal's message."""

    def heard(self, shard: int, names: list[str]) -> tuple[int, int, dict[str, int]]:
        """Shard `shard` is up and these agents are alive; returns the root's plan_version,
        drain_version and the lowest agent-token epoch per revoked host (auth.Tokens)."""

    def add_events(self, events: list[tuple]) -> None: ...


class PartLost(Exception):
    """A shard's part does not hold what the root sent it (the shard, or the root, restarted):
    the root sends the whole evidence again."""


class ShardUnreachable(ConnectionError):
    """A shard did not answer (a ShardLink gives it, whatever its transport)."""


# a round at a shard: (the root's session, the generation the part must be at or None to start
# afresh, its generation after, evidence changes, the Part method, its arguments)
PartCall = tuple[str, "int | None", int, list, str, tuple]


class ShardLink(Protocol):
    """What the root asks of its shards."""

    def parts(self, calls: dict[int, PartCall], timeout_s: float) -> dict[int, object]:
        """PartHost.call at each shard in `calls`, side by side; per shard its answer, or the
        exception instead (PartLost; ShardUnreachable, also for no answer within `timeout_s`)."""

    def send(self, calls: dict[int, PartCall]) -> None:
        """PartHost.call at each shard in `calls`, in order after what was sent or asked
        before, not waiting (a failure shows at the next question: PartLost)."""


class Router:
    """Which endpoint each agent belongs to: the shard map and the shards' URLs."""

    def __init__(self, shard_map: ShardMap, urls: list[str]):
        if len(urls) != shard_map.shards:
            raise ValueError(f"shard_listen: {len(urls)} addresses for {shard_map.shards} shards; give one per shard")
        self.map = shard_map
        self.urls = list(urls)

    def owner(self, name: str) -> int:
        try:
            return self.map.shard_of(name)
        except ShardError:
            raise NotFound(f"host {name!r} is not in the fabric model, so no coordinator shard takes it; add it to "
                           "the model (--fabric) or check the agent's host name") from None

    def moved(self, name: str, here: str) -> Moved:
        k = self.owner(name)
        return Moved(f"agent {name} belongs to coordinator shard {k} at {self.urls[k]}, not {here}; it registers "
                     "and reports there (agents follow this by themselves)", self.urls[k], k)


class _RootStore:
    """What the shard's endpoint asks of a store, answered from the root: the history events it
    writes (refusals) go there, and the revoked agent tokens come from there (each tick)."""

    def __init__(self, front: "ShardFront"):
        self.front = front
        self.epochs: dict[str, int] = {}
        self.fresh = False  # epochs changed since the endpoint last read them

    def add_events(self, events: list[tuple]) -> None:
        try:
            self.front.root.add_events(events)
        except RootUnreachable:
            with self.front._lock:
                self.front.counters["events_dropped"] += len(events)

    def written_elsewhere(self) -> bool:
        return self.fresh

    def agent_epochs(self) -> dict[str, int]:
        self.fresh = False
        return dict(self.epochs)

    def took(self, epochs: dict[str, int]) -> None:
        if epochs != self.epochs:
            self.epochs, self.fresh = dict(epochs), True


class PartHost:
    """A shard's part of split localization, fed and asked by the root (ShardParts). Thread-safe."""

    METHODS = ("cleared", "explain", "count")

    def __init__(self, shard_map: ShardMap, shard: int):
        self.map = shard_map
        self.shard = shard
        self.part = Part(shard_map.model, shard_map, shard, pause=collector_paused)
        self.session: str | None = None  # the root that fed it, and how far
        self.generation = 0
        self.rounds = 0  # the root's questions answered, and the seconds they took here
        self.seconds = 0.0
        self._lock = threading.Lock()

    def call(self, session: str, before: int | None, after: int, changes: list, method: str, args: tuple):
        if method not in self.METHODS:
            raise ValueError(f"no part method {method!r}")
        with self._lock:
            t = time.perf_counter()
            if before is None:
                self.part = Part(self.map.model, self.map, self.shard, pause=collector_paused)
            elif (session, before) != (self.session, self.generation):
                raise PartLost(f"shard {self.shard}'s part is at {self.generation} from {self.session}, not {before} "
                               f"from {session}")
            self.session, self.generation = None, 0  # a failure below leaves it to start afresh
            with collector_paused() if before is None else nullcontext():  # whole: ~10^5 paths (kernel/heap.py)
                self.part.apply(changes)
            self.session, self.generation = session, after
            out = getattr(self.part, method)(*args)
            self.rounds += 1
            self.seconds += time.perf_counter() - t
            return out

    def __len__(self) -> int:
        return len(self.part)


class ShardParts:
    """core/shards.Parts at a sharded coordinator's root: each shard's part in the shard, reached
    through `link`, the root's own here. It keeps every shard's evidence as sent, to send it whole
    to a part that lost it, and to explain a part itself (`standing_in`) while its shard does not
    answer; it tries the shard again after RETRY_S, twice as long after each failure in a row up
    to RETRY_MAX_S (a call to a shard that is restarting waits for the timeout, under the root's
    lock). A shard has TIMEOUT_S to answer, and PER_CHANGE_S more for each piece of evidence it
    takes in first: in the call, and sent before it and not yet confirmed by an answer (a storm's
    evidence, ~10^5 a part at 131 072 GPUs, takes seconds)."""

    RETRY_S = 5.0
    RETRY_MAX_S = 60.0
    TIMEOUT_S = 2.0
    PER_CHANGE_S = 50e-6

    def __init__(self, model: FabricModel, shard_map: ShardMap, link: ShardLink,
                 clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.map = shard_map
        self.link = link
        self.clock = clock
        self.session = secrets.token_hex(8)  # a restarted root's parts start afresh
        self.root = Part(model, shard_map, ROOT, pause=collector_paused)
        self.held: dict[int, dict[str, Observation]] = {k: {} for k in range(shard_map.shards)}
        self.generation: dict[int, int | None] = dict.fromkeys(range(shard_map.shards))  # None: start afresh
        self.standing_in: dict[int, Part] = {}
        self._retry_at: dict[int, float] = {}
        self._failures: dict[int, int] = {}  # failures in a row, per shard
        self._unconfirmed: dict[int, int] = defaultdict(int)  # changes sent since the shard's last answer
        self.counters: dict[str, int] = defaultdict(int)

    def run(self, calls: dict[int, Call], round_: int) -> dict[int, object]:
        out: dict[int, object] = {}
        sent: dict[int, PartCall] = {}
        mono_s = self.clock()
        for p, (changes, method, args) in calls.items():
            if p == ROOT:
                self.root.apply(changes)
                out[p] = getattr(self.root, method)(*args)
                continue
            self._hold(p, changes)
            stand_in = self.standing_in.get(p)
            if stand_in is not None:
                stand_in.apply(changes)
                if mono_s < self._retry_at[p]:
                    out[p] = getattr(stand_in, method)(*args)
                    continue
            sent[p] = self._call(p, changes, method, args)
        answers = self.link.parts(sent, self._timeout(sent)) if sent else {}
        lost = {p: self._call(p, [], *sent[p][4:], afresh=True) for p, a in answers.items() if isinstance(a, PartLost)}
        if lost:
            sent.update(lost)
            answers.update(self.link.parts(lost, self._timeout(lost)))
        for p, a in answers.items():
            if isinstance(a, Exception):
                self.generation[p] = None
                n = self._failures[p] = self._failures.get(p, 0) + 1
                self._retry_at[p] = mono_s + min(self.RETRY_MAX_S, self.RETRY_S * 2 ** (n - 1))
                if p not in self.standing_in:
                    self.counters["parts_stood_in"] += 1
                    self.standing_in[p] = Part(self.model, self.map, p, pause=collector_paused)
                    self.standing_in[p].apply(self.held[p].values())
                out[p] = getattr(self.standing_in[p], sent[p][4])(*sent[p][5])
            else:
                if sent[p][1] is None:
                    self.counters["parts_sent_whole"] += 1
                self.generation[p] = sent[p][2]
                self.standing_in.pop(p, None)
                self._failures.pop(p, None)
                self._unconfirmed.pop(p, None)
                out[p] = a
        return out

    def send(self, changes: dict[int, list]) -> None:
        calls: dict[int, PartCall] = {}
        for p, c in changes.items():
            if p == ROOT:
                self.root.apply(c)
                continue
            self._hold(p, c)
            if p in self.standing_in:
                self.standing_in[p].apply(c)  # the shard gets it all when it answers again
            elif self.generation[p] is not None:  # (None: it gets it all with its next question)
                gen = self.generation[p]
                calls[p] = (self.session, gen, gen + 1, c, "count", ())
                self.generation[p] = gen + 1  # lost on the way, it is PartLost at the next question
                self._unconfirmed[p] += len(c)
        if calls:
            self.link.send(calls)

    def _timeout(self, calls: dict[int, PartCall]) -> float:
        """How long the slowest of `calls` may take: its evidence to take in, and what was sent
        before it."""
        most = max(len(c[3]) + (0 if c[1] is None else self._unconfirmed.get(p, 0)) for p, c in calls.items())
        return self.TIMEOUT_S + self.PER_CHANGE_S * most

    def _hold(self, p: int, changes: list) -> None:
        held = self.held[p]
        for c in changes:
            if isinstance(c, str):
                held.pop(c, None)
            else:
                held[c.key] = c

    def _call(self, p: int, changes: list, method: str, args: tuple, afresh: bool = False) -> PartCall:
        gen = None if afresh else self.generation[p]
        if gen is None:  # the whole evidence, to a part that starts afresh
            return (self.session, None, 1, list(self.held[p].values()), method, args)
        return (self.session, gen, gen + 1 if changes else gen, changes, method, args)

    def status(self) -> dict:
        return {"standing_in": sorted(self.standing_in), **dict(self.counters)}


class LocalShards:
    """ShardLink in this process (tests): the shards' endpoints, asked one after another;
    None in `servers` is a shard that is away."""

    def __init__(self, servers: list):
        self.servers = servers

    def parts(self, calls: dict[int, PartCall], timeout_s: float = 0.0) -> dict[int, object]:
        out: dict[int, object] = {}
        for k, call in calls.items():
            server = self.servers[k] if k < len(self.servers) else None
            try:
                if server is None:
                    raise ShardUnreachable(f"shard {k} is not running")
                out[k] = server.shard.part.call(*call)
            except (PartLost, ShardUnreachable) as exc:
                out[k] = exc
        return out

    def send(self, calls: dict[int, PartCall]) -> None:
        self.parts(calls)  # in order, and what fails shows at the next question


class ShardFront:
    """Shard `shard` of the coordinator (see the module doc). Thread-safe: its own lock guards
    what it holds, and calls to the root are made outside it, so the endpoint's workers forward
    reports to the root side by side (a call is a round trip to another process)."""

    MAX_BATCH = 1000  # queued reports per call to the root

    def __init__(self, router: Router, shard: int, root: RootLink, max_queue: int = 10_000):
        self.router = router
        self.shard = shard
        self.root = root
        self.url = router.urls[shard]
        self.tables: dict[str, RunningDigest] = {}  # agent -> its verdicts, path id -> (state, reason)
        self.versions: tuple[int, int] | None = None  # the root's (plan_version, drain_version)
        self._heard: set[str] = set()
        self.counters: dict[str, int] = defaultdict(int)
        self.store = _RootStore(self)
        self.model = router.map.model
        self._lock = threading.Lock()
        self.max_queue = max_queue
        self.queue: deque[ReportIn] = deque()  # changes answered here, for the root
        self._queued = threading.Condition(self._lock)
        self._flushing = threading.Lock()  # one flush at a time: the root gets each report once, in order
        self.part = PartHost(router.map, shard)  # its part of localization, fed by the root

    # ---- what agents send ---------------------------------------------------------------
    def register(self, body, wall_s: float) -> dict:
        req = body if isinstance(body, RegisterIn) else parse_register(body)
        self._mine(req.name)
        self._after_queued(req.name)
        answer = self._forward(self.root.register, req)
        with self._lock:
            self.tables[req.name] = RunningDigest((p.id, p.state, p.reason) for p in req.paths)
            self.counters["registrations"] += 1
        return answer

    def local_answer(self, req: ReportIn) -> dict | None:
        """The answer to a report that brings nothing new, or only changes of paths this shard
        holds (queued for the root); None: it goes to the root now. Fast and never waits for the
        root (the endpoint calls it on its event loop). Unavailable (503) when the queue is full."""
        self._mine(req.name)
        with self._lock:
            self._heard.add(req.name)
            table = self.tables.get(req.name)
            if table is None or not self._current(req):
                return None
            if req.changes:
                if any(c.id not in table for c in req.changes):
                    return None  # a path the root may not hold either: it asks for the table
                changes = [(c.id, c.state, c.reason) for c in req.changes]
                if req.digest is not None and req.digest != table.digest_after(changes):
                    return None
                if len(self.queue) >= self.max_queue:
                    self.counters["queue_full"] += 1
                    raise Unavailable(f"coordinator shard {self.shard} holds {len(self.queue)} reports for the root "
                                      "(max_queue); retry later (the agent keeps failing over locally)")
                for pid, state, reason in changes:
                    table.set(pid, state, reason)
                self.queue.append(req)
                self.counters["queued"] += 1
                self._queued.notify()
            elif req.digest is not None and req.digest != table.digest():
                return None
            else:
                self.counters["answered"] += 1
            plan_version, drain_version = self.versions
        return {"drain_version": drain_version, "plan_version": plan_version,
                **({"digests": True} if req.digests else {})}

    def report(self, body, wall_s: float) -> dict:
        req = body if isinstance(body, ReportIn) else parse_report(body)
        name = req.name
        answer = self.local_answer(req)
        if answer is not None:
            return answer
        self._after_queued(name)
        answer = self._forward(self.root.report, req)
        with self._lock:
            self.counters["forwarded"] += 1
            if req.paths is not None:
                table = self.tables[name] = RunningDigest((p.id, p.state, p.reason) for p in req.paths)
            else:
                table = self.tables.get(name)
            if table is None:
                # restarted shard: ask for the whole table once, to check later digests against
                return dict(answer, send_paths=True)
            for c in req.changes:
                if c.id in table:
                    table.set(c.id, c.state, c.reason)
        return answer

    def _after_queued(self, name: str) -> None:
        """Before a call that needs the root's answer: what is queued goes first, so the root
        applies an agent's reports (and a registration, which replaces its table) in order.
        Unavailable (503) when the root did not take this agent's queued reports."""
        self.flush()
        with self._lock:
            behind = any(q.name == name for q in self.queue)
        if behind:
            raise Unavailable(f"coordinator shard {self.shard} cannot reach the root with this agent's earlier "
                              "reports; retry later (the agent keeps failing over locally)")

    def _mine(self, name: str) -> None:
        if self.router.owner(name) != self.shard:
            with self._lock:
                self.counters["redirected"] += 1
            raise self.router.moved(name, self.url)

    def _current(self, req: ReportIn) -> bool:
        """No whole table and no budget, and the agent's plan and drains are the root's current."""
        if req.paths is not None or req.probe_budget is not None or self.versions is None:
            return False
        return (req.plan_version, req.drain_version) == self.versions

    def _forward(self, call, req):
        try:
            answer = call(req)
        except RootUnreachable as exc:
            with self._lock:
                self.counters["root_unreachable"] += 1
            raise Unavailable(f"coordinator shard {self.shard} cannot reach the root ({exc}); retry later (the "
                              "agent keeps failing over locally)") from None
        if isinstance(answer, dict) and isinstance(answer.get("drain_version"), int) and \
                isinstance(answer.get("plan_version"), int):
            with self._lock:
                self.versions = (answer["plan_version"], answer["drain_version"])
        return answer

    # ---- the queue ---------------------------------------------------------------------
    def wait_queued(self, timeout_s: float) -> bool:
        """Block until a report is queued (True) or `timeout_s` passes."""
        with self._lock:
            return bool(self.queue) or self._queued.wait(timeout_s)

    def flush(self) -> None:
        """Send what is queued to the root, in batches, in order. The root away: it stays queued."""
        with self._flushing:
            while True:
                with self._lock:
                    batch = [self.queue[i] for i in range(min(len(self.queue), self.MAX_BATCH))]
                if not batch:
                    return
                try:
                    refused = self.root.reports(batch)
                except RootUnreachable:
                    with self._lock:
                        self.counters["root_unreachable"] += 1
                    return
                with self._lock:
                    for req, why in zip(batch, refused):
                        self.queue.popleft()
                        if why is not None:
                            # e.g. a root that lost the agent: its next report goes there and is
                            # told to register; until then nothing of it is answered here
                            self.tables.pop(req.name, None)
                            self.counters["refused_by_root"] += 1
                    self.counters["flushed"] += len(batch)

    # ---- periodic ----------------------------------------------------------------------
    def tick(self, wall_s: float) -> None:
        """Tell the root who was heard from; learn its versions. The root away: try again next tick."""
        with self._lock:
            names, self._heard = sorted(self._heard), set()
        try:
            plan_version, drain_version, epochs = self.root.heard(self.shard, names)
        except RootUnreachable:
            with self._lock:
                self.counters["root_unreachable"] += 1
                self._heard.update(names)
            return
        with self._lock:
            self.versions = (plan_version, drain_version)
        self.store.took(epochs)  # the endpoint's tick reads them next (refresh_revocations)

    def status(self) -> dict:
        """This shard, for its metrics."""
        with self._lock:
            out = {"shard": self.shard, "url": self.url, "agents": len(self.tables), "versions": self.versions,
                   "queue": len(self.queue), "max_queue": self.max_queue, **dict(self.counters)}
        return {**out, "part_paths": len(self.part), "part_rounds": self.part.rounds,
                "part_seconds": self.part.seconds}


class LocalRoot:
    """The root in this process (tests, a single-host sharded coordinator without Ray): its
    service's own calls (service.py). `server`: the root's endpoint; None: the root is away."""

    def __init__(self, server):
        self.server = server

    def _root(self):
        if self.server is None:
            raise RootUnreachable("the root is not running")
        return self.server.service

    def register(self, req: RegisterIn) -> dict:
        return self._root().register(req)

    def report(self, req: ReportIn) -> dict:
        return self._root().report(req)

    def reports(self, batch: list[ReportIn]) -> list[str | None]:
        return self._root().reports_batch(batch)

    def heard(self, shard: int, names: list[str]) -> tuple[int, int, dict[str, int]]:
        return self._root().heard(shard, names)

    def add_events(self, events: list[tuple]) -> None:
        self._root().add_events(events)

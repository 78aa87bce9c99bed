"""The coordinator as a service: what its HTTP endpoint (http.py) and its Ray actors (ray_actor.py)
both call, behind one lock, and the threads that keep it going.

    http.CoordinatorServer ──┐
                             ├─► CoordinatorService ──► Coordinator | ShardFront ──► Store
    ray_actor (a shard) ─────┘        (the lock; tick and flush threads)

- **The lock.** Every call into the `Coordinator` holds it, so the endpoint's workers, the loop
  (which runs a small request itself when the lock is free), the tick and the shards' calls are
  serialised. A shard's `ShardFront` is thread-safe itself and calls the root outside any lock.
- **The tick** (every COORDINATOR_TICK_S): the coordinator's liveness, retention and
  localization (a shard: its call to the root), revocations written to the store by another
  process, the tokens file when it changed, and the refusals gathered since the last tick. Each
  runs under its own guard: one that raises is counted (`tick_failures`) and logged, and the
  others still run, this tick and every later one.
- **The flush** (a shard only): reports it answered itself go to the root as they come.
- **The API** takes typed requests (control/bodies.py) that the caller has already checked, and
  returns the answer documents; refusals are `CoordinatorError`s.

The wall clock (`time.time()`) is read here and passed into the coordinator, as every call of it
takes its time as an argument.
"""
from __future__ import annotations

import os
import threading
import time
import traceback

from ..core.constants import COORDINATOR_TICK_S
from ..observe.log import Logger
from .auth import AuthError, Tokens
from .coordinator import Coordinator
from .refusals import Refusals
from ..control.errors import CoordinatorError
from ..control.bodies import DecommissionIn, DrainIn, EventsQuery, RegisterIn, ReportIn
from .shard import Router, ShardFront, ShardParts

SHARD_AWAY_S = 3.0  # a shard tells the root who is alive every tick (100 ms); silent this long, it is away


def shard_parts(c: Coordinator) -> ShardParts | None:
    """A sharded root's parts of localization in its shards (None: it localizes alone)."""
    parts = getattr(c.localizer, "parts", None)
    return parts if isinstance(parts, ShardParts) else None


class CoordinatorService:
    def __init__(self, coordinator: Coordinator | ShardFront, tokens: Tokens, refusals: Refusals, *,
                 tokens_path: str | None = None, router: Router | None = None, log: Logger | None = None):
        """`coordinator`: a Coordinator (the whole coordinator, or the root of a sharded one, whose
        agents `router` sends to their shards), or a ShardFront (a shard). `tokens`: the callers'
        credentials, re-read from `tokens_path` when it changes and narrowed by the store's
        revocations; `refusals`: the endpoint's refused requests, written into the history at
        each tick."""
        self.coordinator = coordinator
        self.shard = coordinator if isinstance(coordinator, ShardFront) else None
        self.router = router
        self.tokens = tokens
        self.tokens_path = tokens_path
        self._tokens_stamp = self._stamp()
        self.refusals = refusals
        self.log = log or Logger("coordinator")
        self.lock = threading.RLock()  # re-entered by a request the endpoint's loop runs itself
        self.shards_heard: dict[int, float] = {}  # a root's shards: when each last told it who is alive
        self.reports = 0  # path verdicts taken (changes and whole tables)
        self.tick_failures = 0  # guarded tick steps that raised (each logged)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.refresh_revocations()

    # ---- its threads -------------------------------------------------------------------
    def start(self) -> None:
        self._threads = [threading.Thread(target=self._tick_loop, name="coordinator-tick", daemon=True)]
        if self.shard is not None:
            self._threads.append(threading.Thread(target=self._flush_loop, name="shard-flush", daemon=True))
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def _guarded(self, step: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one subsystem's failure must not stop the others
            with self._count_lock:
                self.tick_failures += 1
            self.log("tick_failed", step=step, error=traceback.format_exc(limit=5))

    def tick(self, final_refusals: bool) -> None:
        """One tick, each step under its own guard (module doc)."""
        if self.shard is not None:
            self._guarded("shard", self.shard.tick, time.time())  # a call to the root: not under the lock
        with self.lock:
            if self.shard is None:
                self._guarded("coordinator", self.coordinator.tick, time.time())
            self._guarded("revocations", self.refresh_revocations)
            self._guarded("tokens", self.refresh_tokens)
            self._guarded("refusals", self._write_refusals, final_refusals)

    def _tick_loop(self) -> None:
        next_summary = time.monotonic() + self.refusals.window_s
        while not self._stop.wait(COORDINATOR_TICK_S):
            final = time.monotonic() >= next_summary
            self.tick(final)
            if final:
                next_summary = time.monotonic() + self.refusals.window_s

    def _flush_loop(self) -> None:
        """A shard: its queued reports to the root as they come (batched while a call is out);
        with the root away, again every tick."""
        while not self._stop.is_set():
            self._guarded("flush", self._flush_once)

    def _flush_once(self) -> None:
        if self.shard.wait_queued(COORDINATOR_TICK_S):
            self.shard.flush()
            if self.shard.queue:
                self._stop.wait(COORDINATOR_TICK_S)  # the root did not take them: not a busy loop

    # ---- credentials and refusals --------------------------------------------------------
    def refresh_revocations(self) -> None:
        """The lowest agent-token epoch per host, from the store (where `linkpass coordinator token
        HOST --revoke` writes it, from another process): at start, and at a tick after another
        process wrote to the store (reading the table every tick would cost ~2 ms at 1000 rows)."""
        with self.lock:
            if not self.coordinator.store.written_elsewhere():
                return
            epochs = self.coordinator.store.agent_epochs()
        self.tokens.set_min_epochs(epochs)

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self.tokens_path) if self.tokens_path else None
        except OSError:
            return None
        return None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh_tokens(self) -> None:
        """Take the tokens file again when it changed: a listed token created or revoked works or
        is refused from the next tick on, without a restart. A file that does not parse is logged
        and the tokens in use are kept."""
        stamp = self._stamp()
        if stamp is None or stamp == self._tokens_stamp:
            return
        self._tokens_stamp = stamp
        try:
            with open(self.tokens_path) as f:
                fresh = Tokens.parse(f.read(), self.tokens_path)
        except (OSError, AuthError) as exc:
            self.log("tokens_reload_refused", error=str(exc), note="the tokens in use are kept")
            return
        self.tokens = self.tokens.with_entries_of(fresh)  # one reference, swapped whole
        self.log("tokens_reloaded", path=self.tokens_path, listed=len(fresh))

    def flush_refusals(self) -> None:
        """Write the refusals gathered so far into the history now (tests; shutdown)."""
        with self.lock:
            self._write_refusals(final=True)

    def _write_refusals(self, final: bool) -> None:
        """Under the lock: the individual refusal events gathered since the last call; at the end
        of a window, one summary of the rest."""
        events = self.refusals.take(final, time.time())
        if events:
            self.coordinator.store.add_events(events)

    # ---- agents' registrations and reports (from the endpoint, or a shard's actor) ---------
    def _count_reports(self, n: int) -> None:
        with self._count_lock:
            self.reports += n

    def register(self, r: RegisterIn) -> dict:
        if self.shard is not None:  # thread-safe itself, and calls the root outside any lock
            out = self.shard.register(r, time.time())
        else:
            with self.lock:
                out = self.coordinator.register(r, time.time())
        self._count_reports(len(r.paths))
        return out

    def report(self, r: ReportIn) -> dict:
        if self.shard is not None:
            out = self.shard.report(r, time.time())
        else:
            with self.lock:
                out = self.coordinator.report(r, time.time())
        self._count_reports(len(r.changes) + len(r.paths or ()))
        return out

    def reports_batch(self, batch: list[ReportIn]) -> list[str | None]:
        """A shard's queued reports, in order, under one hold of the lock; per report None, or
        the refusal's message (the rest are applied all the same)."""
        out: list[str | None] = []
        with self.lock:
            wall_s = time.time()
            for r in batch:
                try:
                    self.coordinator.report(r, wall_s)
                    out.append(None)
                except CoordinatorError as exc:
                    out.append(str(exc))
        self._count_reports(sum(len(r.changes) for r in batch))
        return out

    def heard(self, shard: int, names: list[str]) -> tuple[int, int, dict[str, int]]:
        """A shard's agents that are alive; answers the plan and drain versions and the lowest
        accepted agent-token epochs (the shard's revocations)."""
        with self.lock:
            c = self.coordinator
            wall_s = time.time()
            self.shards_heard[shard] = wall_s
            c.heard_from(names, wall_s)
            return c.plan_version, c.drain_version, self.tokens.min_epochs()

    def add_events(self, events: list[tuple]) -> None:
        with self.lock:
            self.coordinator.store.add_events(events)

    # ---- what readers ask --------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            wall_s = time.time()
            doc = self.coordinator.status(wall_s)
            shards = self.shards_status(wall_s)
        if shards is not None:
            doc["shards"] = shards
            if doc["health"] == "ok" and any(x["away"] for x in shards):
                doc["health"] = "warning"  # its agents' reports are not arriving: they soon count as lost
        return doc

    def shards_status(self, wall_s: float) -> list[dict] | None:
        """A root's shards for `status`: address, hosts, how long since each was heard from, and
        where its part of localization runs (the shard, or the root standing in for it)."""
        if self.router is None:
            return None
        parts = shard_parts(self.coordinator)
        here = set(range(len(self.router.urls))) if parts is None else set(parts.standing_in)
        out = []
        for k, url in enumerate(self.router.urls):
            at = self.shards_heard.get(k)
            out.append({"shard": k, "url": url, "hosts": len(self.router.map.hosts_of(k)),
                        "heard_s": None if at is None else round(wall_s - at, 1),
                        "away": at is None or wall_s - at > SHARD_AWAY_S,
                        "localized_by": "root" if k in here else "shard"})
        return out

    def links(self, only_problems: bool) -> list[dict]:
        with self.lock:
            return self.coordinator.links(only_problems=only_problems)

    def path_rows(self, host: str | None, peer: str | None) -> list[dict]:
        with self.lock:
            return self.coordinator.path_rows(host, peer)

    def agent_rows(self) -> list[dict]:
        with self.lock:
            return self.coordinator.agent_rows(time.time())

    def plan_for(self, host: str) -> dict | None:
        with self.lock:
            return self.coordinator.plan_for(host, time.time())

    def events(self, q: EventsQuery) -> list[dict]:
        with self.lock:
            return self.coordinator.store.events(since=q.since, after_id=q.after_id, limit=q.limit,
                                                 kinds=q.kinds, link=q.link, host=q.host)

    # ---- what operators do (the caller's name is recorded with it) ------------------------
    def drain(self, d: DrainIn, by: str) -> dict:
        with self.lock:
            return self.coordinator.drain(d.link, d.reason, by, time.time(), dry_run=d.dry_run, force=d.force,
                                          for_s=d.for_s)

    def undrain(self, d: DrainIn, by: str) -> dict:
        with self.lock:
            return self.coordinator.undrain(d.link, by, time.time(), dry_run=d.dry_run)

    def decommission(self, d: DecommissionIn, by: str) -> dict:
        with self.lock:
            return self.coordinator.decommission(d.host, d.reason, by, time.time(), dry_run=d.dry_run)

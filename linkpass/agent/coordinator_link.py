"""The agent's side of the coordinator: register, report path verdicts, take drains and plans.

A thread of its own, so a slow or absent coordinator never delays a failover: the agent detects
and reroutes alone, and this thread only reads the path table and hands back what the
coordinator said (drained link addresses, the probe plan) for the main loop to apply.

    start / coordinator back   POST /v1/register  identity + the whole path table (with hops)
                                                  + the probe budget
    every report_ms            POST /v1/report    the paths whose state or reason changed
                                                  (+ the probe budget, when a reload changed it)
    every summary_s            POST /v1/report    the digest of its verdicts (core/report_digest.py);
                                                  the whole table instead when the coordinator asked
                                                  for it (`send_paths`), when paths were added,
                                                  removed or re-routed, or when the coordinator
                                                  does not take digests (heals lost reports)
    quiet for 1 s              POST /v1/report    a heartbeat (no changes)

(What goes in each report is decided by control/reports.py, from what was sent before.)

While the coordinator is unreachable the thread retries with backoff (0.5 s doubling to 5 s, each
wait drawn between half and all of it: `Backoff`) and logs once when it goes away and once when it
is back. A busy coordinator (503, 429) gets the same backoff, the agent's registration standing:
what it did not accept is sent with the next report. A coordinator that comes back without the fleet's state (404: not registered) is
registered with again after a random wait of up to `REREGISTER_SPREAD_S`, so thousands of agents
do not arrive in the same second. Every answer is checked whole first
(`control/answers.py`, `parse_answer`): a refused one is counted, logged once per distinct fault, and applied not
at all; the versions stay, so the coordinator sends its drains and plan again. HTTPS, verified
against coordinator.ca_file and showing this host's certificate when one is configured
(`tls_context`); plain HTTP only with insecure_http, logged as a warning at start.

The probe budget (`probe_budget`: budget_pps and idle_interval_ms of the agent's config) is what
the coordinator caps this agent's share of the fleet's probe plan by (docs/coordinator.md); a
coordinator that predates it ignores the field.

A 401 (this host's token revoked, say) makes the thread read coordinator.token_file again: a new
token put there is used at once, without a restart.

A sharded coordinator sends an agent to its shard (307 with the shard's URL): the thread
registers there at once, with the same token and TLS settings, and only to an address of the
same scheme (an https endpoint cannot send it to plain HTTP). coordinator.url stays where it
starts: when the shard does not answer for MOVED_GIVE_UP failures in a row, the thread goes back
to it, and the root sends it to the shard of the current map.

Plans come whole (`plan`) or, once the agent holds one, as the change from its version
(`plan_delta`: peers to add or refresh, names to drop), so a plan change costs the coordinator
what changed rather than the fleet. This thread applies a delta to the plan it holds and hands
the main loop a whole plan either way. The delta is part of the answer checked whole: its peers
and the plan it makes (`answers.apply_delta`) pass the same rules as a whole plan before drains
or plan are applied. A refused answer that carried a delta also asks for the whole plan next
(plan_version None), since the same delta would come again; a well-formed delta that does not
start from the version held is dropped the same way, and the rest of its answer applied.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Callable
from urllib.parse import urlparse

from ..control.tokens import TokenFileError, read_token
from ..control.client import Client, Moved, Refusal, Unreachable
from ..control.errors import NOT_REGISTERED, UNAUTHENTICATED
from ..control.reports import layout, mark, next_report
from ..control.tls import TlsError, build_client_context
from ..core.constants import REPORT_HEARTBEAT_S
from ..control.answers import AnswerError, AnswerRules, PlanAnswer, StaleDelta, apply_delta, parse_answer
from .config import AgentConfig, ConfigError, CoordinatorLinkConfig


def probe_budget(cfg: AgentConfig) -> dict:
    """The budget the coordinator plans this agent's probes by: its pps ceiling (0: none) and how
    often it probes an idle path (every path, with rates off), which is the rate a planned path costs."""
    return {"pps": cfg.budget_pps, "idle_interval_ms": cfg.idle_interval_ms if cfg.idle_rates else cfg.interval_ms}


def tls_context(cfg: CoordinatorLinkConfig):
    """The TLS context for cfg.url (None for plain HTTP); ConfigError naming the field if a file is bad."""
    if cfg.insecure_http:
        return None
    try:
        return build_client_context(cfg.ca_file, cfg.cert_file, cfg.key_file,
                                    names=("coordinator.ca_file", "coordinator.cert_file", "coordinator.key_file"))
    except TlsError as exc:
        raise ConfigError(str(exc)) from None



# a fleet's agents re-register over this many seconds after the coordinator lost its state (a
# registration carries the whole path table: ~2 000 of them in one second would queue up)
REREGISTER_SPREAD_S = 5.0


class Backoff:
    """Waits between retries: doubling from `first` to `cap`, each drawn uniformly between half of
    the current step and all of it, so agents that failed together retry apart."""

    def __init__(self, first: float = 0.5, cap: float = 5.0, rng: random.Random | None = None):
        self.first, self.cap = first, cap
        self.rng = rng or random.Random()
        self.step = first

    def next(self) -> float:
        wait = self.rng.uniform(self.step / 2, self.step)
        self.step = min(self.step * 2, self.cap)
        return wait

    def reset(self) -> None:
        self.step = self.first

    def spread(self, window: float) -> float:
        """A wait anywhere in [0, window): when many agents must do the same thing once."""
        return self.rng.uniform(0.0, window)


MOVED_GIVE_UP = 3  # failures in a row at a shard's address before going back to coordinator.url
MOVES_IN_A_ROW = 4  # redirects without an accepted call before waiting as for a refusal (a loop)


class CoordinatorLink:
    def __init__(self, cfg: CoordinatorLinkConfig, identity: Callable[[], dict], rows: Callable[[], list[dict]],
                 on_drains: Callable[[tuple], None], on_plan: Callable[[object], None], log, *, rules: AnswerRules,
                 rng: random.Random | None = None, budget: Callable[[], dict | None] | None = None):
        self.cfg = cfg
        self.backoff = Backoff(rng=rng)
        self.rules = rules  # what answers are checked against (the daemon replaces it on reload)
        self._rejection: str | None = None
        self.identity = identity  # name, agent_id, service, nics, api_port, version
        self.rows = rows  # the path table: id, peer, plane, sport, hops, peer_addr, state, reason
        self.on_drains = on_drains
        self.on_plan = on_plan
        self.budget = budget  # the probe budget now (`probe_budget` of the current config); None: not sent
        self.budget_sent: dict | None = None  # as the coordinator last accepted it
        self.log = log
        self.client = self._client(cfg.url, read_token(cfg.token_file))
        self.url = cfg.url  # where it reports now: coordinator.url, or the shard it was sent to
        self._moves = 0  # redirects since the last accepted call
        self._failures_here = 0  # failures in a row at self.url
        if cfg.insecure_http:
            log("coordinator_insecure_http", url=cfg.url,
                warning="plain HTTP (insecure_http): the agent's token and reports cross the network in cleartext")
        self.registered = False
        self.reachable = True
        self.busy = False  # answered 503/429 since the last accepted call
        self.drain_version: int | None = None
        self.plan_version: int | None = None
        self.plan_held: PlanAnswer | None = None  # the last plan handed on (a delta applies to it)
        self.sent: dict[int, tuple] = {}
        self.sent_layout: dict[int, tuple] = {}  # each path's peer, plane, port, hops as last sent whole
        self.digests = False  # the coordinator said it takes digests instead of periodic whole tables
        self.send_table = False  # ... and that its copy of our verdicts is off: the whole table next
        self.stats = {"reports": 0, "registrations": 0, "failures": 0, "refusals": 0, "answers_rejected": 0,
                      "plan_deltas_dropped": 0, "digests": 0, "tables": 0, "tables_asked": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    def _client(self, url: str, token: str | None) -> Client:
        return Client(url, token, timeout_s=2.0, tls=tls_context(self.cfg), insecure_http=self.cfg.insecure_http)

    def _go(self, url: str) -> None:
        self.client.close()
        self.client = self._client(url, self.client.token)
        self.url = url

    def _moved(self, exc: Moved) -> None:
        """Sent to another endpoint: register there, if it is one this agent may go to."""
        self.registered = False
        self._moves += 1
        target = exc.url or ""
        if urlparse(target).scheme != urlparse(self.cfg.url).scheme or not urlparse(target).hostname \
                or self._moves > MOVES_IN_A_ROW:
            self.log("coordinator_refused", status=exc.status, error=f"not followed: {exc} (to {target!r}: "
                     + ("too many redirects in a row" if self._moves > MOVES_IN_A_ROW else
                        "not an address of the same scheme as coordinator.url") + ")")
            self._moves = 0
            self._go(self.cfg.url)
            self._stop.wait(5.0)
            return
        self.log("coordinator_moved", url=target, was=self.url)
        self._go(target)

    def start(self) -> "CoordinatorLink":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        last_sent = last_summary = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if not self.registered:
                    self._register()
                    last_sent = last_summary = now
                else:
                    report = next_report(self.rows(), self.sent, self.sent_layout, send_table=self.send_table,
                                         digests=self.digests, summary_due=now - last_summary >= self.cfg.summary_s,
                                         heartbeat_due=now - last_sent >= REPORT_HEARTBEAT_S,
                                         budget=self._budget_now(), budget_sent=self.budget_sent)
                    if report is None:
                        self._stop.wait(self.cfg.report_ms / 1000)
                        continue
                    if report.summary:
                        last_summary = now
                    if report.whole:
                        self.send_table = False  # before the answer: it may ask again
                    self._answer(self.client.post("/v1/report", {**self._versions(), **report.body}))
                    for r in report.sent:
                        self.sent[r["id"]] = mark(r)
                    if report.whole:
                        self.sent_layout = report.layout
                    self.stats["digests"] += report.digest
                    self.stats["tables"] += report.whole
                    if report.budget is not None:
                        self.budget_sent = report.budget
                    self.stats["reports"] += 1
                    last_sent = now
                if not self.reachable or self.busy:
                    self.reachable, self.busy = True, False
                    self.log("coordinator_back", url=self.url)
                self._moves = self._failures_here = 0
                self.backoff.reset()
                self._stop.wait(self.cfg.report_ms / 1000)
            except Unreachable as exc:
                self.stats["failures"] += 1
                if self.reachable:
                    self.reachable = False
                    self.log("coordinator_unreachable", url=self.url, error=str(exc),
                             note="detection and failover go on locally; reports resume when it is back")
                self.registered = False  # it may come back without our state: register again
                self._failures_here += 1
                if self.url != self.cfg.url and self._failures_here >= MOVED_GIVE_UP:
                    self._failures_here = 0
                    self._go(self.cfg.url)  # the shard is gone or moved: ask coordinator.url again
                self._stop.wait(self.backoff.next())
            except Moved as exc:
                self.stats["refusals"] += 1
                self._moved(exc)
            except Refusal as exc:
                self.stats["refusals"] += 1
                if exc.status in (429, 503):
                    # busy: the registration stands and what was not accepted goes again after a
                    # backoff; registering again would send the whole table to a coordinator
                    # that already has more than it can take
                    if not self.busy:
                        self.busy = True
                        self.log("coordinator_busy", status=exc.status, error=str(exc),
                                 note="detection and failover go on locally; reports resume when it accepts them")
                    self._stop.wait(self.backoff.next())
                    continue
                self.registered = False
                if exc.kind == NOT_REGISTERED:
                    # a coordinator that lost its memory: every agent hears this at once; register
                    # again within the spread, not all in the same second
                    self._stop.wait(self.backoff.spread(REREGISTER_SPREAD_S))
                    continue
                if exc.kind == UNAUTHENTICATED and self._token_replaced():
                    continue  # a new token in token_file (its host's old one revoked): use it at once
                self.log("coordinator_refused", status=exc.status, error=str(exc))
                self._stop.wait(5.0)
            except Exception as exc:  # noqa: BLE001 - this thread must outlive any one bad answer
                self.stats["failures"] += 1
                self.log("coordinator_link_error", error=repr(exc))
                self._stop.wait(5.0)

    def _token_replaced(self) -> bool:
        """After a 401: read token_file again; True if it now holds another token (then used)."""
        try:
            token = read_token(self.cfg.token_file)
        except (OSError, TokenFileError):
            return False
        if token == self.client.token:
            return False
        self.client.token = token
        self.log("coordinator_token_reloaded", token_file=self.cfg.token_file)
        return True

    def _versions(self) -> dict:
        return {"name": self.identity()["name"], "drain_version": self.drain_version, "plan_version": self.plan_version,
                "plan_deltas": True, "digests": True}

    def _budget_now(self) -> dict | None:
        return None if self.budget is None else self.budget()

    def _register(self) -> None:
        rows = self.rows()
        budget = self._budget_now()
        answer = self.client.post("/v1/register", {**self.identity(), "paths": rows, "drain_version": None,
                                                   "plan_version": None, "plan_deltas": True, "digests": True,
                                                   **({} if budget is None else {"probe_budget": budget})})
        self.sent = {r["id"]: mark(r) for r in rows}
        self.sent_layout = {r["id"]: layout(r) for r in rows}
        self.send_table = False
        self.budget_sent = budget
        self.registered = True
        self.stats["registrations"] += 1
        self.log("coordinator_registered", url=self.url, paths=len(rows))
        self._answer(answer)

    def _answer(self, answer: object) -> None:
        try:
            got = parse_answer(answer, self.rules)
            plan = got.plan
            if got.plan_delta is not None:
                plan = apply_delta(self.plan_held, self.plan_version, got.plan_delta, self.rules)
        except StaleDelta:
            self.stats["plan_deltas_dropped"] += 1
            plan = None
            got = dataclasses.replace(got, plan_version=None)  # ask for the whole plan with the next report
        except AnswerError as exc:
            self.stats["answers_rejected"] += 1
            if isinstance(answer, dict) and "plan_delta" in answer:
                self.plan_version = None  # the same delta would come again: ask for the whole plan
            if str(exc) != self._rejection:  # the same fault comes back with every report: log it once
                self._rejection = str(exc)
                self.log("coordinator_answer_rejected", error=str(exc),
                         note="nothing of this answer is applied; drains and plan stay as they were")
            return
        self._rejection = None
        self.digests = got.digests
        if got.send_paths:
            self.send_table = True
            self.stats["tables_asked"] += 1
        if got.drains is not None:
            self.on_drains(got.drains)
        self.drain_version = got.drain_version
        if plan is not None:
            self.plan_held = plan
            self.on_plan(plan)
        self.plan_version = got.plan_version

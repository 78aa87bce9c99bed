"""The agent's side of the coordinator: register, report path verdicts, take drains and plans.

A thread of its own, so a slow or absent coordinator never delays a failover: the agent detects
and reroutes alone, and this thread only reads the path table and hands back what the
coordinator said (drained link addresses, the probe plan) for the main loop to apply.

    start / coordinator back   POST /v1/register  identity + the whole path table (with hops)
    every report_ms            POST /v1/report    the paths whose state or reason changed
    every summary_s            POST /v1/report    the whole table again (heals lost reports)
    quiet for 1 s              POST /v1/report    a heartbeat (no changes)

While the coordinator is unreachable the thread retries with backoff (0.5 s doubling to 5 s) and
logs once when it goes away and once when it is back.

Plans come whole (`plan`) or, once the agent holds one, as the change from its version
(`plan_delta`: peers to add or refresh, names to drop), so a plan change costs the coordinator
what changed rather than the fleet. This thread applies a delta to the plan it holds and hands
the main loop a whole plan either way. A delta that does not start from the version held, or
does not parse, is dropped and the whole plan asked for (plan_version None).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ..coordinator.auth import read_token
from ..coordinator.client import Client, Refusal, Unreachable
from ..core.constants import REPORT_HEARTBEAT_S
from .config import CoordinatorLinkConfig



class CoordinatorLink:
    def __init__(self, cfg: CoordinatorLinkConfig, identity: Callable[[], dict], rows: Callable[[], list[dict]],
                 on_drains: Callable[[list[dict]], None], on_plan: Callable[[dict], None], log):
        self.cfg = cfg
        self.identity = identity  # name, agent_id, service, nics, api_port, version
        self.rows = rows  # the path table: id, peer, plane, sport, hops, peer_addr, state, reason
        self.on_drains = on_drains
        self.on_plan = on_plan
        self.log = log
        self.client = Client(cfg.url, read_token(cfg.token_file), timeout_s=2.0)
        self.registered = False
        self.reachable = True
        self.drain_version: int | None = None
        self.plan_version: int | None = None
        self.plan_peers: dict[str, dict] | None = None  # the plan held: peer name -> its entry
        self.sent: dict[int, tuple] = {}
        self.stats = {"reports": 0, "registrations": 0, "failures": 0, "refusals": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    def start(self) -> "CoordinatorLink":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        backoff = 0.5
        last_sent = last_summary = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if not self.registered:
                    self._register()
                    last_sent = last_summary = now
                else:
                    body = self._versions()
                    rows = self.rows()
                    changes = [r for r in rows if self.sent.get(r["id"]) != _mark(r)]
                    if now - last_summary >= self.cfg.summary_s:
                        body["paths"] = rows
                        last_summary = now
                    elif changes:
                        body["changes"] = [{"id": r["id"], "state": r["state"], "reason": r["reason"]} for r in changes]
                    elif now - last_sent < REPORT_HEARTBEAT_S:
                        self._stop.wait(self.cfg.report_ms / 1000)
                        continue
                    self._answer(self.client.post("/v1/report", body))
                    for r in rows if "paths" in body else changes:
                        self.sent[r["id"]] = _mark(r)
                    self.stats["reports"] += 1
                    last_sent = now
                if not self.reachable:
                    self.reachable = True
                    self.log("coordinator_back", url=self.cfg.url)
                backoff = 0.5
                self._stop.wait(self.cfg.report_ms / 1000)
            except Unreachable as exc:
                self.stats["failures"] += 1
                if self.reachable:
                    self.reachable = False
                    self.log("coordinator_unreachable", url=self.cfg.url, error=str(exc),
                             note="detection and failover go on locally; reports resume when it is back")
                self.registered = False  # it may come back without our state: register again
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Refusal as exc:
                self.stats["refusals"] += 1
                self.registered = False
                if exc.status == 404 and "has not registered" in str(exc):
                    continue  # a coordinator that lost its memory: register again at once
                self.log("coordinator_refused", status=exc.status, error=str(exc))
                self._stop.wait(5.0)
            except Exception as exc:  # noqa: BLE001 - this thread must outlive any one bad answer
                self.stats["failures"] += 1
                self.log("coordinator_link_error", error=repr(exc))
                self._stop.wait(5.0)

    def _versions(self) -> dict:
        return {"name": self.identity()["name"], "drain_version": self.drain_version, "plan_version": self.plan_version,
                "plan_deltas": True}

    def _register(self) -> None:
        rows = self.rows()
        answer = self.client.post("/v1/register", {**self.identity(), "paths": rows, "drain_version": None,
                                                   "plan_version": None, "plan_deltas": True})
        self.sent = {r["id"]: _mark(r) for r in rows}
        self.registered = True
        self.stats["registrations"] += 1
        self.log("coordinator_registered", url=self.cfg.url, paths=len(rows))
        self._answer(answer)

    def _answer(self, answer: dict) -> None:
        if "drains" in answer:
            self.on_drains(answer["drains"])
        self.drain_version = answer.get("drain_version")
        plan = answer.get("plan")
        if plan is None and "plan_delta" in answer:
            plan = self._apply_delta(answer["plan_delta"])
            if plan is None:
                self.stats["plan_deltas_dropped"] = self.stats.get("plan_deltas_dropped", 0) + 1
                self.plan_version = None  # ask for the whole plan with the next report
                return
        if plan is not None:
            peers = plan.get("peers") if isinstance(plan, dict) else None
            if isinstance(peers, list):
                self.plan_peers = {p["name"]: p for p in peers if isinstance(p, dict) and isinstance(p.get("name"), str)}
            self.on_plan(plan)
        self.plan_version = answer.get("plan_version")

    def _apply_delta(self, delta) -> dict | None:
        """The whole plan after `delta`, or None if it cannot be applied to the plan held."""
        if (not isinstance(delta, dict) or self.plan_peers is None or delta.get("from") != self.plan_version
                or not isinstance(delta.get("peers"), list) or not isinstance(delta.get("remove"), list)):
            return None
        peers = dict(self.plan_peers)
        for name in delta["remove"]:
            if isinstance(name, str):
                peers.pop(name, None)
        for p in delta["peers"]:
            if not (isinstance(p, dict) and isinstance(p.get("name"), str)):
                return None
            peers[p["name"]] = p
        return {"version": delta.get("version"), "peers": list(peers.values())}


def _mark(row: dict) -> tuple:
    return row["state"], row["reason"]

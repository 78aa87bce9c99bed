"""Agents come back to a coordinator apart, not in lockstep: retries after an outage are jittered
(`Backoff`), and re-registrations after a coordinator that lost its state are spread over
REREGISTER_SPREAD_S, shown on the real CoordinatorLink against a stub endpoint that forgets."""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from linkpass.control.answers import AnswerRules
from linkpass.agent.config import CoordinatorLinkConfig
from linkpass.agent.coordinator_link import REREGISTER_SPREAD_S, Backoff, CoordinatorLink

from support.fleet import identity, table_of
from support.http_stub import send_json
from support.waiting import wait_until


def test_backoff_doubles_to_its_cap_and_each_wait_is_drawn_below_its_step():
    b = Backoff(0.5, 5.0, random.Random(1))
    waits = [b.next() for _ in range(8)]
    steps = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert all(s / 2 <= w <= s for w, s in zip(waits, steps)), list(zip(waits, steps))
    b.reset()
    assert b.next() <= 0.5


def test_a_fleet_that_failed_together_retries_apart():
    """2 000 agents lose the coordinator in the same instant: without jitter every retry would land
    in the same millisecond; with it, no 50 ms slot of the first retry holds more than ~1/4 of them,
    and re-registrations after a coordinator that forgot them arrive at ~400 a second, not 2 000."""
    agents = [Backoff(rng=random.Random(seed)) for seed in range(2000)]
    first = [b.next() for b in agents]
    slots = Counter(int(w / 0.05) for w in first)
    assert min(first) >= 0.25 and max(first) <= 0.5 and max(slots.values()) < 2000 / 4, slots
    again = [b.spread(REREGISTER_SPREAD_S) for b in agents]
    per_second = Counter(int(w) for w in again)
    assert len(per_second) == REREGISTER_SPREAD_S and max(per_second.values()) < 2000 / REREGISTER_SPREAD_S * 1.2


class _Forgetful(BaseHTTPRequestHandler):
    """A coordinator endpoint that takes one registration, then answers every report with 404
    'has not registered' (as a coordinator that lost its state does) until registered again."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with srv.lock:
            if self.path == "/v1/register":
                srv.registrations.append(time.monotonic())
                srv.forgot = False
                code, body = 200, {"drain_version": 0, "drains": [], "plan_version": None}
            elif srv.forgot:
                srv.refused_at.append(time.monotonic())
                code, body = 404, {"error": "agent h1 has not registered", "kind": "not_registered"}
            else:
                srv.reports += 1
                if srv.reports == 1:
                    srv.forgot = True  # the coordinator restarts empty
                code, body = 200, {}
        send_json(self, code, body)


def test_the_link_registers_again_after_a_spread_wait_when_the_coordinator_forgot_it(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Forgetful)
    srv.lock, srv.registrations, srv.refused_at, srv.reports, srv.forgot = threading.Lock(), [], [], 0, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    token = tmp_path / "h1.token"
    token.write_text("lpa1.h1.1.stub\n")

    class Fixed(random.Random):
        def uniform(self, a, b):  # the spread's draw: 0.8 of the window's first second
            return a + min(b - a, 0.8)

    cfg = CoordinatorLinkConfig(f"http://127.0.0.1:{srv.server_address[1]}", str(token), report_ms=20,
                                insecure_http=True)
    logged = []
    link = CoordinatorLink(cfg, lambda: identity(1), lambda: table_of(1), lambda d: None, lambda p: None,
                           lambda event, **f: logged.append(event), rules=AnswerRules("h1", 2, 1024), rng=Fixed())
    link.start()
    try:
        wait_until(lambda: len(srv.registrations) >= 2, 15, "the agent registering again", lambda: logged[-5:])
    finally:
        link.stop()
        srv.shutdown()
        srv.server_close()
    gap = srv.registrations[1] - srv.refused_at[0]
    assert 0.75 <= gap < 3.0, gap  # it waited its draw (0.8 s), not zero


class _Busy(BaseHTTPRequestHandler):
    """Registers h1, then answers its reports 503 (busy) until `srv.busy_for` reports were refused."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            if self.path == "/v1/register":
                srv.registrations.append(time.monotonic())
                code, out = 200, {"drain_version": 0, "drains": [], "plan_version": None}
            elif srv.refused < srv.busy_for:
                srv.refused += 1
                code, out = 503, {"error": "the coordinator is busy; retry"}
            else:
                srv.accepted.append(body)
                code, out = 200, {"drain_version": 0, "plan_version": None}
        send_json(self, code, out)


def test_a_busy_coordinator_gets_backoff_and_the_changes_later_not_a_new_registration(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    srv.lock, srv.registrations, srv.refused, srv.busy_for, srv.accepted = threading.Lock(), [], 0, 3, []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    token = tmp_path / "h1.token"
    token.write_text("lpa1.h1.1.stub\n")
    rows = table_of(1)
    cfg = CoordinatorLinkConfig(f"http://127.0.0.1:{srv.server_address[1]}", str(token), report_ms=20,
                                insecure_http=True)
    logged = []
    link = CoordinatorLink(cfg, lambda: identity(1), lambda: [dict(r) for r in rows], lambda d: None, lambda p: None,
                           lambda event, **f: logged.append(event), rules=AnswerRules("h1", 2, 1024))
    link.start()
    try:
        wait_until(lambda: link.registered, 10, "the agent registering")
        rows[0] = {**rows[0], "state": "down", "reason": "hard_failure"}  # a change while the coordinator is busy
        wait_until(lambda: any(b.get("changes") for b in srv.accepted), 20, "the change accepted", lambda: logged[-5:])
    finally:
        link.stop()
        srv.shutdown()
        srv.server_close()
    assert len(srv.registrations) == 1  # no second registration (no whole table) while it was busy
    got = next(b for b in srv.accepted if b.get("changes"))
    assert got["changes"] == [{"id": rows[0]["id"], "state": "down", "reason": "hard_failure"}]
    assert logged.count("coordinator_busy") == 1 and "coordinator_back" in logged
    assert "coordinator_refused" not in logged

"""The coordinator's endpoint: HTTP/JSON for agents, the CLI and dashboards.

    GET  /v1/healthz                      no token: liveness for probes and load balancers
    GET  /v1/whoami                       the caller's name, role and host (any valid token)
    GET  /v1/status | /v1/links[?problems=1] | /v1/paths[?host=&peer=] | /v1/agents
         /v1/events[?since=&after=&limit=&kind=&link=&host=] | /v1/plan?host=   role reader, agent or operator
    POST /v1/register | /v1/report                                      role agent, as its own host
    POST /v1/drain | /v1/undrain   {link, reason, dry_run, force, for_s} role operator
    POST /v1/decommission          {host, reason, dry_run}              role operator
    GET  /metrics                                                       Prometheus (no token)
    GET  /v1/openapi.json                                               this API as OpenAPI 3.1 (no token; openapi.py)

One asyncio loop owns every connection. Requests against the `Coordinator` are serialised by
one lock: a small one the loop runs itself when the lock is free, the rest a few worker threads
(`Limits.workers`) take, so the loop never waits for the lock. So a connection costs a
coroutine, not a thread, and slow or idle clients cannot starve anyone:

- the request head must arrive within `read_timeout_s` of its first byte, and the body within
  `read_timeout_s` more; a kept-alive connection idle for `idle_timeout_s` is closed;
- at `max_connections`, the connection that has waited longest for its next request is closed
  to make room (a flood of half-sent requests evicts itself, not the agents that are talking);
- with TLS (an ssl.SSLContext from tls.py; HTTPS is the default), each connection's handshake
  runs in its own coroutine within tls.HANDSHAKE_TIMEOUT_S; a failed one is counted (kind "tls");
- the token is checked from the head, before a byte of the body is read; then Content-Length
  against `max_body_bytes` (413); chunked bodies are refused (411: send Content-Length); JSON
  nested deeper than `json_max_depth` is refused (400) before it is parsed (a check linear in
  the body, whatever its bytes); a body is parsed and checked whole before the lock is taken;
- an agent token of an epoch its host no longer accepts (revoked; the store's agent_epochs, read
  at start and at the tick after another process wrote the store) gets 401 naming the host,
  counted as kind "revoked";
- with mutual TLS, an agent token must come over a connection whose client certificate names the
  token's host (CN or DNS SAN; read once per connection after the handshake), else 403 naming
  both; reader and operator tokens take any certificate the CA signed;
- at most `max_pending` requests hold a body in memory waiting for a worker; beyond, 503.

Refusals (401, 403, 413, ...) are counted per kind in `linkpass_coordinator_request_errors_total`.
A client address that keeps being refused is rate-limited (429, connection closed). Refusals
never each reach the store: unauthenticated ones become one summary event per
`refusal_summary_s` (how many, from which addresses); refused drains and decommissions by known
callers and attempts to report as another host are recorded individually up to a cap per window,
the rest in the summary (refusals.py). The coordinator itself, its lock and its tick are the
service's (service.py): this module frames, authenticates, limits and routes requests to it;
its Prometheus view is metrics.py.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import json
import re
import socket
import ssl
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from urllib.parse import parse_qs, urlparse

from ..observe.exposition import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest

from ..core.constants import COORDINATOR_PORT
from .auth import NEEDS, Caller, Revoked
from .metrics import CountsCollector, NamedCollector, RequestLatency, ShardCollector
from .openapi import spec
from .refusals import Buckets
from ..control.errors import (BAD_REQUEST, FORBIDDEN, NOT_FOUND, THROTTLED, UNAUTHENTICATED, UNAVAILABLE,
                              CoordinatorError)
from ..control.bodies import (DecommissionIn, DrainIn, RegisterIn, ReportIn, is_decimal, parse_decommission,
                                parse_drain, parse_events_query, parse_register, parse_report, query_host)
from .store import EVENT_KINDS
from .service import CoordinatorService
from .tls import HANDSHAKE_TIMEOUT_S, certificate_names, mutual, names_host

MAX_HEAD = 64 << 10  # request line and headers
INLINE_MAX_BYTES = 64 << 10  # bodies up to this are run by the loop itself when the coordinator is free
MAX_HEADERS = 100
SHARD_PATHS = ("/v1/healthz", "/metrics", "/v1/register", "/v1/report", "/v1/whoami")  # what a shard serves


@dataclass(frozen=True)
class Limits:
    """What one client may cost the endpoint (coordinator settings of the same names)."""

    max_body_bytes: int = 4 << 20  # a registration of ~15 000 paths with hops
    max_connections: int = 4096  # open connections (one kept-alive per agent)
    read_timeout_s: float = 10.0  # a request's head, then its body, must arrive within this
    idle_timeout_s: float = 60.0  # a kept-alive connection without a request this long is closed
    workers: int = 4  # threads running requests against the coordinator
    max_pending: int = 64  # requests holding a body while waiting for a worker; beyond: 503
    json_max_depth: int = 32  # the deepest legitimate body nests 4 levels
    events_limit_max: int = 10_000  # events in one answer (page with after=ID)
    refusal_rate_per_s: float = 5.0  # refused requests per client address, sustained ...
    refusal_burst: int = 50  # ... and in a burst; beyond: 429 and the connection closed
    refusal_summary_s: float = 60.0  # unauthenticated refusals reach the history once per this
    token_rate_per_s: float = 50.0  # requests per token, sustained (an agent sends a few a second at most) ...
    token_burst: int = 200  # ... and in a burst; beyond: 429, and the body is never read
    max_queue: int = 10_000  # a shard: reports answered and held for the root; beyond: 503


class CoordinatorServer:
    def __init__(self, service: CoordinatorService, host: str = "127.0.0.1", port: int = COORDINATOR_PORT,
                 limits: Limits | None = None, tls: ssl.SSLContext | None = None):
        """Serve `service` (service.py: the coordinator, or a shard's front, behind its lock) over
        HTTP; starts the service's threads and stops them on close()."""
        self.service = service
        self.shard = service.shard  # a shard serves SHARD_PATHS only
        self.limits = limits or Limits()
        self.log = service.log
        self.errors = dict.fromkeys(("bad_request", "unauthenticated", "forbidden", "too_large", "length_required",
                                     "rate_limited", "timeout", "evicted", "busy", "not_found", "internal",
                                     "tls", "revoked", "token_budget"), 0)
        self.requests = 0
        self.pending = 0  # requests past the max_pending gate (the loop's own count)
        self._count_lock = threading.Lock()
        self._refusals = service.refusals
        self._per_token = Buckets(self.limits.token_rate_per_s, self.limits.token_burst)  # by caller name
        self._stop = threading.Event()
        self.tls = tls  # an ssl.SSLContext (tls.build_server_context): HTTPS; None: plain HTTP
        self.scheme = "https" if tls is not None else "http"
        self.mutual = mutual(tls)  # agent tokens then travel only with their own host's certificate
        self._conns: collections.OrderedDict[_Conn, None] = collections.OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="coordinator-worker")
        self.latency = RequestLatency(p for _, p in _ROUTES)
        # /metrics without a token: counts, read without the lock; with one, also the series that
        # name hosts and links (their values are a reader's to see)
        counts = [ShardCollector(self) if self.shard is not None else CountsCollector(self),
                  ProcessCollector(registry=None), PlatformCollector(registry=None)]
        named = [NamedCollector(self)] if self.shard is None else []
        self.registry, self.named_registry = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
        for c in counts:
            self.registry.register(c)
        for c in counts + named:
            self.named_registry.register(c)
        sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self.address = sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve_forever, args=(sock, started), name="coordinator-http",
                                        daemon=True)
        self._thread.start()
        started.wait(10)
        service.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._stop.set()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.service.close()
        errors = {**self.errors, "tick": self.service.tick_failures}
        self.log("stopped", url=self.url, requests=self.requests, reports=self.service.reports,
                 errors={k: v for k, v in errors.items() if v})

    def count(self, kind: str, n: int = 1) -> None:
        with self._count_lock:
            self.errors[kind] += n

    # ---- the loop ----------------------------------------------------------------------
    def _serve_forever(self, sock: socket.socket, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._pending = asyncio.Semaphore(self.limits.max_pending)
        server = self._loop.run_until_complete(asyncio.start_server(self._connection, sock=sock, limit=MAX_HEAD))
        started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for conn in list(self._conns):
                conn.writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for t in tasks:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        if len(self._conns) >= self.limits.max_connections and not self._evict():
            self.count("busy")
            writer.write(_response(503, {"error": "the coordinator has too many open connections; retry",
                                         "kind": _KIND_OF_COUNTED["busy"]}, True))
            writer.close()
            return
        self._conns[conn] = None
        try:
            if self.tls is not None and not await self._handshake(conn, writer):
                return
            while not self._stop.is_set():
                if not await self._one_request(conn, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except ssl.SSLError:  # a TLS record broken after the handshake (or data after close_notify)
            self.count("tls")
        except Exception:  # noqa: BLE001 - a connection's failure stays with that connection
            self.count("internal")
            self.log("connection_failed", error=traceback.format_exc(limit=5))
        finally:
            self._conns.pop(conn, None)
            # close, not abort: an answer still in the transport's buffer is sent first (a large
            # one to a `Connection: close` client would be cut off); a peer that does not read it
            # is dropped after read_timeout_s
            writer.close()
            try:
                await _within(writer.wait_closed(), self.limits.read_timeout_s)
            except (asyncio.TimeoutError, OSError, asyncio.CancelledError):  # OSError: ssl.SSLError too
                writer.transport.abort()

    async def _handshake(self, conn: "_Conn", writer: asyncio.StreamWriter) -> bool:
        """TLS on the accepted connection, in its own coroutine: a client that connects and never
        finishes its handshake holds a coroutine for HANDSHAKE_TIMEOUT_S and, until then, is the first
        to be evicted (not busy), never the loop. A failed handshake (plain HTTP, a CA the client does
        not trust, no client certificate where one is required, too slow) is counted as kind "tls"
        and the connection closed with nothing said in cleartext."""
        try:
            await writer.start_tls(self.tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except (ssl.SSLError, OSError, EOFError, asyncio.TimeoutError):
            self.count("tls")
            writer.transport.abort()
            return False
        conn.writer = writer
        if self.mutual:  # verified by the handshake; read once, checked against each agent token
            conn.cert_names = certificate_names(writer.get_extra_info("peercert"))
        return True

    def _evict(self) -> bool:
        """Make room: close the connection that has waited longest for its next request."""
        for conn in self._conns:
            if not conn.busy:
                self._conns.pop(conn)
                conn.writer.transport.abort()
                self.count("evicted")
                return True
        return False

    async def _one_request(self, conn: "_Conn", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read, check and answer one request; False: close the connection."""
        lim = self.limits
        conn.busy = False
        self._conns.move_to_end(conn)
        try:
            first = await _within(reader.readexactly(1), lim.idle_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            return False
        try:
            head = first + await _within(reader.readuntil(b"\r\n\r\n"), lim.read_timeout_s)
        except asyncio.TimeoutError:
            self.count("timeout")
            return False
        except asyncio.LimitOverrunError:
            return await self._refuse(writer, None, 431, "bad_request", f"request head over {MAX_HEAD} bytes")
        conn.busy = True
        self.requests += 1
        remote = conn.remote
        try:
            req = _parse_head(head)
        except _HttpError as exc:
            return await self._refuse(writer, remote, exc.status, "bad_request", exc.message)
        route = _ROUTES.get((req.method, req.path))
        if route is None:
            known = any(p == req.path for _, p in _ROUTES)
            status, kind = (405, "bad_request") if known else (404, "not_found")
            return await self._refuse(writer, remote, status, kind, f"no such endpoint: {req.method} {req.path}",
                                      close=req.length != 0, limited=False)
        if self.shard is not None and req.path not in SHARD_PATHS:
            return await self._refuse(writer, remote, 421, "not_found",
                                      f"this is coordinator shard {self.shard.shard}: it takes agents' registrations "
                                      f"and reports; {req.path} is the root's (the address `linkpass` is given, "
                                      "as before sharding)", close=req.length != 0, limited=False)
        caller = None
        if route.action is not None and not (route.token_optional and "authorization" not in req.headers):
            caller = self.service.tokens.caller(req.headers.get("authorization"))
            if isinstance(caller, Revoked):
                self._refusals.revoked(caller.host, remote)
                return await self._refuse(writer, remote, 401, "revoked", caller.message(), close=req.length != 0,
                                          extra=[("WWW-Authenticate", 'Bearer error="invalid_token"')])
            if caller is None:
                self._refusals.unauthenticated(remote, req.path)
                return await self._refuse(writer, remote, 401, "unauthenticated",
                                          "no valid token: pass one with `Authorization: Bearer <token>` (the CLI "
                                          "reads $LINKPASS_TOKEN or --token-file)",
                                          close=req.length != 0, extra=[("WWW-Authenticate", "Bearer")])
            if self.mutual and caller.role == "agent" and not names_host(conn.cert_names, caller.host):
                shown = ", ".join(sorted(conn.cert_names)) or "no name"
                why = f"the token of agent {caller.host!r} came with the client certificate of {shown!r}"
                self._refusals.forbidden(caller, remote, req.path, why, record=True)
                return await self._refuse(writer, remote, 403, "forbidden",
                                          f"{why}: with mutual TLS an agent's token travels only with its own "
                                          f"host's certificate (CN or DNS SAN {caller.host!r}; `linkpass tls init "
                                          f"--hosts {caller.host}` issues one)", close=req.length != 0)
            if not self._per_token.take(caller.name):
                return await self._refuse(writer, remote, 429, "token_budget",
                                          f"{caller.name} sent more than {lim.token_rate_per_s:g} requests a second "
                                          f"(burst {lim.token_burst}): slow down", close=req.length != 0,
                                          limited=False, extra=[("Retry-After", "1")])
            if not caller.may(route.action):
                self._refusals.forbidden(caller, remote, req.path, f"role {caller.role} may not {route.action}",
                                         record=route.action in ("drain", "decommission"))
                return await self._refuse(writer, remote, 403, "forbidden",
                                          f"{caller.name} has role {caller.role!r}; this needs role "
                                          f"{NEEDS[route.action]!r}", close=req.length != 0,
                                          doc={"needs_role": NEEDS[route.action]})
        if route.lock_free and caller is None and not req.length:
            # liveness, the API's description, the anonymous counts: never a worker, never the lock
            status, doc = self._serve(route, req, None, caller, remote)
            writer.write(_response(status, doc, req.close))
            await _within(writer.drain(), lim.read_timeout_s)
            return not req.close
        if req.length is None:
            return await self._refuse(writer, remote, 411, "length_required",
                                      "chunked bodies are not accepted: send Content-Length", close=True)
        if req.length > lim.max_body_bytes:
            return await self._refuse(writer, remote, 413, "too_large",
                                      f"body of {req.length} bytes is over this coordinator's max_body_bytes "
                                      f"({lim.max_body_bytes})", close=True)
        started = time.perf_counter()
        try:
            await _within(self._pending.acquire(), lim.read_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse(writer, remote, 503, "busy", "the coordinator is busy; retry", close=True,
                                      limited=False)
        self.pending += 1
        try:
            if req.expect_continue and req.length:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                raw = await _within(reader.readexactly(req.length), lim.read_timeout_s) if req.length else b""
            except asyncio.TimeoutError:
                self.count("timeout")
                return False
            status = doc = None
            arg = _UNPARSED
            if len(raw) <= INLINE_MAX_BYTES:
                # a small body is parsed and checked here, before any lock is taken: every step is
                # linear in its size, which INLINE_MAX_BYTES keeps to a fraction of a millisecond
                arg, status, doc = self._prepare(route, req, raw)  # a refused body: doc set, answered below
                if doc is None and self.shard is not None:
                    # a shard's small report: the loop answers it itself when it brings nothing new;
                    # one for the root goes to a worker (a call to the root must not hold the loop)
                    status, doc = self._serve(route, req, arg, caller, remote, inline=True)
                elif doc is None and self.service.lock.acquire(blocking=False):
                    # the coordinator is free and the request small (a report, a status): the loop runs
                    # it itself; two thread hops per request cost more than the request (measured:
                    # ~40 % of ingest). Otherwise a worker waits for the lock, not the loop.
                    try:
                        status, doc = self._serve(route, req, arg, caller, remote)
                    finally:
                        self.service.lock.release()
            if doc is None:
                status, doc = await self._loop.run_in_executor(self._pool, self._serve, route, req, arg, caller,
                                                               remote, False, raw)
        finally:
            self.pending -= 1
            self._pending.release()
        self.latency.observe(req.path, time.perf_counter() - started)
        if status in (401, 403):
            self._refusals.note(remote)
        moved = [("Location", doc["url"])] if status == 307 and isinstance(doc, dict) and "url" in doc else ()
        writer.write(_response(status, doc, req.close, moved))
        try:
            await _within(writer.drain(), lim.read_timeout_s)
        except asyncio.TimeoutError:
            self.count("timeout")
            return False
        return not req.close

    async def _refuse(self, writer, remote, status: int, counted: str, message: str, close: bool = False,
                      limited: bool = True, extra=(), doc: dict | None = None) -> bool:
        """Answer a refusal before any handler runs: counted as `counted` (the request errors'
        metric), answered with its kind (control/errors.py) and any other fields in `doc`."""
        self.count(counted)
        if limited and remote is not None and not self._refusals.note(remote):
            counted = "rate_limited"
            self.count(counted)
            status, message, close, doc = 429, "too many refused requests from this address; slow down", True, None
        answer = {"error": message, "kind": _KIND_OF_COUNTED[counted], **(doc or {})}
        writer.write(_response(status, answer, close, extra))
        try:
            await _within(writer.drain(), self.limits.read_timeout_s)
        except asyncio.TimeoutError:
            return False
        return not close

    # ---- the workers -------------------------------------------------------------------
    def _prepare(self, route: "_Route", req: "_Head", raw: bytes):
        """The request's argument (its body parsed and checked whole: control/bodies.py), never under
        the lock; (argument, None, None), or (_UNPARSED, status, document) for a refused body."""
        try:
            if req.method != "POST":
                return None, None, None
            return route.parse(_json_body(raw, self.limits.json_max_depth)), None, None
        except _HttpError as exc:
            self.count(exc.kind)
            return _UNPARSED, exc.status, {"error": exc.message, "kind": exc.kind}
        except CoordinatorError as exc:
            self.count("bad_request")
            return _UNPARSED, exc.status, _refusal_doc(exc)

    def _serve(self, route: "_Route", req: "_Head", arg, caller: Caller | None, remote: str,
               inline: bool = False, raw: bytes = b""):
        """The request applied; (status, document). `arg`: what _prepare made of the body, or
        _UNPARSED (a worker then parses `raw` first, outside the lock, which the handlers take
        themselves). `inline` (a shard, on the event loop): only what the shard answers itself;
        (None, None) for the rest, which a worker then serves."""
        if arg is _UNPARSED:
            arg, status, doc = self._prepare(route, req, raw)
            if doc is not None:
                return status, doc
        try:
            if inline:
                if route.fn is not CoordinatorServer._post_report:
                    return None, None
                self._as_itself(caller, arg.name, remote, req.path)
                answer = self.shard.local_answer(arg)
                return (None, None) if answer is None else (200, answer)
            return route.fn(self, req, arg, caller, remote)
        except _HttpError as exc:
            self.count(exc.kind)
            return exc.status, {"error": exc.message, "kind": exc.kind}
        except CoordinatorError as exc:
            if exc.status == 400:
                self.count("bad_request")
            return exc.status, _refusal_doc(exc)
        except Exception:  # noqa: BLE001 - one bad request must not take the endpoint down
            self.count("internal")
            self.log("request_failed", path=req.path, error=traceback.format_exc(limit=5))
            return 500, {"error": "internal error in the coordinator (logged); retry, and report it if it persists"}

    def _as_itself(self, caller: Caller, name: str, remote: str, path: str) -> None:
        if caller.host != name:
            why = f"the token of agent {caller.host!r} cannot speak for {name!r}"
            self._refusals.forbidden(caller, remote, path, why, record=True)
            raise _HttpError(403, f"{why}: an agent registers and reports as its own host only (its token names "
                                  "it; `linkpass coordinator token HOST` makes one per host)", FORBIDDEN)

    # ---- the handlers: the service's API (service.py), for an authenticated caller ---------
    def _get_status(self, req, body, caller, remote):
        return 200, self.service.status()

    def _get_links(self, req, body, caller, remote):
        return 200, self.service.links(only_problems=req.query.get("problems") == "1")

    def _get_paths(self, req, body, caller, remote):
        return 200, self.service.path_rows(query_host(req.query, "host"), query_host(req.query, "peer"))

    def _get_agents(self, req, body, caller, remote):
        return 200, self.service.agent_rows()

    def _get_plan(self, req, body, caller, remote):
        host = query_host(req.query, "host", required=True)
        plan = self.service.plan_for(host)
        if plan is None:
            raise _HttpError(404, f"no agent named {host!r} is in the current plan "
                                  "(not registered, or joined less than a second ago)", NOT_FOUND)
        return 200, plan

    def _get_events(self, req, body, caller, remote):
        return 200, self.service.events(parse_events_query(req.query, EVENT_KINDS, self.limits.events_limit_max))

    def _get_whoami(self, req, body, caller, remote):
        return 200, {"name": caller.name, "role": caller.role, "host": caller.host}

    def _get_metrics(self, req, body, caller, remote):
        return 200, generate_latest(self.registry if caller is None else self.named_registry)

    def _get_healthz(self, req, body, caller, remote):
        return 200, {"ok": True}

    def _get_openapi(self, req, body, caller, remote):
        return 200, openapi_doc()

    def _post_register(self, req, r: RegisterIn, caller, remote):
        self._as_itself(caller, r.name, remote, req.path)
        if self.service.router is not None:  # the root of a sharded coordinator: agents go to their shards
            raise self.service.router.moved(r.name, self.url)
        return 200, self.service.register(r)

    def _post_report(self, req, r: ReportIn, caller, remote):
        self._as_itself(caller, r.name, remote, req.path)
        if self.service.router is not None:
            raise self.service.router.moved(r.name, self.url)
        return 200, self.service.report(r)

    def _post_drain(self, req, d: DrainIn, caller, remote):
        return 200, self.service.drain(d, caller.name)

    def _post_undrain(self, req, d: DrainIn, caller, remote):
        return 200, self.service.undrain(d, caller.name)

    def _post_decommission(self, req, d: DecommissionIn, caller, remote):
        return 200, self.service.decommission(d, caller.name)


@dataclass(frozen=True)
class _Route:
    """One endpoint: who may call it, its handler, and what openapi.py publishes of it."""
    action: str | None  # what auth.py calls it; None: no token needed
    fn: object
    summary: str = ""
    query: tuple[tuple[str, str, bool], ...] = ()  # (name, JSON type, required) the handler reads
    body: type | None = None  # the request dataclass its parser (control/bodies.py) makes
    parse: object = None  # that parser: the body's JSON document -> the handler's argument
    token_optional: bool = False  # without a token it answers what needs none (the action's role: more)
    lock_free: bool = False  # answered without a token by the loop itself: takes no lock, no worker


_HOST_Q = ("host", "string", False)
_ROUTES = {
    ("GET", "/v1/healthz"): _Route(None, CoordinatorServer._get_healthz, "liveness, for probes and load balancers",
                                   lock_free=True),
    ("GET", "/metrics"): _Route("read", CoordinatorServer._get_metrics,
                                "Prometheus exposition: counts without a token; with a reader's, also the series "
                                "that name hosts and links", token_optional=True, lock_free=True),
    ("GET", "/v1/openapi.json"): _Route(None, CoordinatorServer._get_openapi, "this API, as OpenAPI 3.1",
                                        lock_free=True),
    ("GET", "/v1/whoami"): _Route("read", CoordinatorServer._get_whoami, "the caller's name, role and host"),
    ("GET", "/v1/status"): _Route("read", CoordinatorServer._get_status,
                                  "fleet health: agents, paths by state, localized faults, drains"),
    ("GET", "/v1/links"): _Route("read", CoordinatorServer._get_links,
                                 "per fabric link: health, faults with direction, drain",
                                 query=(("problems", "string", False),)),
    ("GET", "/v1/paths"): _Route("read", CoordinatorServer._get_paths, "reported paths, by reporter and peer",
                                 query=(_HOST_Q, ("peer", "string", False))),
    ("GET", "/v1/agents"): _Route("read", CoordinatorServer._get_agents, "agents: up or lost, last report, paths"),
    ("GET", "/v1/plan"): _Route("read", CoordinatorServer._get_plan, "the probe plan of one host",
                                query=(("host", "string", True),)),
    ("GET", "/v1/events"): _Route("read", CoordinatorServer._get_events, "the history, oldest first",
                                  query=(("since", "number", False), ("after", "integer", False),
                                         ("limit", "integer", False), ("kind", "string", False),
                                         ("link", "string", False), _HOST_Q)),
    ("POST", "/v1/register"): _Route("report", CoordinatorServer._post_register,
                                     "an agent's identity and whole path table, as its own host", body=RegisterIn,
                                     parse=parse_register),
    ("POST", "/v1/report"): _Route("report", CoordinatorServer._post_report,
                                   "an agent's changed paths (or whole table), as its own host", body=ReportIn,
                                   parse=parse_report),
    ("POST", "/v1/drain"): _Route("drain", CoordinatorServer._post_drain,
                                  "steer every agent off a link (guarded; recorded with the caller's name)",
                                  body=DrainIn, parse=parse_drain),
    ("POST", "/v1/undrain"): _Route("drain", CoordinatorServer._post_undrain, "let agents use a drained link again",
                                    body=DrainIn, parse=lambda doc: parse_drain(doc, undrain=True)),
    ("POST", "/v1/decommission"): _Route("decommission", CoordinatorServer._post_decommission,
                                         "forget an agent and its paths", body=DecommissionIn,
                                         parse=parse_decommission),
}


class _Conn:
    __slots__ = ("writer", "busy", "remote", "cert_names")

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.busy = False
        self.cert_names: frozenset[str] = frozenset()  # with mutual TLS: the client certificate's CNs and DNS SANs
        peer = writer.get_extra_info("peername")
        self.remote = str(peer[0]) if peer else "?"


@dataclass
class _Head:
    method: str
    path: str
    query: dict
    headers: dict
    length: int | None  # None: chunked
    close: bool
    expect_continue: bool


async def _within(awaitable, seconds: float):
    """`awaitable`, or asyncio.TimeoutError after `seconds` (asyncio.timeout: no task per call,
    which wait_for costs in every request)."""
    async with asyncio.timeout(seconds):
        return await awaitable


class _HttpError(Exception):
    """A refusal of the endpoint's own (the request's form, who sent it), with its kind
    (control/errors.py), which is also what it is counted as."""

    def __init__(self, status: int, message: str, kind: str = BAD_REQUEST):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


# the kind a refusal answered before any handler runs is given (control/errors.py), by what the
# request errors' metric counts it as (finer: a revoked token is one way to be unauthenticated)
_KIND_OF_COUNTED = {"bad_request": BAD_REQUEST, "length_required": BAD_REQUEST, "too_large": BAD_REQUEST,
                    "not_found": NOT_FOUND, "unauthenticated": UNAUTHENTICATED, "revoked": UNAUTHENTICATED,
                    "forbidden": FORBIDDEN, "token_budget": THROTTLED, "rate_limited": THROTTLED,
                    "busy": UNAVAILABLE}


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _parse_head(head: bytes) -> _Head:
    """The request line and headers (bounded by the reader); refusals as _HttpError."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _HttpError(400, "malformed request line; expected METHOD /path HTTP/1.1")
    if len(lines) - 1 > MAX_HEADERS:
        raise _HttpError(431, f"more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise _HttpError(400, f"malformed header line {line[:60]!r}")
        name, value = name.lower(), value.strip()
        if name in headers and name in ("content-length", "transfer-encoding", "authorization", "host"):
            raise _HttpError(400, f"header {name} given twice")
        headers[name] = value
    length: int | None = 0
    if "transfer-encoding" in headers:
        length = None
    elif "content-length" in headers:
        v = headers["content-length"]
        if not is_decimal(v) or len(v) > 18:
            raise _HttpError(400, f"Content-Length: expected a byte count, got {v[:30]!r}")
        length = int(v)
    url = urlparse(parts[1])
    try:
        query = {k: v[-1] for k, v in parse_qs(url.query, strict_parsing=False, max_num_fields=32).items()}
    except ValueError:
        raise _HttpError(400, "query: more than 32 fields") from None
    conn = headers.get("connection", "").lower()
    close = conn == "close" or (parts[2] == "HTTP/1.0" and conn != "keep-alive")
    return _Head(parts[0], url.path, query, headers, length, close,
                 headers.get("expect", "").lower() == "100-continue")


_ESCAPE = re.compile(rb"\\.", re.S)  # a backslash and the byte it escapes
_STRING = re.compile(rb'"[^"]*"')  # a string, once its escapes are gone
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = [0] * 256  # how a byte changes the nesting depth
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def json_depth_ok(raw: bytes, max_depth: int) -> bool:
    """Whether the JSON text nests at most `max_depth` containers, checked without parsing it
    (the parser recurses) in time linear in its length, whatever the bytes: escapes go first
    (left to right, so a backslash pairs as the parser pairs it), then every byte but brackets
    and quotes, then strings, with any brackets in them, as quote pairs; the deepest point is
    the running sum of what remains. Text that is not JSON may pass: the parser refuses it."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return True
    s = _STRING.sub(b"", _ESCAPE.sub(b"", raw).translate(None, _NOT_STRUCTURE))
    return b'"' not in s and max(accumulate(map(_STEP.__getitem__, s)), default=0) <= max_depth


_UNPARSED = object()  # a request whose body has not been parsed yet


def _refusal_doc(exc: CoordinatorError) -> dict:
    """A refusal's answer: its message for a person, its kind for a program (control/errors.py)."""
    return {"error": str(exc), "kind": exc.kind, **getattr(exc, "doc", {})}


@functools.cache
def openapi_doc() -> dict:
    """The API's description (openapi.py), from this endpoint's route table: made once (the routes
    are fixed), never under the lock."""
    return spec(_ROUTES)


def _json_body(raw: bytes, max_depth: int) -> dict:
    if not json_depth_ok(raw, max_depth):
        raise _HttpError(400, f"body: JSON nested deeper than {max_depth} levels (or its brackets do not pair)")
    try:
        doc = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:
        raise _HttpError(400, f"body is not JSON ({str(exc)[:120]})") from None
    if not isinstance(doc, dict):
        raise _HttpError(400, "body must be a JSON object")
    return doc


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 411: "Length Required", 413: "Content Too Large",
            429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _response(status: int, doc, close: bool, extra=()) -> bytes:
    if isinstance(doc, bytes):
        payload, ctype = doc, "text/plain; version=0.0.4"
    else:
        payload, ctype = json.dumps(doc, default=str).encode(), "application/json"
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"Content-Type: {ctype}",
            f"Content-Length: {len(payload)}"]
    if close:
        head.append("Connection: close")
    if status == 429:
        head.append("Retry-After: 10")
    head += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload



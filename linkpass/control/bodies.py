"""What a caller may send the coordinator, checked whole before any of it is applied.

Every body and query is parsed into a frozen request here: types, ranges, addresses, names and
sizes. A refusal names the field (`paths[3].hops[1]`), says what is allowed, and changes nothing,
because the coordinator applies a request only once all of it has parsed. Unknown fields are
ignored (a newer agent may send more). Pure: no I/O.

Refusals are `CoordinatorError`s (errors.py).
"""
from __future__ import annotations

import functools
import ipaddress
import math
import re
from dataclasses import dataclass

from ..core.report_digest import DIGEST_CHARS
from ..core.states import STATE_NAMES
from .errors import CoordinatorError

HOST_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a host's name, as agents report it and tokens name it
MAX_PATHS = 65_536  # paths (or changes) in one request: far above any agent's table
MAX_HOPS = 32  # a path's routers: a leaf-spine fabric has 1..3, a 3-tier one 5
MAX_PLANES = 64
MAX_TEXT = 256  # reasons, versions: short words
MAX_DRAIN_REASON = 1024
MAX_ID = 2**31 - 1  # path ids
MAX_AGENT_ID = 2**32 - 1  # as the agent's config allows
MAX_VERSION = 2**62  # drain/plan versions are counters
MAX_EVENT_ID = 2**62
MIN_DRAIN_FOR_S, MAX_DRAIN_FOR_S = 60.0, 30 * 86400.0  # `drain --for`: a minute to a month
MAX_BUDGET_PPS = 10_000_000  # probe_budget.pps, as the agent's config allows (probe.budget_pps)
MIN_IDLE_MS, MAX_IDLE_MS = 0.1, 60_000  # probe_budget.idle_interval_ms (probe.idle_interval_ms)


@dataclass(frozen=True)
class PathIn:
    id: int
    peer: str
    plane: int
    sport: int
    hops: tuple[str | None, ...]
    peer_addr: str
    state: str
    reason: str | None


@dataclass(frozen=True)
class ChangeIn:
    id: int
    state: str
    reason: str | None


@dataclass(frozen=True)
class ProbeBudget:
    """What an agent may spend on probes: the plan gives it no more paths than half of this affords."""
    pps: float  # probes per second it never exceeds; 0: no ceiling
    idle_interval_ms: float  # how often it probes a planned path that carries no traffic


@dataclass(frozen=True)
class RegisterIn:
    name: str
    agent_id: int
    service: str
    nics: dict[int, str]
    version: str
    api_port: int | None
    paths: tuple[PathIn, ...]
    drain_version: int | None
    plan_version: int | None
    plan_deltas: bool = False  # the agent applies plan deltas (else it gets whole plans)
    probe_budget: ProbeBudget | None = None  # None: an agent that reports none, uncapped
    digests: bool = False  # the agent sends digests instead of periodic whole tables, when answered so


@dataclass(frozen=True)
class ReportIn:
    name: str
    paths: tuple[PathIn, ...] | None  # None: no summary in this report
    changes: tuple[ChangeIn, ...]
    drain_version: int | None
    plan_version: int | None
    plan_deltas: bool = False
    probe_budget: ProbeBudget | None = None  # sent when it changed since the registration
    digests: bool = False  # the agent sends digests instead of periodic whole tables, when answered so
    digest: str | None = None  # core/report_digest.py of its verdicts after this report's changes


@dataclass(frozen=True)
class DrainIn:
    link: str
    reason: str
    dry_run: bool
    force: bool
    for_s: float | None = None  # a drain that ends by itself after this long (`drain --for`)


@dataclass(frozen=True)
class DecommissionIn:
    host: str
    reason: str
    dry_run: bool


# the fields each parser below refuses a request without (the rest have defaults); openapi.py
# publishes them as required, and tests/unit/test_openapi.py checks each parser against this
REQUIRED = {RegisterIn: ("name", "agent_id", "service", "nics", "paths"), ReportIn: ("name",),
            DrainIn: ("link",), DecommissionIn: ("host", "reason"), PathIn: ("id", "peer", "plane", "state"),
            ChangeIn: ("id", "state"), ProbeBudget: ("pps", "idle_interval_ms")}


@dataclass(frozen=True)
class EventsQuery:
    since: float
    after_id: int
    limit: int
    kinds: tuple[str, ...]
    link: str | None = None  # events about this link only
    host: str | None = None  # events by or about this host only


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²' and other Unicode digits int() refuses."""
    return text.isascii() and text.isdigit()


# ---- bodies ------------------------------------------------------------------------------
def parse_register(body) -> RegisterIn:
    _object(body, "body")
    nics_raw = _get(body, "nics", dict, "")
    if len(nics_raw) > MAX_PLANES:
        raise CoordinatorError(f"nics: at most {MAX_PLANES} planes, got {len(nics_raw)}")
    nics = {}
    for k, v in nics_raw.items():
        if not (isinstance(k, str) and is_decimal(k) and int(k) < MAX_PLANES):
            raise CoordinatorError(f"nics: expected plane number (0..{MAX_PLANES - 1}) -> address, got key {k!r}")
        nics[int(k)] = _address(v, f"nics.{k}")
    api_port = body.get("api_port")
    if api_port is not None:
        api_port = _int(api_port, "api_port", 1, 65535)
    return RegisterIn(name=_host(_get(body, "name", str, ""), "name"),
                      agent_id=_int(_get(body, "agent_id", int, ""), "agent_id", 1, MAX_AGENT_ID),
                      service=_address(_get(body, "service", str, ""), "service"), nics=nics,
                      version=_text(body.get("version", ""), "version", MAX_TEXT), api_port=api_port,
                      paths=_paths(_get(body, "paths", list, "")),
                      drain_version=_version(body, "drain_version"), plan_version=_version(body, "plan_version"),
                      plan_deltas=_bool(body, "plan_deltas"), probe_budget=_probe_budget(body),
                      digests=_bool(body, "digests"))


def parse_report(body) -> ReportIn:
    _object(body, "body")
    paths = _paths(_get(body, "paths", list, "")) if "paths" in body else None
    raw = _get(body, "changes", list, "", default=[])
    if len(raw) > MAX_PATHS:
        raise CoordinatorError(f"changes: at most {MAX_PATHS} in one report, got {len(raw)}")
    changes = []
    for i, c in enumerate(raw):
        if type(c) is dict:  # the common case inline, as for paths
            cid, state, reason = c.get("id"), c.get("state"), c.get("reason")
            if (type(cid) is int and 0 <= cid <= MAX_ID and type(state) is str and state in _STATES
                    and (reason is None or (type(reason) is str and len(reason) <= MAX_TEXT and reason.isprintable()))):
                changes.append(ChangeIn(cid, state, reason))
                continue
        at = f"changes[{i}]."
        _object(c, at[:-1])
        changes.append(ChangeIn(_int(_get(c, "id", int, at), f"{at}id", 0, MAX_ID), _state(c, at), _reason(c, at)))
    digest = body.get("digest")
    if digest is not None and not (type(digest) is str and len(digest) == DIGEST_CHARS
                                   and all(ch in "0123456789abcdef" for ch in digest)):
        raise CoordinatorError(f"digest: expected {DIGEST_CHARS} lowercase hex characters (the digest of the "
                               "agent's verdicts), got " + (repr(digest[:80]) if isinstance(digest, str) else type(digest).__name__))
    return ReportIn(_host(_get(body, "name", str, ""), "name"), paths, tuple(changes),
                    _version(body, "drain_version"), _version(body, "plan_version"), _bool(body, "plan_deltas"),
                    _probe_budget(body), _bool(body, "digests"), digest)


def parse_drain(body, undrain: bool = False) -> DrainIn:
    _object(body, "body")
    link = body.get("link")
    if not isinstance(link, str) or not link or len(link) > MAX_TEXT:
        raise CoordinatorError("link: required, a link name such as p0l0-p0s1 (`linkpass links` lists them)")
    reason = "" if undrain else _text(body.get("reason", ""), "reason", MAX_DRAIN_REASON)
    for_s = None
    if not undrain and body.get("for_s") is not None:
        v = body["for_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not MIN_DRAIN_FOR_S <= v <= MAX_DRAIN_FOR_S:
            raise CoordinatorError(f"for_s: a timed drain lasts {MIN_DRAIN_FOR_S:g} s to {MAX_DRAIN_FOR_S:g} s "
                                   f"(30 days), got {v!r}")
        for_s = float(v)
    return DrainIn(link, reason, _bool(body, "dry_run"), False if undrain else _bool(body, "force"), for_s)


def parse_decommission(body) -> DecommissionIn:
    _object(body, "body")
    host = body.get("host")
    if not isinstance(host, str):
        raise CoordinatorError("host: required, the name of the agent to remove (`linkpass status -o wide` lists them)")
    reason = _text(body.get("reason", ""), "reason", MAX_DRAIN_REASON)
    if not reason.strip():
        raise CoordinatorError("reason: a decommission needs --reason (it goes into the history)")
    return DecommissionIn(_host(host, "host"), reason, _bool(body, "dry_run"))


# ---- queries -----------------------------------------------------------------------------
def parse_events_query(q: dict, kinds_known: tuple[str, ...], limit_max: int) -> EventsQuery:
    since = _query_number(q, "since", 0.0)
    after = q.get("after", "0")
    if not is_decimal(after) or int(after) > MAX_EVENT_ID:
        raise CoordinatorError(f"after: expected an event id 0..{MAX_EVENT_ID}, got {after!r}")
    limit = q.get("limit", str(min(1000, limit_max)))
    if not is_decimal(limit) or not 1 <= int(limit) <= limit_max:
        raise CoordinatorError(f"limit: expected 1..{limit_max} events, got {limit!r} (page with after=ID)")
    kinds = tuple(k for k in q.get("kind", "").split(",") if k)
    unknown = [k for k in kinds if k not in kinds_known]
    if unknown:
        raise CoordinatorError(f"kind: {', '.join(map(repr, unknown))} is not an event kind; "
                               f"one of {', '.join(kinds_known)}")
    link = q.get("link") or None
    if link is not None and len(link) > MAX_TEXT:
        raise CoordinatorError(f"link: at most {MAX_TEXT} characters, a link name such as p0l0-p0s1")
    return EventsQuery(since, int(after), int(limit), kinds, link, query_host(q, "host"))


def query_host(q: dict, name: str, required: bool = False) -> str | None:
    v = q.get(name)
    if v is None:
        if required:
            raise CoordinatorError(f"{name}: required, a host name such as h3")
        return None
    return _host(v, name)


def _query_number(q: dict, name: str, default: float) -> float:
    if name not in q:
        return default
    try:
        v = float(q[name])
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise CoordinatorError(f"{name}: expected a finite number, got {q[name]!r}")
    return v


# ---- fields ------------------------------------------------------------------------------
_MISSING = object()


def _object(v, where: str) -> None:
    if not isinstance(v, dict):
        raise CoordinatorError(f"{where}: expected a JSON object, got {_kind(v)}")


def _get(body: dict, name: str, kind: type, where: str, default=_MISSING):
    if name not in body:
        if default is not _MISSING:
            return default
        raise CoordinatorError(f"{where}{name}: required field is missing")
    v = body[name]
    if (kind is int and isinstance(v, bool)) or not isinstance(v, kind):
        raise CoordinatorError(f"{where}{name}: expected {_KIND_NAMES.get(kind, kind.__name__)}, got {_kind(v)}")
    return v


_KIND_NAMES = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(v, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        shown = repr(v) if isinstance(v, (int, float)) and len(repr(v)) < 30 else _kind(v)
        raise CoordinatorError(f"{where}: expected an integer {lo}..{hi}, got {shown}")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise CoordinatorError(f"{name}: expected true or false, got {_kind(v)}")
    return v


def _text(v, where: str, most: int) -> str:
    if not isinstance(v, str) or len(v) > most:
        raise CoordinatorError(f"{where}: expected a string of at most {most} characters, got "
                               f"{_kind(v) if not isinstance(v, str) else f'{len(v)} characters'}")
    if not v.isprintable():  # it reaches operators' terminals: no escapes, control or bidi characters
        bad = next(c for c in v if not c.isprintable())
        raise CoordinatorError(f"{where}: printable characters only; got {bad!r} at position {v.index(bad)}")
    return v


def _host(v, where: str) -> str:
    if not isinstance(v, str) or not HOST_NAME_RE.fullmatch(v):
        shown = repr(v[:70]) if isinstance(v, str) else _kind(v)
        raise CoordinatorError(f"{where}: expected a host name (letters, digits, '.', '_', '-'; 1..64), got {shown}")
    return v


@functools.lru_cache(maxsize=65536)
def _canonical_address(v: str) -> str | None:
    """The address in its canonical form, or None. Cached: a fleet's hops are a few thousand router
    addresses, repeated in every registration, and parsing one costs microseconds."""
    try:
        return str(ipaddress.ip_address(v))
    except ValueError:
        return None


def _address(v, where: str) -> str:
    if isinstance(v, str) and len(v) <= 64:
        a = _canonical_address(v)
        if a is not None:
            return a
    shown = repr(v[:70]) if isinstance(v, str) else _kind(v)
    raise CoordinatorError(f"{where}: expected an IP address, got {shown}")


def _number(v, where: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        shown = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and len(repr(v)) < 30 else _kind(v)
        raise CoordinatorError(f"{where}: expected a number {lo:.10g}..{hi:.10g}, got {shown}")
    return float(v)


def _probe_budget(body: dict) -> ProbeBudget | None:
    v = body.get("probe_budget")
    if v is None:  # older agents send none: their plans are not capped
        return None
    _object(v, "probe_budget")
    at = "probe_budget."
    pps = _number(_get(v, "pps", object, at), f"{at}pps", 0, MAX_BUDGET_PPS)
    idle = _number(_get(v, "idle_interval_ms", object, at), f"{at}idle_interval_ms", MIN_IDLE_MS, MAX_IDLE_MS)
    return ProbeBudget(pps, idle)


def _version(body: dict, name: str) -> int | None:
    v = body.get(name)
    return None if v is None else _int(v, name, 0, MAX_VERSION)


def _state(p: dict, at: str) -> str:
    s = p.get("state")
    if not isinstance(s, str) or s not in STATE_NAMES:
        shown = repr(s[:40]) if isinstance(s, str) else _kind(s)
        raise CoordinatorError(f"{at}state: {shown} is not a path state; one of {', '.join(STATE_NAMES)}")
    return s


def _reason(p: dict, at: str) -> str | None:
    r = p.get("reason")
    if r is None:
        return None
    if not isinstance(r, str):
        # it is stored and shown as text (sqlite could not bind a list)
        raise CoordinatorError(f"{at}reason: expected a string or null, got {_kind(r)}")
    return _text(r, f"{at}reason", MAX_TEXT)


_STATES = frozenset(STATE_NAMES)


def _paths(raw: list) -> tuple[PathIn, ...]:
    if len(raw) > MAX_PATHS:
        raise CoordinatorError(f"paths: at most {MAX_PATHS} in one request, got {len(raw)}")
    out, seen = [], set()
    for i, p in enumerate(raw):
        # the common case checked inline (a registration carries thousands of paths); anything
        # off goes to _path_checked, which names the field
        path = _path_fast(p)
        if path is None:
            path = _path_checked(i, p)
        if path.id in seen:
            raise CoordinatorError(f"paths[{i}].id: {path.id} appears twice in paths")
        seen.add(path.id)
        out.append(path)
    return tuple(out)


def _path_fast(p) -> PathIn | None:
    """The path if every field is as it should be, else None (nothing said about why)."""
    if type(p) is not dict:
        return None
    pid, peer, plane, sport = p.get("id"), p.get("peer"), p.get("plane"), p.get("sport", 0)
    state, reason, peer_addr, hops = p.get("state"), p.get("reason"), p.get("peer_addr", ""), p.get("hops")
    if not (type(pid) is int and 0 <= pid <= MAX_ID and type(plane) is int and 0 <= plane < MAX_PLANES
            and type(sport) is int and 0 <= sport <= 65535 and type(state) is str and state in _STATES
            and (reason is None or (type(reason) is str and len(reason) <= MAX_TEXT and reason.isprintable()))
            and type(peer) is str and HOST_NAME_RE.fullmatch(peer)):
        return None
    if peer_addr != "":
        peer_addr = _canonical_address(peer_addr) if type(peer_addr) is str and len(peer_addr) <= 64 else None
        if peer_addr is None:
            return None
    if hops is None:
        hops_t: tuple = ()
    elif type(hops) is list and len(hops) <= MAX_HOPS:
        canonical = []
        for h in hops:
            a = None if h is None else _canonical_address(h) if type(h) is str and len(h) <= 64 else False
            if a is None and h is not None or a is False:
                return None
            canonical.append(a)
        hops_t = tuple(canonical)
    else:
        return None
    return PathIn(pid, peer, plane, sport, hops_t, peer_addr, state, reason)


def _path_checked(i: int, p) -> PathIn:
    """The path, each field checked in turn; the first wrong one is refused by name."""
    at = f"paths[{i}]."
    _object(p, at[:-1])
    pid = _int(_get(p, "id", int, at), f"{at}id", 0, MAX_ID)
    hops = p.get("hops")
    hops = [] if hops is None else hops
    if not isinstance(hops, list) or len(hops) > MAX_HOPS:
        raise CoordinatorError(f"{at}hops: expected a list of router addresses (or null), at most {MAX_HOPS}, "
                               f"got {_kind(hops) if not isinstance(hops, list) else f'{len(hops)} hops'}")
    hops_t = tuple(None if h is None else _address(h, f"{at}hops[{j}]") for j, h in enumerate(hops))
    peer_addr = p.get("peer_addr", "")
    peer_addr = "" if peer_addr == "" else _address(peer_addr, f"{at}peer_addr")
    sport = _int(p.get("sport", 0), f"{at}sport", 0, 65535)
    return PathIn(pid, _host(_get(p, "peer", str, at), f"{at}peer"),
                  _int(_get(p, "plane", int, at), f"{at}plane", 0, MAX_PLANES - 1), sport, hops_t, peer_addr,
                  _state(p, at), _reason(p, at))

"""The coordinator's answer as the agent takes it: checked whole, before any of it is applied. Pure.

The coordinator answers every register and report with its versions, and, when the agent's copies
are stale, the drained links and this host's probe plan:

    {"drain_version": 7, "plan_version": 3,
     "drains": [{"link": "p0l0-p0s1", "addrs": ["198.18.128.0", "198.18.128.1"]}, ...],
     "plan": {"version": 3, "peers": [{"name": "h1", "agent_id": 2, "service": "198.18.0.2",
                                       "nics": {"0": "198.18.64.3", "1": "198.18.72.3"}}, ...]}}

or, instead of `plan`, once the agent holds one, the change from the version it holds:

     "plan_delta": {"from": 2, "version": 3, "peers": [<peers to add or refresh>], "remove": ["h9"]}

The agent treats it as untrusted input (a bug, a version skew or a forged answer must not stop
failover or move probes somewhere they should not go). `parse_answer` either returns the whole
answer as typed data or raises `AnswerError` naming the first thing wrong; the caller applies
nothing of a refused answer, keeps its versions (so the coordinator sends a fresh one), logs and
counts it. The rules:

- shape: a mapping with the keys above, each of its type; versions are integers >= 0 or null;
- sizes: at most `max_peers` plan peers (configurable), `MAX_DRAINS` drained links,
  `MAX_LINK_ADDRS` addresses per link, names of at most `MAX_NAME` characters, planes 0..63;
- addresses are IP literals (a host name would reach the resolver from the probe path), and the
  ones probes are sent to are unicast, not this host's own;
- plan peers are distinct (name, agent id) and never this agent's id;
- a plan cannot redefine a peer of the config file: a plan peer with a config peer's name or
  agent id must be that same peer (same id, service and NICs). The config is the operator's
  word, and a config peer's routes follow the probes of its paths.

- a plan delta is checked like a plan (each peer by the same rules), and so is the plan it makes
  (`apply_delta`: the held plan with the delta applied, within `max_peers`, ids distinct), before
  anything of the answer is applied. A delta from another version than the one held is not an
  error but cannot be applied (`StaleDelta`): the agent asks for the whole plan.

A plan peer named like this host is dropped (a plan is a list of others); a `plan` of null means
"no plan for you yet" and is not an error.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ..core.peer import Peer

MAX_DRAINS = 65536  # drained links in one answer (a 16k-GPU fabric has ~50 000 links)
MAX_LINK_ADDRS = 8  # interface addresses per drained link (two ends; room for more per end)
MAX_NAME = 255  # characters in a host or link name
MAX_PLANE = 63  # as in the config file
ANSWER_KEYS = {"drain_version", "plan_version", "drains", "plan", "plan_delta", "digests", "send_paths"}


class AnswerError(ValueError):
    """The coordinator's answer is refused; the message names the field and what was wrong."""


class StaleDelta(Exception):
    """A well-formed plan delta that does not start from the plan held (or none is held)."""


@dataclass(frozen=True)
class Drain:
    link: str
    addrs: tuple[str, ...]  # the link's interface addresses (a path crossing one crosses the link)


@dataclass(frozen=True)
class PlanAnswer:
    version: int | None
    peers: tuple[Peer, ...]  # config peers excluded only if the plan named them identically


@dataclass(frozen=True)
class PlanDelta:
    since: int  # the plan version it applies to ("from")
    version: int  # the plan version it makes
    peers: tuple[Peer, ...]  # added or refreshed (by name)
    remove: tuple[str, ...]  # names dropped


@dataclass(frozen=True)
class Answer:
    drain_version: int | None
    plan_version: int | None
    drains: tuple[Drain, ...] | None  # None: not in this answer (the agent's copy is current)
    plan: PlanAnswer | None  # None: not in this answer, or no plan for this host yet
    plan_delta: PlanDelta | None = None  # instead of `plan`: the change from the plan held
    digests: bool = False  # the coordinator takes digests instead of periodic whole tables
    send_paths: bool = False  # its copy of this agent's verdicts is off: send the whole table next


@dataclass(frozen=True)
class AnswerRules:
    """What an answer is checked against: this agent and its config file's peers."""

    own_name: str
    own_id: int
    max_peers: int  # coordinator.max_plan_peers of the config
    own_addrs: frozenset[str] = frozenset()  # this host's service and NIC addresses
    config_peers: Mapping[str, Peer] = field(default_factory=dict)

    @cached_property
    def config_ids(self) -> dict[int, Peer]:
        return {p.agent_id: p for p in self.config_peers.values()}


def parse_answer(raw: object, rules: AnswerRules) -> Answer:
    """The whole answer as typed data, or AnswerError naming what is wrong (see the module doc)."""
    if not isinstance(raw, dict):
        raise AnswerError(f"answer: expected a JSON object, got {_kind(raw)}")
    unknown = sorted(map(str, set(raw) - ANSWER_KEYS))
    if unknown:
        raise AnswerError(f"answer.{unknown[0][:40]}: unknown field; expected {', '.join(sorted(ANSWER_KEYS))}")
    drains = _drains(raw["drains"]) if "drains" in raw else None
    plan = _plan(raw["plan"], rules) if raw.get("plan") is not None else None
    plan_version = _version(raw.get("plan_version"), "plan_version")
    delta = None
    if "plan_delta" in raw:
        if plan is not None:
            raise AnswerError("plan_delta: given together with plan; an answer carries one or the other")
        delta = _delta(raw["plan_delta"], rules)
        if delta.version != plan_version:
            raise AnswerError(f"plan_delta.version: {delta.version} is not the answer's plan_version {plan_version}")
    flags = {}
    for name in ("digests", "send_paths"):
        if name in raw and type(raw[name]) is not bool:
            raise AnswerError(f"{name}: expected true or false, got {_kind(raw[name])}")
        flags[name] = raw.get(name, False)
    return Answer(_version(raw.get("drain_version"), "drain_version"), plan_version, drains, plan, delta, **flags)


def apply_delta(held: PlanAnswer | None, held_version: int | None, delta: PlanDelta,
                rules: AnswerRules) -> PlanAnswer:
    """The whole plan `delta` makes of the plan held, checked as a plan is (AnswerError), or
    StaleDelta when it does not start from `held_version`. Pure: `held` is not changed."""
    if held is None or held_version is None or delta.since != held_version:
        raise StaleDelta(f"plan_delta.from: {delta.since}, but the plan held is version {held_version}")
    gone = set(delta.remove) | {p.name for p in delta.peers}
    kept = [p for p in held.peers if p.name not in gone]
    if len(kept) + len(delta.peers) > rules.max_peers:
        raise AnswerError(f"plan_delta: the plan it makes names {len(kept) + len(delta.peers)} peers, more than "
                          f"the {rules.max_peers} allowed (coordinator.max_plan_peers)")
    peers: dict[str, Peer] = {}
    ids: dict[int, str] = {}
    for peer in kept:  # checked again: the rules may have changed (a reload) since it came
        _admit(peers, ids, peer, f"plan (held) peer {peer.name!r}", rules)
    for k, peer in enumerate(delta.peers):
        _admit(peers, ids, peer, f"plan_delta.peers[{k}]", rules)
    return PlanAnswer(delta.version, tuple(peers.values()))


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _version(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise AnswerError(f"{where}: expected an integer >= 0 or null, got {_short(value)}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise AnswerError(f"{where}: expected a printable name of 1..{MAX_NAME} characters, got {_short(value)}")
    return value


def _ip(value: object, where: str, unicast: bool = False) -> str:
    if not isinstance(value, str) or len(value) > 45:
        raise AnswerError(f"{where}: expected an IP address, got {_short(value)}")
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise AnswerError(f"{where}: {_short(value)} is not an IP address (host names are not accepted)") from None
    if unicast and (addr.is_multicast or addr.is_unspecified or addr.is_loopback
                    or addr == ipaddress.IPv4Address("255.255.255.255")):
        raise AnswerError(f"{where}: {value} is not a unicast address a peer can have")
    return str(addr)


def _list(value: object, where: str, most: int) -> list:
    if not isinstance(value, list):
        raise AnswerError(f"{where}: expected a list, got {_kind(value)}")
    if len(value) > most:
        raise AnswerError(f"{where}: {len(value)} entries, more than the {most} allowed")
    return value


def _object(value: object, where: str, keys: set[str]) -> dict:
    if not isinstance(value, dict):
        raise AnswerError(f"{where}: expected an object, got {_kind(value)}")
    missing = sorted(keys - set(value))
    if missing:
        raise AnswerError(f"{where}.{missing[0]}: required field is missing")
    return value


def _drains(raw: object) -> tuple[Drain, ...]:
    out = []
    for k, d in enumerate(_list(raw, "drains", MAX_DRAINS)):
        w = f"drains[{k}]"
        d = _object(d, w, {"link", "addrs"})
        addrs = _list(d["addrs"], f"{w}.addrs", MAX_LINK_ADDRS)
        out.append(Drain(_name(d["link"], f"{w}.link"),
                         tuple(_ip(a, f"{w}.addrs[{j}]") for j, a in enumerate(addrs))))
    return tuple(out)


def _plan(raw: object, rules: AnswerRules) -> PlanAnswer:
    raw = _object(raw, "plan", {"peers"})
    version = _version(raw.get("version"), "plan.version")
    peers: dict[str, Peer] = {}
    ids: dict[int, str] = {}
    for k, p in enumerate(_list(raw["peers"], "plan.peers", rules.max_peers)):
        _admit(peers, ids, _peer(p, f"plan.peers[{k}]"), f"plan.peers[{k}]", rules)
    return PlanAnswer(version, tuple(peers.values()))


def _delta(raw: object, rules: AnswerRules) -> PlanDelta:
    raw = _object(raw, "plan_delta", {"from", "version", "peers", "remove"})
    since, version = _version(raw["from"], "plan_delta.from"), _version(raw["version"], "plan_delta.version")
    if since is None or version is None:
        raise AnswerError("plan_delta.from, plan_delta.version: expected integers >= 0, got null")
    peers: dict[str, Peer] = {}
    ids: dict[int, str] = {}
    for k, p in enumerate(_list(raw["peers"], "plan_delta.peers", rules.max_peers)):
        _admit(peers, ids, _peer(p, f"plan_delta.peers[{k}]"), f"plan_delta.peers[{k}]", rules)
    # names only the plan held can have: it never held more than max_peers (and its own name)
    remove = tuple(_name(n, f"plan_delta.remove[{k}]")
                   for k, n in enumerate(_list(raw["remove"], "plan_delta.remove", 2 * rules.max_peers + 1)))
    return PlanDelta(since, version, tuple(peers.values()), remove)


def _admit(peers: dict[str, Peer], ids: dict[int, str], peer: Peer, w: str, rules: AnswerRules) -> None:
    """Add `peer` to a plan being built if the rules allow it (AnswerError naming `w` if not); a
    peer named like this host is skipped."""
    if peer.name == rules.own_name:
        return
    for what, addr in [("service", peer.service)] + [(f"nics.{pl}", a) for pl, a in peer.nics.items()]:
        if addr in rules.own_addrs:
            raise AnswerError(f"{w}.{what}: {addr} is an address of this host")
    if peer.agent_id == rules.own_id:
        raise AnswerError(f"{w}.agent_id: {peer.agent_id} is this agent's own id (peer {peer.name!r})")
    if peer.name in peers:
        raise AnswerError(f"{w}.name: {peer.name!r} is listed twice")
    if peer.agent_id in ids:
        raise AnswerError(f"{w}.agent_id: {peer.agent_id} is used by {ids[peer.agent_id]!r} too")
    mine = rules.config_peers.get(peer.name) or rules.config_ids.get(peer.agent_id)
    if mine is not None and mine != peer:
        raise AnswerError(f"{w}: peer {peer.name!r} (agent {peer.agent_id}) differs from the config file's peer "
                          f"{mine.name!r} (agent {mine.agent_id}, service {mine.service}, nics {mine.nics}); "
                          "a plan cannot redefine a configured peer")
    peers[peer.name] = peer
    ids[peer.agent_id] = peer.name


def _peer(raw: object, where: str) -> Peer:
    p = _object(raw, where, {"name", "agent_id", "service", "nics"})
    agent_id = p["agent_id"]
    if isinstance(agent_id, bool) or not isinstance(agent_id, int) or not 1 <= agent_id < 2**32:
        raise AnswerError(f"{where}.agent_id: expected an integer 1..4294967295, got {_short(agent_id)}")
    nics_raw = p["nics"]
    if not isinstance(nics_raw, dict) or not nics_raw:
        raise AnswerError(f"{where}.nics: expected an object plane -> address, got {_short(nics_raw)}")
    if len(nics_raw) > MAX_PLANE + 1:
        raise AnswerError(f"{where}.nics: {len(nics_raw)} planes, more than {MAX_PLANE + 1}")
    nics = {}
    for key, addr in nics_raw.items():
        plane = _plane(key, f"{where}.nics key")
        nics[plane] = _ip(addr, f"{where}.nics.{plane}", unicast=True)
    service = _ip(p["service"], f"{where}.service", unicast=True)
    return Peer(_name(p["name"], f"{where}.name"), agent_id, service, nics)


def _plane(key: object, where: str) -> int:
    """A plane number: JSON object keys are strings ("0"); plain integers are taken too."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 2:
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= MAX_PLANE:
        raise AnswerError(f"{where}: expected a plane 0..{MAX_PLANE}, got {_short(key)}")
    return key

"""The agent's configuration file (YAML), validated: every error names the field and what is allowed.

    agent_id: 1                      # 1..2^32-1, unique in the fleet
    name: h0                         # how peers and people call this host
    fleet_key_file: /etc/linkpass/fleet.key   # 32-64 random bytes, hex or raw, same on every host
    service: 198.18.0.1              # this host's service address
    nics:                            # one per plane
      - {plane: 0, ifname: p0, addr: 198.18.64.1}
    peers:
      - {name: h1, agent_id: 2, service: 198.18.0.2, nics: {0: 198.18.64.3}}
    probe:
      interval_ms: 1                 # active paths
      idle_interval_ms: 10           # idle paths (the agent's policy decides; issue 4)
      ports_per_path: 1              # source ports probed per distinct discovered path
      discovery_ports: 32            # source ports swept per (NIC, peer)
    api: {port: 9471}                # local query API and /metrics on 127.0.0.1
    routes: {enabled: false, rto_min_ms: 10, journal: /var/lib/linkpass/routes.journal}

Pure: parsing and validation only; reading the files is the daemon's.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """The config is wrong; the message starts with the field's path."""


@dataclass(frozen=True)
class Nic:
    plane: int
    ifname: str
    addr: str


@dataclass(frozen=True)
class Peer:
    name: str
    agent_id: int
    service: str
    nics: dict[int, str]  # plane -> address


@dataclass(frozen=True)
class AgentConfig:
    agent_id: int
    name: str
    fleet_key_file: str
    service: str
    nics: tuple[Nic, ...]
    peers: tuple[Peer, ...]
    interval_ms: float = 1.0
    idle_interval_ms: float = 10.0
    ports_per_path: int = 1
    discovery_ports: int = 32
    api_port: int = 9471
    routes_enabled: bool = False
    rto_min_ms: int = 10
    routes_journal: str = "/var/lib/linkpass/routes.journal"
    extra: dict = field(default_factory=dict)


def _need(raw: dict, key: str, where: str):
    if key not in raw:
        raise ConfigError(f"{where}{key}: required field is missing")
    return raw[key]


def _int(value, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{where}: expected an integer {lo}..{hi}, got {value!r}")
    return value


def _num(value, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ConfigError(f"{where}: expected a number {lo}..{hi}, got {value!r}")
    return float(value)


def _addr(value, where: str) -> str:
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an IP address") from None


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _mapping(value, where: str, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - allowed)
    if unknown:
        raise ConfigError(f"{where}{'.' if where else ''}{unknown[0]}: unknown field; allowed: {', '.join(sorted(allowed))}")
    return value


TOP = {"agent_id", "name", "fleet_key_file", "service", "nics", "peers", "probe", "api", "routes"}


def parse(raw: object) -> AgentConfig:
    top = _mapping(raw if raw is not None else {}, "", TOP)
    agent_id = _int(_need(top, "agent_id", ""), "agent_id", 1, 2**32 - 1)
    name = _str(_need(top, "name", ""), "name")
    key_file = _str(_need(top, "fleet_key_file", ""), "fleet_key_file")
    service = _addr(_need(top, "service", ""), "service")
    nics_raw = _need(top, "nics", "")
    if not isinstance(nics_raw, list) or not nics_raw:
        raise ConfigError("nics: expected a non-empty list of {plane, ifname, addr}")
    nics = []
    for k, n in enumerate(nics_raw):
        w = f"nics[{k}]"
        n = _mapping(n, w, {"plane", "ifname", "addr"})
        nics.append(Nic(_int(_need(n, "plane", w + "."), f"{w}.plane", 0, 63),
                        _str(_need(n, "ifname", w + "."), f"{w}.ifname"), _addr(_need(n, "addr", w + "."), f"{w}.addr")))
    planes = [n.plane for n in nics]
    if len(set(planes)) != len(planes):
        raise ConfigError(f"nics: plane listed twice ({planes}); one NIC per plane")
    peers = []
    seen_ids = {agent_id}
    for k, p in enumerate(top.get("peers") or []):
        w = f"peers[{k}]"
        p = _mapping(p, w, {"name", "agent_id", "service", "nics"})
        pid = _int(_need(p, "agent_id", w + "."), f"{w}.agent_id", 1, 2**32 - 1)
        if pid in seen_ids:
            raise ConfigError(f"{w}.agent_id: {pid} is used twice (or is this agent's own id)")
        seen_ids.add(pid)
        pnics = _need(p, "nics", w + ".")
        if not isinstance(pnics, dict) or not pnics:
            raise ConfigError(f"{w}.nics: expected a mapping plane -> address, e.g. {{0: 198.18.64.3}}")
        peers.append(Peer(_str(_need(p, "name", w + "."), f"{w}.name"), pid, _addr(_need(p, "service", w + "."), f"{w}.service"),
                          {_int(pl, f"{w}.nics key", 0, 63): _addr(a, f"{w}.nics.{pl}") for pl, a in pnics.items()}))
    probe = _mapping(top.get("probe") or {}, "probe", {"interval_ms", "idle_interval_ms", "ports_per_path", "discovery_ports"})
    api = _mapping(top.get("api") or {}, "api", {"port"})
    routes = _mapping(top.get("routes") or {}, "routes", {"enabled", "rto_min_ms", "journal"})
    interval = _num(probe.get("interval_ms", 1.0), "probe.interval_ms", 0.1, 60_000)
    idle = _num(probe.get("idle_interval_ms", 10.0), "probe.idle_interval_ms", interval, 60_000)
    enabled = routes.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"routes.enabled: expected true or false, got {enabled!r}")
    return AgentConfig(
        agent_id=agent_id, name=name, fleet_key_file=key_file, service=service, nics=tuple(nics), peers=tuple(peers),
        interval_ms=interval, idle_interval_ms=idle,
        ports_per_path=_int(probe.get("ports_per_path", 1), "probe.ports_per_path", 1, 16),
        discovery_ports=_int(probe.get("discovery_ports", 32), "probe.discovery_ports", 1, 1024),
        api_port=_int(api.get("port", 9471), "api.port", 0, 65535),
        routes_enabled=enabled, rto_min_ms=_int(routes.get("rto_min_ms", 10), "routes.rto_min_ms", 1, 1000),
        routes_journal=_str(routes.get("journal", "/var/lib/linkpass/routes.journal"), "routes.journal"))


def load_text(text: str, where: str) -> AgentConfig:
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    try:
        return parse(raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def read_fleet_key(data: bytes, where: str) -> bytes:
    """A key file holds 32-64 bytes, raw or as hex text."""
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode()) if text and all(c in b"0123456789abcdefABCDEF" for c in text) else data
    except (UnicodeDecodeError, ValueError):
        key = data
    if not 16 <= len(key) <= 64:
        raise ConfigError(f"{where}: a fleet key is 16..64 bytes (raw, or hex text); this file holds {len(key)}. "
                          "Make one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return key

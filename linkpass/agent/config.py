"""The agent's configuration file (YAML), validated: every error names the field and what is allowed.

    agent_id: 1                      # 1..2^32-1, unique in the fleet; auto: from the service address
    name: h0                         # how peers and people call this host; auto: $LINKPASS_HOST_NAME or the host name
    fleet_key_file: /etc/linkpass/fleet.key   # 32-64 random bytes, hex or raw, same on every host
    fleet_key_accept_file: /etc/linkpass/fleet-next.key   # optional, during a key rotation: accepted
                                     # too, never sent with (docs/security.md, rotating the fleet key)
    service: 198.18.0.1              # this host's service address; auto: its address in host.service_subnet
    nics:                            # one per plane; auto: found by host.planes
      - {plane: 0, ifname: p0, addr: 198.18.64.1, gateway: 198.18.64.0}   # gateway: for routes
    host:                            # what the `auto` values are derived from: one config serves a fleet
      service_subnet: 198.18.0.0/24  # the host's one address in it is its service address
      management_subnet: 198.19.0.0/24   # metrics.address: auto takes the host's address in it
      planes:                        # each plane's NIC: the interface with an address in its subnet;
        - {plane: 0, subnet: 198.18.64.0/18}   # gateway: the other end of a /31 (or /30), else the
                                                # next hop of the interface's routes when there is one
    peers:                           # a fleet-wide list may name this host too: it is left out
      - {name: h1, agent_id: 2, service: 198.18.0.2, nics: {0: 198.18.64.3}}
    probe:
      interval_ms: 1                 # active paths: those of peers this host moves data with
      idle_interval_ms: 100          # idle paths, when idle_rates is on (linkpass/core/activity.py)
      idle_rates: true               # each path at the rate what flows on it needs (docs/agent-cost.md); false: all at interval_ms
      idle_after_ms: 5000            # ... once no TCP connection and no lane moved data with the peer for this long
      standby_interval_ms: 50        # failover targets: quiet lanes' paths, other paths of peers the job uses
      progress_interval_ms: 50       # paths whose lanes report acknowledged bytes advancing (transport progress)
      progress_window_ms: 4          # ... for as long as the progress is this fresh; then back to interval_ms
      lanes_dir: /run/linkpass/lanes # where the NCCL plugin and RDMA library report their lanes (docs/lanes.md)
      unreported_rdma_pps: 5000      # a plane whose RDMA device moves more packets/s than the agent's probes, with
                                     # no lane report on it: all its paths active (0: do not look)
      budget_pps: 0                  # probes sent per second, never exceeded: rates degrade by priority (0: none)
      budget_cpu_pct: 0              # and this share of one core for the agent process (0: no CPU ceiling)
      ports_per_path: 1              # source ports probed per distinct discovered path
      discovery_ports: 32            # source ports swept per (NIC, peer)
      size_probe_every: 100          # every Nth probe is full-size (MTU black holes); 0 = never
      mtu: 1500                      # IP size of those probes
      rt_priority: 10                # SCHED_FIFO for the probe thread, one below for the decision loop (asleep, deciding) (0 = off)
      engine: auto                   # sockets | verbs | auto (verbs where every NIC has a RoCE v2 RDMA device)
      batch_ms: 10                   # on-time replies are taken this often (misses at once); more is cheaper
    detect:                          # linkpass/core/detector.py explains each
      miss_threshold: 3              # consecutive misses that declare a path down
      timeout_floor_us: 250          # the adaptive timeout never goes below this
      timeout_ceiling_ms: 50         # ... nor above this (raise it where round trips are slower)
      hold_down_ms: 500              # a recovered path waits this long before it is used again
      recovery_good_probes: 100      # ... and needs this many good probes in a row
      flap_half_life_ms: 10000       # flap damping: a DOWN's penalty halves this fast
      latency_floor_us: 50           # delay noise below this is not judged (software timestamps)
      latency_alarm_mads: 200        # CUSUM alarm level, in units of that noise (~30 ms of +0.5 ms)
      gray_sensitive_loss_pct: 0.5   # the least loss the sensitive test reports; a degraded direction
                                     # clears after ~4.6/(this - 0.1 %) clean probes (1150; 240 at 2)
    api: {port: 9471}                # local query API (and /metrics) on 127.0.0.1: the CLI, doctor
    metrics:                         # /metrics and /healthz for Prometheus (docs/observability.md)
      address: 127.0.0.1             # listen here: the host's management address, for a scraper elsewhere;
                                     # auto: its address in host.management_subnet
      port: 9472
      per_path: false                # true: each discovered path's own series too (37 more per path)
    routes: {enabled: false, rto_min_ms: 10, journal: /run/linkpass/routes.journal,
             max_changes_per_s: 1000}
    entropy: {enabled: false, path: /run/linkpass/entropy}   # ports per (peer, plane), docs/entropy-table.md;
                                     # its directory: writable by root (or the agent's uid) only
    coordinator:                     # optional; without it the agent works alone (it always fails over locally)
      url: https://198.19.0.1:9470   # the coordinator's endpoint (HTTPS; docs/security.md, TLS set-up)
      token_file: /etc/linkpass/agent.token   # this host's own agent token (`linkpass coordinator token NAME`)
      ca_file: /etc/linkpass/tls/ca.crt       # the CA its certificate must chain to (default: the system's)
      cert_file: /etc/linkpass/tls/h0.crt     # this host's client certificate, for mutual TLS (with key_file)
      key_file: /etc/linkpass/tls/h0.key
      insecure_http: false           # true: allow an http:// url (the token travels in cleartext; logged)
      report_ms: 200                 # path changes are sent this often (batched)
      summary_s: 10                  # the verdicts' digest (or the whole table) is sent this often (heals lost reports)
      follow_plan: true              # probe the peers the coordinator's probe plan names
      max_plan_peers: 1024           # a plan naming more peers is refused whole (linkpass/control/answers.py)

Pure: parsing and validation only; reading the files and the host's addresses (`HostFacts`,
agent/hostfacts.py) is the daemon's.
"""
from __future__ import annotations

import ipaddress
from dataclasses import MISSING, dataclass, field
from typing import Callable

from ..core.constants import AGENT_API_PORT, AGENT_METRICS_PORT, BATCH_S, ENTROPY_PATH
from ..core.detector import DetectorConfig
from ..core.peer import Peer
from ..core.wire import FLEET_KEY_MAX, FLEET_KEY_MIN


class ConfigError(ValueError):
    """The config is wrong; the message starts with the field's path."""


@dataclass(frozen=True)
class Nic:
    plane: int
    ifname: str
    addr: str
    gateway: str | None = None  # next hop for this plane's routes (needed when routes are enabled)


@dataclass(frozen=True)
class HostFacts:
    """What this host shows of itself, for the config's `auto` values (read by agent/hostfacts.py)."""
    hostname: str
    addrs: tuple[tuple[str, str], ...]  # (ifname, "address/prefixlen") of every address
    next_hops: tuple[tuple[str, str], ...] = ()  # (ifname, gateway) of every route with a gateway


AUTO = "auto"


# The field defaults of CoordinatorLinkConfig and AgentConfig are the only ones: `parse` takes a
# key left out of the file from its field (`_Section.get`).
@dataclass(frozen=True)
class CoordinatorLinkConfig:
    url: str
    token_file: str
    report_ms: int = 200
    summary_s: float = 10.0
    follow_plan: bool = True
    max_plan_peers: int = 1024
    ca_file: str | None = None  # None: the system's trust store
    cert_file: str | None = None
    key_file: str | None = None
    insecure_http: bool = False


@dataclass(frozen=True)
class AgentConfig:
    agent_id: int
    name: str
    fleet_key_file: str
    service: str
    nics: tuple[Nic, ...]
    peers: tuple[Peer, ...]
    fleet_key_accept_file: str | None = None  # during a key rotation: a second key accepted, never sent with
    interval_ms: float = 1.0
    idle_interval_ms: float = 100.0  # paths of idle peers, when idle_rates is on
    idle_rates: bool = True  # each path at the rate its traffic needs (docs/agent-cost.md)
    idle_after_ms: float = 5000.0
    standby_interval_ms: float = 50.0  # failover targets: quiet lanes' paths, other paths of peers the job uses
    progress_interval_ms: float = 50.0  # paths whose lanes' acknowledged bytes advance
    progress_window_ms: float = 4.0  # how fresh that progress must be
    lanes_dir: str = "/run/linkpass/lanes"  # lane reports of the NCCL plugin and the RDMA library
    unreported_rdma_pps: float = 5000.0  # RDMA packets/s on a plane no lane names that make its paths active (0: off)
    budget_pps: float = 0.0  # probes sent per second, never exceeded (0: no ceiling)
    budget_cpu_pct: float = 0.0  # share of one core for the agent process (0: no CPU ceiling)
    ports_per_path: int = 1
    discovery_ports: int = 32
    size_probe_every: int = 100
    mtu: int = 1500
    rt_priority: int = 10  # SCHED_FIFO priority of the probe thread (the loop's, asleep or deciding: one below); 0 = normal scheduling
    engine: str = "auto"  # how probes are sent and received: PROBE_ENGINES
    batch_ms: float = BATCH_S * 1000  # how often the loop takes on-time replies (misses wake it at once)
    api_port: int = AGENT_API_PORT
    metrics_address: str = "127.0.0.1"
    metrics_port: int = AGENT_METRICS_PORT
    metrics_per_path: bool = False  # per-(peer, plane) aggregates always; each path's own series only on request
    routes_enabled: bool = False
    rto_min_ms: int = 10
    routes_journal: str = "/run/linkpass/routes.journal"
    max_route_changes_per_s: float = 1000.0
    entropy_enabled: bool = False
    entropy_path: str = ENTROPY_PATH
    detect: dict = field(default_factory=dict)  # DetectorConfig overrides, in its own units (ns)
    coordinator: "CoordinatorLinkConfig | None" = None


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


# what each path field's refusal suggests (the module docstring's examples)
PATH_EXAMPLES = {"fleet_key_file": "/etc/linkpass/fleet.key", "fleet_key_accept_file": "/etc/linkpass/fleet-next.key",
                 "probe.lanes_dir": "/run/linkpass/lanes", "routes.journal": "/run/linkpass/routes.journal",
                 "entropy.path": ENTROPY_PATH, "coordinator.token_file": "/etc/linkpass/agent.token",
                 "coordinator.ca_file": "/etc/linkpass/tls/ca.crt", "coordinator.cert_file": "/etc/linkpass/tls/h0.crt",
                 "coordinator.key_file": "/etc/linkpass/tls/h0.key"}


def _path(value, where: str) -> str:
    text = _str(value, where)
    if not text.startswith("/"):
        raise ConfigError(f"{where}: {text!r} is not an absolute path; e.g. {PATH_EXAMPLES[where]}")
    return text


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _mapping(value, where: str, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - allowed)
    if unknown:
        raise ConfigError(f"{where}{'.' if where else ''}{unknown[0]}: unknown field; allowed: {', '.join(sorted(allowed))}")
    return value


class _Section:
    """One mapping of the file (probe, routes, coordinator, ...) and the dataclass it fills.

    `fields` maps each allowed key to the field it sets; `get(key)` returns the key's value, or
    that field's default when the key is left out (so every default is written once, on the
    dataclass, and is checked like a given value), with the path error messages start with."""

    def __init__(self, raw, name: str, cls: type, fields: dict[str, str]):
        self.raw, self.name, self.cls, self.fields = _mapping(raw, name, set(fields)), name, cls, fields

    def get(self, key: str) -> tuple[object, str]:
        where = f"{self.name}.{key}"
        if key in self.raw:
            return self.raw[key], where
        default = self.cls.__dataclass_fields__[self.fields[key]].default
        if default is MISSING:
            raise ConfigError(f"{where}: required field is missing")
        return default, where


TOP = {"agent_id", "name", "fleet_key_file", "fleet_key_accept_file", "service", "nics", "host", "peers", "probe", "detect", "api", "metrics",
       "routes", "entropy", "coordinator"}
# section key -> AgentConfig field
PROBE = {k: k for k in ("interval_ms", "idle_interval_ms", "idle_rates", "idle_after_ms", "standby_interval_ms",
                        "progress_interval_ms", "progress_window_ms", "lanes_dir", "unreported_rdma_pps",
                        "budget_pps", "budget_cpu_pct", "ports_per_path", "discovery_ports", "size_probe_every",
                        "mtu", "rt_priority", "engine", "batch_ms")}
# sockets: the C core on raw and UDP sockets; verbs: UD queue pairs (an RDMA NIC takes every
# packet to 4791 before a socket could); auto: verbs where every NIC has an RDMA device
PROBE_ENGINES = ("auto", "sockets", "verbs")
API = {"port": "api_port"}
METRICS = {"address": "metrics_address", "port": "metrics_port", "per_path": "metrics_per_path"}
ROUTES = {"enabled": "routes_enabled", "rto_min_ms": "rto_min_ms", "journal": "routes_journal",
          "max_changes_per_s": "max_route_changes_per_s"}
ENTROPY = {"enabled": "entropy_enabled", "path": "entropy_path"}
COORDINATOR = {k: k for k in ("url", "token_file", "report_ms", "summary_s", "follow_plan", "max_plan_peers",
                              "ca_file", "cert_file", "key_file", "insecure_http")}  # CoordinatorLinkConfig
# detect.<field>: (DetectorConfig field, factor to its unit, lo, hi, the agent's default or None for
# DetectorConfig's); a field with float bounds takes any number in them, the others an integer.
# The agent's own defaults: its timestamps are software (SO_TIMESTAMPNS), whose noise on a busy
# host is tens of µs, not the 2 µs DetectorConfig assumes for hardware stamps.
DETECT = {"miss_threshold": ("miss_threshold", 1, 1, 100, None),
          "timeout_floor_us": ("timeout_floor_ns", 1000, 10, 1_000_000, None),
          "timeout_ceiling_ms": ("timeout_ceiling_ns", 1_000_000, 1, 10_000, None),
          "hold_down_ms": ("hold_down_ns", 1_000_000, 0, 600_000, None),
          "recovery_good_probes": ("recovery_good_probes", 1, 1, 100_000, None),
          "flap_half_life_ms": ("flap_half_life_ns", 1_000_000, 100, 3_600_000, None),
          "latency_floor_us": ("latency_mad_floor_ns", 1000, 1, 1_000_000, 50),
          "latency_alarm_mads": ("latency_h_mad", 1, 1, 100_000, 200),
          # the sensitive loss test's degraded rate (0.5 %): a degraded direction clears after about
          # 4.6 / (this - 0.1 %) clean probes, 1150 at 0.5 % and 240 at 2 %; raise it where paths are
          # probed slowly, at the price of not seeing loss below it
          "gray_sensitive_loss_pct": ("gray_p1_slow", 0.01, 0.2, 4.0, None)}


# Every scalar field of the sections: (JSON type, low, high) for numbers, (type,) otherwise; the
# parser checks values by it (`_checked`) and `schema()` is made from it, so the two cannot differ.
# "address" is an IP address, "string" a non-empty string, "optional" a string or null, "path" an
# absolute path and "optional_path" one or null: the agent runs from / under systemd and from
# anywhere by hand, so a relative path would name a different file depending on where it started.
SCALARS: dict[str, tuple] = {
    "probe.interval_ms": ("number", 0.1, 60_000),
    "probe.idle_interval_ms": ("number", 0.1, 60_000),  # and at least probe.interval_ms
    "probe.idle_rates": ("boolean",),
    "probe.idle_after_ms": ("number", 100, 3_600_000),
    "probe.standby_interval_ms": ("number", 0.1, 60_000),  # between probe.interval_ms and idle_interval_ms
    "probe.progress_interval_ms": ("number", 0.1, 60_000),  # and at least probe.interval_ms
    "probe.progress_window_ms": ("number", 0.5, 10_000),
    "probe.lanes_dir": ("path",),
    "probe.unreported_rdma_pps": ("number", 0, 100_000_000),
    "probe.budget_pps": ("number", 0, 10_000_000),
    "probe.budget_cpu_pct": ("number", 0, 800),
    "probe.ports_per_path": ("integer", 1, 16),
    "probe.discovery_ports": ("integer", 1, 1024),
    "probe.size_probe_every": ("integer", 0, 1_000_000),
    "probe.mtu": ("integer", 124, 9000),
    "probe.rt_priority": ("integer", 0, 99),
    "probe.engine": ("engine",),
    "probe.batch_ms": ("number", 1, 1000),
    "api.port": ("integer", 0, 65535),
    "metrics.address": ("address",),
    "metrics.port": ("integer", 0, 65535),
    "metrics.per_path": ("boolean",),
    "routes.enabled": ("boolean",),
    "routes.rto_min_ms": ("integer", 1, 1000),
    "routes.journal": ("path",),
    "routes.max_changes_per_s": ("number", 1, 100_000),
    "entropy.enabled": ("boolean",),
    "entropy.path": ("path",),
    "coordinator.url": ("string",),
    "coordinator.token_file": ("path",),
    "coordinator.report_ms": ("integer", 10, 60_000),
    "coordinator.summary_s": ("number", 1, 3600),
    "coordinator.follow_plan": ("boolean",),
    "coordinator.max_plan_peers": ("integer", 1, 65536),
    "coordinator.ca_file": ("optional_path",),
    "coordinator.cert_file": ("optional_path",),
    "coordinator.key_file": ("optional_path",),
    "coordinator.insecure_http": ("boolean",),
}


def _checked(s: "_Section", key: str):
    """Section `s`'s `key` (or its default), checked as SCALARS says."""
    value, where = s.get(key)
    kind, *bounds = SCALARS[where]
    if kind == "number":
        return _num(value, where, *bounds)
    if kind == "integer":
        return _int(value, where, *bounds)
    if kind == "boolean":
        return _bool(value, where)
    if kind == "address":
        return _addr(value, where)
    if kind == "engine":
        return _engine(value, where)
    if kind == "optional":
        return _optional_str(value, where)
    if kind == "path":
        return _path(value, where)
    if kind == "optional_path":
        return None if value is None else _path(value, where)
    return _str(value, where)


def parse(raw: object, host: "HostFacts | Callable[[], HostFacts] | None" = None) -> AgentConfig:
    """The whole file: each section checked in the order the file's docstring lists them. `auto`
    values are derived from `host`, or from what `host()` returns when some value is `auto`
    (refused, naming the field, without it)."""
    top = _mapping(raw if raw is not None else {}, "", TOP)
    top = _resolve_auto(top, host)
    identity = _identity(top)
    nics = _nics(_need(top, "nics", ""))
    return AgentConfig(**identity, nics=nics, peers=_peers(_not_self(top.get("peers") or [], identity),
                                                           identity["agent_id"]),
                       **_probe(top.get("probe") or {}), detect=_detect(top.get("detect") or {}),
                       **_api(top.get("api") or {}), **_metrics(top.get("metrics") or {}),
                       **_routes(top.get("routes") or {}, nics),
                       **_entropy(top.get("entropy") or {}), coordinator=_coordinator(top.get("coordinator")))


def _resolve_auto(top: dict, host: HostFacts | None) -> dict:
    """The file with each `auto` replaced by what the host shows (host.* says where to look)."""
    autos = [k for k in ("name", "service", "agent_id", "nics") if top.get(k) == AUTO]
    spec = _host_section(top.get("host"))
    metrics_auto = isinstance(top.get("metrics"), dict) and top["metrics"].get("address") == AUTO
    if not autos and not metrics_auto:
        return top
    if callable(host):
        host = host()  # read off the host only when something asks for it
    if host is None:
        raise ConfigError(f"{autos[0] if autos else 'metrics.address'}: auto is derived from this host's addresses, "
                          "which only the agent reads; run `linkpass agent --config FILE --check-config` on the host "
                          "to see what it finds")
    out = dict(top)
    if "name" in autos:
        if not host.hostname:
            raise ConfigError("name: auto, but this host has no host name; set name: explicitly")
        out["name"] = host.hostname
    if "service" in autos:
        if spec["service_subnet"] is None:
            raise ConfigError("service: auto needs host.service_subnet (the subnet of the service addresses, "
                              "e.g. 198.18.0.0/24)")
        out["service"] = _one_address_in("service", spec["service_subnet"], host)[1]
    if "agent_id" in autos:
        out["agent_id"] = agent_id_of(_addr(_need(out, "service", ""), "service"))
    if metrics_auto:
        if spec["management_subnet"] is None:
            raise ConfigError("metrics.address: auto needs host.management_subnet (where Prometheus scrapes from)")
        out["metrics"] = dict(top["metrics"],
                              address=_one_address_in("metrics.address", spec["management_subnet"], host)[1])
    if "nics" in autos:
        if not spec["planes"]:
            raise ConfigError("nics: auto needs host.planes (each plane's subnet, e.g. [{plane: 0, subnet: "
                              "198.18.64.0/18}])")
        out["nics"] = [_nic_of(plane, subnet, host) for plane, subnet in spec["planes"]]
    return out


def agent_id_of(service: str) -> int:
    """An agent id from the service address: an IPv4 address as a 32-bit number, an IPv6
    address's low 32 bits. Unique in the fleet as long as the service addresses are (IPv6: as
    long as they differ in their low 32 bits)."""
    n = int(ipaddress.ip_address(service)) & 0xFFFFFFFF
    if n == 0:
        raise ConfigError(f"agent_id: auto gives 0 for service {service}; set agent_id: explicitly")
    return n


def _host_section(raw) -> dict:
    spec = {"service_subnet": None, "management_subnet": None, "planes": []}
    if raw is None:
        return spec
    raw = _mapping(raw, "host", {"service_subnet", "management_subnet", "planes"})
    for key in ("service_subnet", "management_subnet"):
        if key in raw:
            spec[key] = _net(raw[key], f"host.{key}")
    planes = raw.get("planes") or []
    if not isinstance(planes, list):
        raise ConfigError("host.planes: expected a list of {plane, subnet}")
    for k, p in enumerate(planes):
        w = f"host.planes[{k}]"
        p = _mapping(p, w, {"plane", "subnet"})
        spec["planes"].append((_int(_need(p, "plane", w + "."), f"{w}.plane", 0, 63),
                               _net(_need(p, "subnet", w + "."), f"{w}.subnet")))
    seen = [pl for pl, _ in spec["planes"]]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"host.planes: plane listed twice ({seen}); one subnet per plane")
    return spec


def _net(value, where: str):
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not a subnet (e.g. 198.18.64.0/18)") from None


def _one_address_in(field_name: str, subnet, host: HostFacts) -> tuple[str, str, int]:
    """(ifname, address, prefix length) of the host's one address in `subnet`."""
    found = []
    for ifname, cidr in host.addrs:
        iface = ipaddress.ip_interface(cidr)
        if iface.ip in subnet:
            found.append((ifname, str(iface.ip), iface.network.prefixlen))
    if len(found) != 1:
        seen = ", ".join(f"{i} {a}" for i, a in host.addrs) or "none"
        what = "no address" if not found else f"{len(found)} addresses ({', '.join(f'{i} {a}' for i, a, _ in found)})"
        raise ConfigError(f"{field_name}: auto found {what} in {subnet} on this host (its addresses: {seen}); "
                          f"fix the subnet or set {field_name} explicitly")
    return found[0]


def _nic_of(plane: int, subnet, host: HostFacts) -> dict:
    ifname, addr, prefix = _one_address_in(f"nics (plane {plane})", subnet, host)
    ip = ipaddress.ip_address(addr)
    gateway = None
    if (ip.version, prefix) in ((4, 31), (6, 127)):
        gateway = str(ipaddress.ip_address(int(ip) ^ 1))  # the other end of the point-to-point link
    elif (ip.version, prefix) == (4, 30):
        net = ipaddress.ip_network(f"{addr}/30", strict=False)
        gateway = next(str(h) for h in net.hosts() if h != ip)
    else:
        hops = sorted({gw for i, gw in host.next_hops if i == ifname})
        if len(hops) == 1:
            gateway = hops[0]
    nic = {"plane": plane, "ifname": ifname, "addr": addr}
    if gateway is not None:
        nic["gateway"] = gateway
    return nic


def _identity(top: dict) -> dict:
    return {"agent_id": _int(_need(top, "agent_id", ""), "agent_id", 1, 2**32 - 1),
            "name": _str(_need(top, "name", ""), "name"),
            "fleet_key_file": _path(_need(top, "fleet_key_file", ""), "fleet_key_file"),
            "fleet_key_accept_file": None if top.get("fleet_key_accept_file") is None else
            _path(top["fleet_key_accept_file"], "fleet_key_accept_file"),
            "service": _addr(_need(top, "service", ""), "service")}


def _nics(raw) -> tuple[Nic, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("nics: expected a non-empty list of {plane, ifname, addr}")
    nics = []
    for k, n in enumerate(raw):
        w = f"nics[{k}]"
        n = _mapping(n, w, {"plane", "ifname", "addr", "gateway"})
        nics.append(Nic(_int(_need(n, "plane", w + "."), f"{w}.plane", 0, 63),
                        _str(_need(n, "ifname", w + "."), f"{w}.ifname"), _addr(_need(n, "addr", w + "."), f"{w}.addr"),
                        _addr(n["gateway"], f"{w}.gateway") if "gateway" in n else None))
    planes = [n.plane for n in nics]
    if len(set(planes)) != len(planes):
        raise ConfigError(f"nics: plane listed twice ({planes}); one NIC per plane")
    return tuple(nics)


def _not_self(raw, identity: dict):
    """The peers without this host itself: a fleet-wide config lists every host, this one too
    (recognized by its service address)."""
    if not isinstance(raw, list):
        raise ConfigError("peers: expected a list of {name, agent_id, service, nics}")
    own = identity["service"]

    def is_self(p) -> bool:
        try:
            return isinstance(p, dict) and str(ipaddress.ip_address(str(p.get("service")))) == own
        except ValueError:
            return False

    return [p for p in raw if not is_self(p)]


def _peers(raw, own_id: int) -> tuple[Peer, ...]:
    peers = []
    seen_ids = {own_id}
    for k, p in enumerate(raw):
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
    return tuple(peers)


def _probe(raw) -> dict:
    s = _Section(raw, "probe", AgentConfig, PROBE)
    out = {key: _checked(s, key) for key in PROBE}
    # the slower rates a file leaves out follow a slow interval_ms up, so only values it gives can conflict
    for key in ("idle_interval_ms", "standby_interval_ms", "progress_interval_ms"):
        if key not in s.raw:
            out[key] = max(out[key], out["interval_ms"])
    if "standby_interval_ms" not in s.raw:
        out["standby_interval_ms"] = min(out["standby_interval_ms"], out["idle_interval_ms"])
    if out["idle_interval_ms"] < out["interval_ms"]:
        raise ConfigError(f"probe.idle_interval_ms: {out['idle_interval_ms']:g} is below probe.interval_ms "
                          f"({out['interval_ms']:g}); an idle path is probed at most as often as an active one")
    for key in ("standby_interval_ms", "progress_interval_ms"):
        if not out["interval_ms"] <= out[key]:
            raise ConfigError(f"probe.{key}: {out[key]:g} is below probe.interval_ms ({out['interval_ms']:g}); "
                              "no path is probed more often than an active one")
    if out["standby_interval_ms"] > out["idle_interval_ms"]:
        raise ConfigError(f"probe.standby_interval_ms: {out['standby_interval_ms']:g} is above probe.idle_interval_ms "
                          f"({out['idle_interval_ms']:g}); a failover target is probed at least as often as an idle path")
    return out


def _engine(value, where: str) -> str:
    if value not in PROBE_ENGINES:
        raise ConfigError(f"{where}: {value!r} is not a probe engine; use one of {', '.join(PROBE_ENGINES)}")
    return value


def _detect(raw) -> dict:
    """DetectorConfig overrides in its own units; DetectorConfig itself judges their combination."""
    given = _mapping(raw, "detect", set(DETECT))
    detect = {}
    for key, (field_name, factor, lo, hi, default) in DETECT.items():
        if key in given:
            read = _num if isinstance(lo, float) else _int
            detect[field_name] = read(given[key], f"detect.{key}", lo, hi) * factor
        elif default is not None:
            detect[field_name] = default * factor
    # the first timeout (before any round trip is measured) follows a floor or ceiling moved past it
    first = DetectorConfig.initial_timeout_ns
    lo, hi = detect.get("timeout_floor_ns", DetectorConfig.timeout_floor_ns), \
        detect.get("timeout_ceiling_ns", DetectorConfig.timeout_ceiling_ns)
    if lo <= hi and not lo <= first <= hi:
        detect["initial_timeout_ns"] = min(max(first, lo), hi)
    try:
        DetectorConfig(**detect)
    except ValueError as exc:
        raise ConfigError(f"detect: {exc}") from None
    return detect


def _api(raw) -> dict:
    s = _Section(raw, "api", AgentConfig, API)
    return {"api_port": _checked(s, "port")}


def _metrics(raw) -> dict:
    s = _Section(raw, "metrics", AgentConfig, METRICS)
    return {field_name: _checked(s, key) for key, field_name in METRICS.items()}


def _routes(raw, nics: tuple[Nic, ...]) -> dict:
    s = _Section(raw, "routes", AgentConfig, ROUTES)
    enabled = _checked(s, "enabled")
    if enabled:
        for k, n in enumerate(nics):
            if n.gateway is None:
                raise ConfigError(f"nics[{k}].gateway: required when routes.enabled is true (the next hop of "
                                  f"plane {n.plane}'s routes, e.g. the leaf's address on {n.ifname})")
    return {field_name: _checked(s, key) for key, field_name in ROUTES.items()}


def _entropy(raw) -> dict:
    s = _Section(raw, "entropy", AgentConfig, ENTROPY)
    return {field_name: _checked(s, key) for key, field_name in ENTROPY.items()}


def _coordinator(raw) -> CoordinatorLinkConfig | None:
    """Optional: without it the agent works alone."""
    if raw is None:
        return None
    s = _Section(raw, "coordinator", CoordinatorLinkConfig, COORDINATOR)
    values = {key: _checked(s, key) for key in COORDINATOR}
    _coordinator_transport(values["url"], values["insecure_http"],
                           {k: values[k] for k in ("ca_file", "cert_file", "key_file")})
    return CoordinatorLinkConfig(**values)


def _coordinator_transport(url: str, insecure: bool, files: dict) -> None:
    """HTTPS unless plain HTTP is asked for by name; TLS files only where TLS is used."""
    if url.startswith("http://"):
        if not insecure:
            raise ConfigError(f"coordinator.url: {url} is plain HTTP, which sends the agent's token in cleartext; use "
                              "https://HOST:PORT (with coordinator.ca_file), or set coordinator.insecure_http: true "
                              "to allow plain HTTP explicitly")
        given = [k for k, v in files.items() if v]
        if given:
            raise ConfigError(f"coordinator.{given[0]}: not used with plain HTTP (coordinator.url is http://); use an "
                              "https:// url, or remove it")
    elif not url.startswith("https://"):
        raise ConfigError(f"coordinator.url: expected https://HOST:PORT (the coordinator's endpoint), got {url!r}")
    elif insecure:
        raise ConfigError("coordinator.insecure_http: true, but coordinator.url is https://; remove insecure_http")
    if bool(files["cert_file"]) != bool(files["key_file"]):
        given, missing = ("cert_file", "key_file") if files["cert_file"] else ("key_file", "cert_file")
        raise ConfigError(f"coordinator.{missing}: required with coordinator.{given} (a client certificate and its "
                          "private key go together)")


def _optional_str(value, where: str) -> str | None:
    return None if value is None else _str(value, where)


def load_text(text: str, where: str, host: "HostFacts | Callable[[], HostFacts] | None" = None) -> AgentConfig:
    from ..formats import yaml_doc as yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    try:
        return parse(raw, host)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def read_fleet_key(data: bytes, where: str) -> bytes:
    """A key file holds 32-64 bytes, raw or as hex text (the file's permissions: agent/keyfile.py).
    Fewer than 32 bytes is refused: the key is the fleet's only authentication of probes."""
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode()) if text and all(c in b"0123456789abcdefABCDEF" for c in text) else data
    except (UnicodeDecodeError, ValueError):
        key = data
    if not FLEET_KEY_MIN <= len(key) <= FLEET_KEY_MAX:
        raise ConfigError(f"{where}: a fleet key is {FLEET_KEY_MIN}..{FLEET_KEY_MAX} bytes (raw, or hex text); this file holds {len(key)}. "
                          "Make one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return key


# ---- the config's JSON Schema -----------------------------------------------------------------
_SECTIONS = {"probe": (PROBE, AgentConfig), "api": (API, AgentConfig), "metrics": (METRICS, AgentConfig),
             "routes": (ROUTES, AgentConfig), "entropy": (ENTROPY, AgentConfig),
             "coordinator": (COORDINATOR, CoordinatorLinkConfig)}
_AUTO = {"const": AUTO, "description": "derived from this host's addresses (host: says where)"}
_ADDRESS = {"type": "string", "description": "an IPv4 or IPv6 address"}
_SUBNET = {"type": "string", "description": "an IPv4 or IPv6 subnet, e.g. 198.18.64.0/18"}
_PATH = {"type": "string", "minLength": 1, "pattern": "^/", "description": "an absolute path"}


def _scalar_schema(where: str) -> dict:
    kind, *bounds = SCALARS[where]
    if kind in ("number", "integer"):
        return {"type": kind, "minimum": bounds[0], "maximum": bounds[1]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "address":
        return dict(_ADDRESS)
    if kind == "engine":
        return {"enum": list(PROBE_ENGINES)}
    if kind == "optional":
        return {"type": ["string", "null"], "minLength": 1}
    if kind == "path":
        return dict(_PATH)
    if kind == "optional_path":
        return {**_PATH, "type": ["string", "null"]}
    return {"type": "string", "minLength": 1}


def schema() -> dict:
    """The agent config file's JSON Schema (draft 2020-12), made from the tables the parser checks
    by (SCALARS, DETECT, the sections' field maps and the dataclasses' defaults). It describes the
    file as JSON sees it (mapping keys are strings, so a peer's nics key is "0"); what it cannot
    say — a plane listed twice, a gateway required by routes.enabled, coordinator TLS files that
    go together — the parser still checks. `linkpass agent --schema` prints it."""
    def section(name: str) -> dict:
        fields, cls = _SECTIONS[name]
        props = {}
        for key, field_name in fields.items():
            prop = _scalar_schema(f"{name}.{key}")
            default = cls.__dataclass_fields__[field_name].default
            if default is not MISSING:
                prop["default"] = default
            props[key] = prop
        required = [k for k, f in fields.items() if cls.__dataclass_fields__[f].default is MISSING]
        return {"type": ["object", "null"], "additionalProperties": False, "properties": props,
                **({"required": required} if required else {})}

    plane = {"type": "integer", "minimum": 0, "maximum": 63}
    agent_id = {"type": "integer", "minimum": 1, "maximum": 2**32 - 1}
    sections = {name: section(name) for name in _SECTIONS}
    sections["metrics"]["properties"]["address"] = {"anyOf": [_AUTO, _ADDRESS], "default": "127.0.0.1"}
    detect = {"type": ["object", "null"], "additionalProperties": False,
              "properties": {key: {"type": "number" if isinstance(lo, float) else "integer", "minimum": lo,
                                   "maximum": hi}
                             for key, (_f, _factor, lo, hi, _d) in DETECT.items()}}
    nic = {"type": "object", "additionalProperties": False, "required": ["plane", "ifname", "addr"],
           "properties": {"plane": plane, "ifname": {"type": "string", "minLength": 1}, "addr": _ADDRESS,
                          "gateway": _ADDRESS}}
    peer = {"type": "object", "additionalProperties": False, "required": ["name", "agent_id", "service", "nics"],
            "properties": {"name": {"type": "string", "minLength": 1}, "agent_id": agent_id, "service": _ADDRESS,
                           "nics": {"type": "object", "minProperties": 1, "additionalProperties": False,
                                    "patternProperties": {"^[0-9]{1,2}$": _ADDRESS}}}}
    host = {"type": "object", "additionalProperties": False,
            "properties": {"service_subnet": _SUBNET, "management_subnet": _SUBNET,
                           "planes": {"type": "array", "items": {
                               "type": "object", "additionalProperties": False, "required": ["plane", "subnet"],
                               "properties": {"plane": plane, "subnet": _SUBNET}}}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/linkpass/linkpass/blob/main/deploy/schema/agent-config.schema.json",
        "title": "LinkPass agent config",
        "description": "The file `linkpass agent --config` reads (docs/failover.md; one file for a fleet: "
                       "docs/install.md). Made by linkpass.agent.config.schema().",
        "type": "object", "additionalProperties": False,
        "required": ["agent_id", "name", "fleet_key_file", "service", "nics"],
        "properties": {
            "agent_id": {"anyOf": [_AUTO, agent_id]},
            "name": {"type": "string", "minLength": 1, "description": "this host's name, or auto"},
            "fleet_key_file": dict(_PATH),
            "fleet_key_accept_file": {**_PATH, "type": ["string", "null"]},
            "service": {"anyOf": [_AUTO, _ADDRESS]},
            "nics": {"anyOf": [_AUTO, {"type": "array", "minItems": 1, "items": nic}]},
            "host": host,
            "peers": {"type": ["array", "null"], "items": peer},
            "detect": detect,
            **sections,
        },
    }

"""The pure half of `linkpass doctor`: the facts it reads, and the checks that turn them into rows.
No I/O; unit tests feed it facts."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..core.constants import AGENT_API_PORT, PROBE_PORT_BASE, RTPROT_LINKPASS
from ..core.states import DARK, HELD_OUT, USABLE, Level, State, health_of, state_of, worst

# A check's status, as doctor prints it, and the health level it counts as (core/states.py): the
# exit code and colour of every command derive from that level. A skipped check told nothing.
OK, WARN, FAIL, SKIP = Level.OK.value, "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
LEVEL_OF_STATUS: dict[str, Level | None] = {OK: Level.OK, WARN: Level.WARNING, FAIL: Level.CRITICAL, SKIP: None}

CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_NICE = 12, 13, 23
STA_UNSYNC = 0x0040
TIME_ERROR = 5
RDMA_DIR = "/sys/class/infiniband"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str
    fix: str = ""
    reads: str = ""  # what it looked at (wide / json)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NicCfg:
    """What doctor needs of a configured NIC (from the agent config)."""

    plane: int
    ifname: str
    addr: str
    gateway: str | None = None


@dataclass(frozen=True)
class PeerCfg:
    name: str
    service: str


@dataclass
class Facts:
    """Everything read from the system; None where it was not read (or could not be)."""

    netns: str | None = None
    sysctl: dict[str, str | None] = field(default_factory=dict)  # dotted key -> value (None: absent)
    cap_eff: int | None = None
    rtprio: int | None = None  # soft RLIMIT_RTPRIO: SCHED_FIFO up to this priority without CAP_SYS_NICE
    rt_priority: int = 10  # the config's probe.rt_priority (the agent's default without --config)
    uid: int = 0
    config_path: str | None = None
    config_error: str | None = None
    key_error: str | None = None  # the fleet key file could not be read
    nics: tuple[NicCfg, ...] = ()
    peers: tuple[PeerCfg, ...] = ()
    discovery_ports: int = 32
    api_port: int = AGENT_API_PORT
    links: dict[str, dict] | None = None  # ifname -> {"operstate", "flags", "addrs": [a/len]}
    links_error: str | None = None
    neigh: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # ifname -> {addr: states}
    gw_route: dict[str, dict | None] = field(default_factory=dict)  # gateway -> `ip route get` (None: none)
    peer_routes: dict[str, list[dict]] = field(default_factory=dict)  # peer service -> `ip route show match`
    routes_error: str | None = None
    rdma: list[dict] | None = None  # [{"name", "ports": {n: state}, "netdevs": [..]}]; None: no sysfs class
    clock: dict | None = None  # {"state", "status", "esterror_us", "maxerror_us"}
    clock_error: str | None = None
    agent_rows: list[dict] | None = None
    agent_error: str | None = None
    coordinator_url: str | None = None  # from the config's coordinator section (None: not configured)
    coordinator_whoami: dict | None = None  # {"name", "role", "host"} the coordinator says our token is
    agent_name: str | None = None  # the config's name: the host the agent reports as
    coordinator_error: str | None = None
    coordinator_refused: bool = False  # it answered, and refused the token


# ---- the pure checks ----------------------------------------------------------------------

def _int(v: str | None) -> int | None:
    try:
        return int(str(v).split()[0], 0)  # decimal as /proc prints it; 0x.. tolerated
    except (TypeError, ValueError, IndexError):
        return None


def _sysctl_cmd(key: str, value: str, ns: str | None) -> str:
    pre = f"ip netns exec {ns} " if ns else ""
    return f"{pre}sysctl -w {key}={value}" if " " not in value else f'{pre}sysctl -w {key}="{value}"'


def check_multipath_hash(f: Facts) -> Check:
    key = "net.ipv4.fib_multipath_hash_policy"
    v = f.sysctl.get(key)
    reads = key
    policy = _int(v)
    fix = _sysctl_cmd(key, "1", f.netns) + "  (persist it in /etc/sysctl.d/)"
    if policy is None:
        return Check("sysctl.multipath_hash", SKIP, f"{key} not readable ({v!r})", "", reads)
    if policy == 1:
        return Check("sysctl.multipath_hash", OK, f"{key} = 1: ECMP hashes on ports, so source ports pick paths",
                     "", reads)
    if policy == 3:
        fields = _int(f.sysctl.get("net.ipv4.fib_multipath_hash_fields"))
        reads += ", net.ipv4.fib_multipath_hash_fields"
        if fields is not None and fields & 0x10 and fields & 0x20:
            return Check("sysctl.multipath_hash", OK, f"{key} = 3 with hash fields {fields:#x} (ports included)",
                         "", reads)
        return Check("sysctl.multipath_hash", FAIL,
                     f"{key} = 3 but fib_multipath_hash_fields {fields if fields is None else hex(fields)} lacks "
                     "the ports: every source port takes the same path", fix, reads)
    return Check("sysctl.multipath_hash", FAIL,
                 f"{key} = {policy}: ECMP ignores ports, so every flow to a peer takes the same path and "
                 "port steering cannot move traffic", fix, reads)


def check_rp_filter(f: Facts) -> Check:
    name = "sysctl.rp_filter"
    all_v = _int(f.sysctl.get("net.ipv4.conf.all.rp_filter"))
    if f.nics:
        reads = "net.ipv4.conf.{all," + ",".join(n.ifname for n in f.nics) + "}.rp_filter"
        strict, seen = [], []
        for n in f.nics:
            own = _int(f.sysctl.get(f"net.ipv4.conf.{n.ifname}.rp_filter"))
            if own is None and all_v is None:
                continue
            eff = max(own or 0, all_v or 0)  # the kernel uses the larger of all and the interface's
            seen.append(f"{n.ifname}={eff}")
            if eff == 1:
                strict.append(n.ifname)
        if not seen:
            return Check(name, SKIP, "rp_filter not readable", "", reads)
        if strict:
            # the kernel takes the larger of `all` and the interface's: 2 on the NIC is loose whatever `all` is
            keys = " ".join(f"net.ipv4.conf.{i}.rp_filter=2" for i in strict)
            return Check(name, FAIL, f"strict reverse-path filter on {', '.join(strict)}: replies that come back "
                         "over another plane after a failover are dropped",
                         f"sysctl -w {keys}  (2 = loose; persist it in /etc/sysctl.d/)", reads)
        return Check(name, OK, f"not strict on fabric NICs ({', '.join(seen)}; 0 off, 2 loose)", "", reads)
    reads = "net.ipv4.conf.{all,default}.rp_filter"
    dflt = _int(f.sysctl.get("net.ipv4.conf.default.rp_filter"))
    if all_v is None and dflt is None:
        return Check(name, SKIP, "rp_filter not readable", "", reads)
    if 1 in (all_v, dflt):
        return Check(name, WARN, f"strict reverse-path filter (all={all_v}, default={dflt}): replies over another "
                     "plane are dropped on any fabric NIC that inherits it (pass --config to check the fabric NICs)",
                     "sysctl -w net.ipv4.conf.<each fabric NIC>.rp_filter=2  (loose on the planes only; persist it "
                     "in /etc/sysctl.d/)", reads)
    return Check(name, OK, f"not strict (all={all_v}, default={dflt})", "", reads)


def check_icmp_errors(f: Facts) -> Check:
    key = "net.ipv4.icmp_errors_use_inbound_ifaddr"
    reads = f"{key}, net.ipv4.ip_forward"
    v, fwd = _int(f.sysctl.get(key)), _int(f.sysctl.get("net.ipv4.ip_forward"))
    if v is None:
        return Check("sysctl.icmp_errors", SKIP, f"{key} not readable", "", reads)
    if v == 1:
        return Check("sysctl.icmp_errors", OK, f"{key} = 1: ICMP errors name the interface they came in on", "",
                     reads)
    if not fwd:
        return Check("sysctl.icmp_errors", OK, f"{key} = 0, harmless here: this host does not forward "
                     "(ip_forward = 0), so it sends no time-exceeded that a trace would read", "", reads)
    return Check("sysctl.icmp_errors", WARN, f"{key} = 0 on a forwarding host: its ICMP errors carry its "
                 "primary address, so path traces through it cannot name the link",
                 _sysctl_cmd(key, "1", f.netns), reads)


def _ranges(text: str | None) -> list[tuple[int, int]]:
    out = []
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            out.append((int(lo), int(hi or lo)))
        except ValueError:
            continue
    return out


def check_port_range(f: Facts) -> Check:
    key = "net.ipv4.ip_local_port_range"
    reads = f"{key}, net.ipv4.ip_local_reserved_ports"
    raw = f.sysctl.get(key)
    try:
        lo, hi = (int(x) for x in str(raw).split())
    except (TypeError, ValueError):
        return Check("sysctl.port_range", SKIP, f"{key} not readable ({raw!r})", "", reads)
    a_lo, a_hi = PROBE_PORT_BASE, PROBE_PORT_BASE + max(1, f.discovery_ports) - 1
    if hi < a_lo or lo > a_hi:
        return Check("sysctl.port_range", OK, f"ephemeral ports {lo}-{hi} stay clear of the agent's {a_lo}-{a_hi}",
                     "", reads)
    reserved = _ranges(f.sysctl.get("net.ipv4.ip_local_reserved_ports"))
    if all(any(r_lo <= p <= r_hi for r_lo, r_hi in reserved) for p in range(max(lo, a_lo), min(hi, a_hi) + 1)):
        return Check("sysctl.port_range", OK, f"ephemeral ports {lo}-{hi} overlap the agent's {a_lo}-{a_hi}, "
                     "but those are reserved (ip_local_reserved_ports)", "", reads)
    # the list is the host's whole list: the fix keeps what it reserves already
    merged = ",".join(f"{r_lo}-{r_hi}" if r_hi > r_lo else str(r_lo) for r_lo, r_hi in sorted({*reserved, (a_lo, a_hi)}))
    return Check("sysctl.port_range", WARN,
                 f"ephemeral ports {lo}-{hi} overlap the agent's probe ports {a_lo}-{a_hi}: a connection may take "
                 "one and the agent cannot probe that path",
                 _sysctl_cmd("net.ipv4.ip_local_reserved_ports", merged, f.netns)
                 + f"  (persist it in /etc/sysctl.d/; or set {key} to end below {a_lo})", reads)


_CAPS = ((CAP_NET_ADMIN, "net_admin", FAIL, "the agent cannot size its probe sockets' receive buffers "
          "(SO_RCVBUFFORCE) or change routes (failover)"),
         (CAP_NET_RAW, "net_raw", FAIL, "the agent cannot open its raw probe sockets"),
         (CAP_SYS_NICE, "sys_nice", WARN, "the probe thread cannot run SCHED_FIFO: on a busy host replies come "
          "late and paths look slow (or set probe.rt_priority: 0)"))


def check_caps(f: Facts) -> list[Check]:
    out = []
    for bit, name, bad, why in _CAPS:
        cname = f"cap.{name}"
        if f.cap_eff is None:
            out.append(Check(cname, SKIP, "CapEff not readable in /proc/self/status", "", "/proc/self/status"))
        elif f.cap_eff >> bit & 1:
            out.append(Check(cname, OK, f"CAP_{name.upper()} held (uid {f.uid})", "", "/proc/self/status CapEff"))
        elif bit == CAP_SYS_NICE and f.rt_priority == 0:
            out.append(Check(cname, OK, f"CAP_SYS_NICE not needed: probe.rt_priority is 0 (uid {f.uid})", "",
                             "/proc/self/status CapEff"))
        elif bit == CAP_SYS_NICE and f.rtprio is not None and f.rtprio >= f.rt_priority:
            # what the systemd unit does: LimitRTPRIO= allows SCHED_FIFO up to it, without the capability
            out.append(Check(cname, OK, f"CAP_SYS_NICE not held, but RLIMIT_RTPRIO {f.rtprio} allows SCHED_FIFO at "
                             f"the probe thread's priority {f.rt_priority} (uid {f.uid})", "",
                             "/proc/self/status CapEff, getrlimit(RLIMIT_RTPRIO)"))
        else:
            out.append(Check(cname, bad, f"CAP_{name.upper()} missing for this process (uid {f.uid}): {why}",
                             f"run the agent as root or grant it: AmbientCapabilities=CAP_{name.upper()} "
                             "in its systemd unit" + (f" or LimitRTPRIO={f.rt_priority}" if bit == CAP_SYS_NICE else "")
                             + " (doctor checks its own process: run it like the agent, docs/systemd.md)",
                             "/proc/self/status CapEff"))
    return out


def check_config(f: Facts) -> Check:
    if not f.config_path:
        return Check("config", SKIP, "no --config given: NIC and route checks skipped",
                     "pass the agent's config: linkpass doctor --config /etc/linkpass/agent.yaml", "")
    if f.config_error:
        return Check("config", FAIL, f"cannot use it: {f.config_error}", "fix the field named above; "
                     "linkpass/agent/config.py documents every field", f.config_path)
    if f.key_error:
        return Check("config", FAIL, f"parsed, but the fleet key: {f.key_error}",
                     "the agent will not start without it; copy the fleet's key file there (chmod 600)", f.config_path)
    return Check("config", OK, f"{len(f.nics)} NICs, {len(f.peers)} peers, API port {f.api_port}", "", f.config_path)


_NEIGH_BAD = {"FAILED", "INCOMPLETE"}


def check_nics(f: Facts) -> list[Check]:
    if not f.nics:
        return []
    if f.links is None:
        return [Check(f"nic.{n.ifname}", SKIP, f"cannot list links: {f.links_error}", "", "ip -j addr show")
                for n in f.nics]
    out = []
    for n in f.nics:
        cname, reads = f"nic.{n.ifname}", "ip -j addr show; ip -j neigh show; ip -j route get"
        link = f.links.get(n.ifname)
        pre = f"ip -n {f.netns} " if f.netns else "ip "
        if link is None:
            out.append(Check(cname, FAIL, f"plane {n.plane}: {n.ifname} does not exist",
                             f"check the NIC name ({pre}link) and nics[].ifname in the config", reads))
            continue
        flags = set(link.get("flags") or [])
        if "UP" not in flags:
            out.append(Check(cname, FAIL, f"plane {n.plane}: {n.ifname} is administratively down",
                             f"{pre}link set {n.ifname} up", reads))
            continue
        if "LOWER_UP" not in flags or link.get("operstate") in ("DOWN", "LOWERLAYERDOWN"):
            out.append(Check(cname, FAIL, f"plane {n.plane}: {n.ifname} has no carrier (operstate "
                             f"{link.get('operstate')}): cable, optic or switch port", "check the link on the switch "
                             f"side; `{pre}-s link show {n.ifname}` for errors", reads))
            continue
        addrs = [a.split("/")[0] for a in link.get("addrs", [])]
        if n.addr not in addrs:
            out.append(Check(cname, FAIL, f"plane {n.plane}: {n.ifname} lacks {n.addr} (has "
                             f"{', '.join(link.get('addrs', [])) or 'no IPv4 address'})",
                             f"{pre}addr add {n.addr}/31 dev {n.ifname}  (use the plane's prefix length)", reads))
            continue
        base = f"plane {n.plane}: {n.ifname} up, {n.addr}"
        if not n.gateway:
            out.append(Check(cname, OK, base + ", no gateway configured (needed only with routes.enabled)", "", reads))
            continue
        states = f.neigh.get(n.ifname, {}).get(n.gateway)
        if states and not _NEIGH_BAD & set(states):
            out.append(Check(cname, OK, f"{base}, gateway {n.gateway} is a neighbour ({'/'.join(states)})", "", reads))
            continue
        if states:
            out.append(Check(cname, FAIL, f"{base}, but gateway {n.gateway} does not answer ARP "
                             f"({'/'.join(states)})", f"check the leaf's port; `{pre}neigh show dev {n.ifname}`",
                             reads))
            continue
        rt = f.gw_route.get(n.gateway)
        if rt and rt.get("dev") == n.ifname:
            out.append(Check(cname, OK, f"{base}, gateway {n.gateway} routed on-link via {n.ifname} "
                             "(no neighbour entry yet)", "", reads))
            continue
        via = f" (routed via {rt.get('dev')})" if rt else ""
        out.append(Check(cname, FAIL, f"{base}, but gateway {n.gateway} is neither a neighbour nor reachable via "
                         f"{n.ifname}{via}", f"check nics[].gateway against `{pre}route show dev {n.ifname}`", reads))
    return out


def check_rdma(f: Facts) -> Check:
    reads = f"{RDMA_DIR}/*/ports/*/state"
    if not f.rdma:
        return Check("rdma", WARN, "no RDMA devices: routes and entropy still work, RDMA QPs cannot be steered",
                     "if this host should have RDMA NICs: load the driver (e.g. modprobe mlx5_ib) and install "
                     "rdma-core; `ibv_devices` lists them", reads)
    parts, active = [], 0
    for dev in f.rdma:
        ports = dev.get("ports") or {}
        act = [p for p, s in ports.items() if "ACTIVE" in str(s)]
        active += len(act)
        nd = ",".join(dev.get("netdevs") or [])
        parts.append(f"{dev['name']}{'(' + nd + ')' if nd else ''} {len(act)}/{len(ports)} ports active")
    if not active:
        return Check("rdma", WARN, f"RDMA devices but no active port: {'; '.join(parts)}",
                     "check cabling/subnet manager; `rdma link` shows port states", reads)
    return Check("rdma", OK, "; ".join(parts), "", reads)


def _nexthops(route: dict) -> list[dict]:
    if route.get("nexthops"):
        return list(route["nexthops"])
    return [{"gateway": route.get("gateway"), "dev": route.get("dev"), "flags": route.get("flags") or []}]


def _prefix_len(route: dict) -> int:
    dst = route.get("dst", "")
    if dst == "default":
        return 0
    return int(dst.split("/")[1]) if "/" in dst else 32


def check_routes(f: Facts) -> list[Check]:
    if not f.peers:
        return []
    if f.routes_error:
        return [Check(f"route.{p.name}", SKIP, f"cannot read routes: {f.routes_error}", "", "ip -j route show match")
                for p in f.peers]
    plane_of = {n.ifname: n.plane for n in f.nics}
    all_planes = sorted(plane_of.values())
    pre = f"ip -n {f.netns} " if f.netns else "ip "
    out = []
    for p in f.peers:
        cname, reads = f"route.{p.name}", f"ip -j route show match {p.service}"
        routes = [r for r in f.peer_routes.get(p.service, []) if r.get("type", "unicast") == "unicast"]
        bad_types = [r.get("type") for r in f.peer_routes.get(p.service, []) if r.get("type", "unicast") != "unicast"]
        if not routes:
            what = f" ({', '.join(bad_types)} route)" if bad_types else ""
            out.append(Check(cname, FAIL, f"no route to {p.name} ({p.service}){what}: traffic to it fails",
                             f"add the baseline route over every plane, e.g. {pre}route replace {p.service} "
                             "nexthop via <gw p0> dev <nic p0> nexthop via <gw p1> dev <nic p1>", reads))
            continue
        best = max(routes, key=_prefix_len)
        hops = _nexthops(best)
        who = " (set by the agent)" if str(best.get("protocol")) in (str(RTPROT_LINKPASS), "linkpass") else ""
        used = sorted({plane_of[h["dev"]] for h in hops if h.get("dev") in plane_of
                       and not {"dead", "linkdown"} & set(h.get("flags") or [])})
        dead = [h["dev"] for h in hops if {"dead", "linkdown"} & set(h.get("flags") or [])]
        other = sorted({h.get("dev") for h in hops if h.get("dev") not in plane_of})
        desc = f"{best.get('dst')} via " + ", ".join(
            f"{h.get('dev')}" + (f" {h['gateway']}" if h.get("gateway") else "") for h in hops) + who
        if not used:
            out.append(Check(cname, FAIL, f"{p.name} ({p.service}): {desc}: no fabric plane carries it"
                             + (f" (leaves via {', '.join(map(str, other))})" if other else ""),
                             f"add the baseline route over the fabric NICs ({pre}route show match {p.service})",
                             reads))
            continue
        planes = ",".join(map(str, used))
        if used != all_planes or dead:
            miss = sorted(set(all_planes) - set(used))
            why = (f"nexthop {', '.join(dead)} dead/linkdown" if dead else
                   "failed over by the agent" if who else "missing from the route")
            out.append(Check(cname, WARN, f"{p.name} ({p.service}): only plane(s) {planes} of "
                             f"{','.join(map(str, all_planes))}; plane(s) {','.join(map(str, miss))} {why}: {desc}",
                             "if no plane is failing (`linkpass paths`), restore the baseline route over all planes",
                             reads))
            continue
        out.append(Check(cname, OK, f"{p.name} ({p.service}) over plane(s) {planes}: {desc}", "", reads))
    return out


def _dur_us(us: int) -> str:
    if us >= 1_000_000:
        return f"{us / 1e6:g} s"
    if us >= 1000:
        return f"{us / 1e3:g} ms"
    return f"{us} µs"


def check_clock(f: Facts) -> Check:
    reads = "adjtimex(2)"
    if f.clock is None:
        return Check("clock", SKIP, f"adjtimex failed: {f.clock_error}", "", reads)
    c = f.clock
    synced = c["state"] != TIME_ERROR and not c["status"] & STA_UNSYNC
    err = f"estimated error {_dur_us(c['esterror_us'])}, max {_dur_us(c['maxerror_us'])}"
    if synced:
        return Check("clock", OK, f"synchronized ({err})", "", reads)
    return Check("clock", WARN, f"not synchronized (kernel says STA_UNSYNC; {err}): one-way delays and event "
                 "times across hosts cannot be compared", "start NTP/PTP: `chronyc tracking` or "
                 "`timedatectl timesync-status`; for PTP check ptp4l/phc2sys", reads)


# how the agent check words the states that are not ok: dark ones as "down", the others by name
_HELD_OUT_WORDS = "/".join(s.value for s in State if s in HELD_OUT)  # degraded/recovering
_WATCHED = frozenset(s for s in USABLE if s.health is not Level.OK)  # in use, but a probe was lost
_WATCHED_WORDS = "/".join(s.value for s in State if s in _WATCHED)  # suspect


def check_agent(f: Facts) -> Check:
    where = f"127.0.0.1:{f.api_port}" + (f" in {f.netns}" if f.netns else "")
    reads = f"GET http://127.0.0.1:{f.api_port}/v1/state"
    if f.agent_rows is None:
        return Check("agent", WARN, f"no agent answers on {where} ({f.agent_error})",
                     "start it: linkpass agent --config FILE (in this namespace); if it runs, check api.port",
                     reads)
    rows = f.agent_rows
    down = [r for r in rows if state_of(r.get("state")) in DARK]
    held = [r for r in rows if state_of(r.get("state")) in HELD_OUT]
    watched = [r for r in rows if state_of(r.get("state")) in _WATCHED]
    if not rows:
        return Check("agent", WARN, f"answers on {where} but probes no path (no peers, or discovery found none)",
                     "check peers in its config and its log (event discovery)", reads)
    detail = f"answers on {where}: {len(rows)} paths, {len(down)} down" + (
        f", {len(held)} {_HELD_OUT_WORDS}" if held else "")
    if down:
        names = sorted({f"{r.get('peer')}/p{r.get('plane')}" for r in down})
        detail += f" ({', '.join(names[:6])}{' …' if len(names) > 6 else ''})"
    if watched:
        detail += f", {len(watched)} {_WATCHED_WORDS}"
    if len(down) == len(rows):
        return Check("agent", FAIL, detail, "every path is down: look at the NICs and the leaf; `linkpass paths`",
                     reads)
    if worst(health_of(r.get("state")) for r in rows) is not Level.OK:
        return Check("agent", WARN, detail, "`linkpass paths` shows loss and state per path", reads)
    return Check("agent", OK, detail, "", reads)


def check_coordinator(f: Facts) -> Check:
    reads = "GET <coordinator>/v1/whoami with the config's token_file"
    if f.coordinator_url is None:
        return Check("coordinator", SKIP, "no coordinator in the config: the agent detects and fails over alone",
                     "for fleet-wide localization and drains add coordinator: {url, token_file} (docs/coordinator.md)",
                     reads)
    if f.coordinator_refused:
        return Check("coordinator", FAIL, f"{f.coordinator_url} refuses this agent's token ({f.coordinator_error})",
                     "put this host's agent token in token_file (`linkpass coordinator token HOST` on the "
                     "coordinator's host makes it)", reads)
    if f.coordinator_whoami is None:
        return Check("coordinator", WARN, f"{f.coordinator_url} does not answer ({f.coordinator_error})",
                     "the agent fails over alone meanwhile; check the URL, the route to it and that it runs "
                     "(`linkpass status` on its host)", reads)
    who = f.coordinator_whoami
    if who.get("role") != "agent":
        return Check("coordinator", FAIL, f"{f.coordinator_url} knows the token as {who.get('name')!r} with role "
                     f"{who.get('role')!r}; agents need role 'agent'", "use this host's agent token, not a reader "
                     "or operator one", reads)
    if f.agent_name is not None and who.get("host") not in (None, f.agent_name):
        return Check("coordinator", FAIL, f"{f.coordinator_url} knows the token as agent {who.get('host')!r}, but this "
                     f"agent reports as {f.agent_name!r}: it would be refused", "make this host's own token with "
                     f"`linkpass coordinator token {f.agent_name}` on the coordinator's host", reads)
    if f.coordinator_url.startswith("http://"):
        return Check("coordinator", WARN, f"{f.coordinator_url} accepts this agent's token, over plain HTTP: the token "
                     "and reports cross the network in cleartext", "use an https:// url with coordinator.ca_file and "
                     "drop insecure_http (docs/security.md, TLS set-up)", reads)
    return Check("coordinator", OK, f"{f.coordinator_url} accepts this agent's token ({who.get('name')}, role agent)",
                 "", reads)


def run_checks(f: Facts) -> list[Check]:
    """Every check, in the order they print. Pure."""
    out = [check_multipath_hash(f), check_rp_filter(f), check_icmp_errors(f), check_port_range(f)]
    out += check_caps(f)
    out.append(check_config(f))
    out += check_nics(f)
    out.append(check_rdma(f))
    out += check_routes(f)
    out.append(check_clock(f))
    out.append(check_agent(f))
    out.append(check_coordinator(f))
    return out


_VERDICT = {Level.OK: "ready", Level.WARNING: "ready, with warnings", Level.CRITICAL: "not ready"}


def health(checks: list[Check]) -> Level:
    """The worst level among the checks: what doctor's exit code and verdict follow."""
    return worst(LEVEL_OF_STATUS[c.status] for c in checks)


def report(checks: list[Check], host: str, netns: str | None, config: str | None) -> dict:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    verdict = _VERDICT[health(checks)]
    return {"host": host, "netns": netns, "config": config, "verdict": verdict, "counts": counts,
            "checks": [c.to_dict() for c in checks]}

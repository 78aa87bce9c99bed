"""The I/O half of `linkpass doctor`: reads the system (or one network namespace) into `Facts`."""
from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
from typing import Any, Callable

from ..kernel.caps import read_cap_eff, rtprio_limit
from .checks import RDMA_DIR, Facts, NicCfg, PeerCfg


class _Timex(ctypes.Structure):
    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
                ("time_sec", ctypes.c_long), ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
                ("ppsfreq", ctypes.c_long), ("jitter", ctypes.c_long), ("shift", ctypes.c_int),
                ("stabil", ctypes.c_long), ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long),
                ("errcnt", ctypes.c_long), ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int),
                ("_pad", ctypes.c_int * 11)]


def read_clock() -> dict:
    """adjtimex(2) with modes = 0: reads, changes nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    tx = _Timex()
    state = libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return {"state": state, "status": tx.status, "esterror_us": tx.esterror, "maxerror_us": tx.maxerror}


def read_rdma(root: str = RDMA_DIR) -> list[dict] | None:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    out = []
    for name in names:
        ports, netdevs = {}, []
        pdir = os.path.join(root, name, "ports")
        try:
            pnums = sorted(os.listdir(pdir), key=lambda s: int(s) if s.isdigit() else 0)
        except OSError:
            pnums = []
        for pn in pnums:
            try:
                with open(os.path.join(pdir, pn, "state")) as fh:
                    ports[pn] = fh.read().strip()
            except OSError:
                ports[pn] = "?"
            try:
                with open(os.path.join(pdir, pn, "gid_attrs", "ndevs", "0")) as fh:
                    nd = fh.read().strip()
                if nd and nd not in netdevs:
                    netdevs.append(nd)
            except OSError:
                pass
        out.append({"name": name, "ports": ports, "netdevs": netdevs})
    return out


def _ip_json(netns: str | None, *args: str) -> Any:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-j", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=5)
    if proc.returncode != 0:
        raise OSError(f"`{' '.join(argv)}`: {proc.stderr.strip() or proc.returncode}")
    return json.loads(proc.stdout or "[]")


def _read_sysctls(netns: str | None, keys: list[str]) -> dict[str, str | None]:
    def read() -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for k in keys:
            try:
                with open("/proc/sys/" + k.replace(".", "/")) as fh:
                    out[k] = " ".join(fh.read().split())
            except OSError:
                out[k] = None
        return out

    if netns is None:
        return read()
    from ..kernel import netns as ns_io

    return ns_io.run_in_netns(netns, read)


def _tcp_socket(netns: str | None) -> socket.socket:
    """A TCP socket in `netns` (this process's own namespace when None)."""
    if netns:
        from ..kernel import netns as ns_io

        return ns_io.socket_in_netns(netns, socket.AF_INET, socket.SOCK_STREAM)
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def _http_get_json(netns: str | None, port: int, path: str, timeout: float = 2.0) -> Any:
    import http.client

    sock = _tcp_socket(netns)
    sock.settimeout(timeout)
    try:
        sock.connect(("127.0.0.1", port))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.sock = sock
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status} from {path}")
        return json.loads(body)
    finally:
        sock.close()


def _ask_coordinator(f: Facts, netns: str | None, link) -> None:
    """whoami at the coordinator, from inside `netns` (where the agent's requests come from)."""
    from urllib.parse import urlparse

    from ..agent.config import ConfigError
    from ..agent.coordinator_link import tls_context
    from ..control.tokens import TokenFileError, read_token

    try:
        token = read_token(link.token_file)
    except (OSError, TokenFileError) as exc:
        f.coordinator_refused, f.coordinator_error = True, f"token_file: {getattr(exc, 'strerror', None) or exc}"
        return
    try:
        tls = tls_context(link)
    except ConfigError as exc:
        f.coordinator_error = str(exc)
        return
    u = urlparse(link.url)
    host, port = u.hostname, u.port or (80 if tls is None else 443)
    sock = None
    try:
        sock = _tcp_socket(netns)
        sock.settimeout(2.0)
        sock.connect((host, port))
        if tls is not None:  # the agent's own TLS settings: what it would see, the doctor sees
            sock = tls.wrap_socket(sock, server_hostname=host)
        import http.client

        conn = http.client.HTTPConnection(host, port, timeout=2.0)
        conn.sock = sock
        conn.request("GET", "/v1/whoami", headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status in (401, 403):
            f.coordinator_refused, f.coordinator_error = True, f"HTTP {resp.status}"
        elif resp.status != 200:
            f.coordinator_error = f"HTTP {resp.status}"
        else:
            f.coordinator_whoami = json.loads(body)
    except (OSError, ValueError) as exc:
        f.coordinator_error = str(getattr(exc, "strerror", None) or exc)
    finally:
        if sock is not None:
            sock.close()


SYSCTLS = ["net.ipv4.fib_multipath_hash_policy", "net.ipv4.fib_multipath_hash_fields",
           "net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter",
           "net.ipv4.icmp_errors_use_inbound_ifaddr", "net.ipv4.ip_forward",
           "net.ipv4.ip_local_port_range", "net.ipv4.ip_local_reserved_ports"]  # and each NIC's rp_filter


def gather(netns: str | None = None, config_path: str | None = None, api_port: int | None = None,
           ip_json: Callable[..., Any] = _ip_json) -> Facts:
    """Read everything the checks need. Never raises for what the system says; errors become facts."""
    f = Facts(netns=netns, config_path=config_path, uid=os.geteuid())
    cfg = _config_facts(f, config_path) if config_path else None
    if api_port is not None:
        f.api_port = api_port
    f.sysctl = _read_sysctls(netns, SYSCTLS + [f"net.ipv4.conf.{n.ifname}.rp_filter" for n in f.nics])
    f.cap_eff = read_cap_eff()
    f.rtprio = rtprio_limit()
    if f.nics:
        _link_facts(f, netns, ip_json)
    if f.peers:
        _route_facts(f, netns, ip_json)
    f.rdma = read_rdma()
    _clock_facts(f)
    if cfg is not None and cfg.coordinator is not None:
        _ask_coordinator(f, netns, cfg.coordinator)
    _agent_facts(f, netns)
    return f


def _config_facts(f: Facts, config_path: str):
    """The agent's config (NICs, peers, ports, coordinator) and whether its fleet key reads; the
    config, or None when it does not parse."""
    from ..agent.config import ConfigError, load_text

    try:
        with open(config_path) as fh:
            cfg = load_text(fh.read(), config_path)
    except OSError as exc:
        f.config_error = f"cannot read {config_path} ({exc.strerror})"
        return None
    except ConfigError as exc:
        f.config_error = str(exc)
        return None
    f.nics = tuple(NicCfg(n.plane, n.ifname, n.addr, n.gateway) for n in cfg.nics)
    f.peers = tuple(PeerCfg(p.name, p.service) for p in cfg.peers)
    f.discovery_ports = cfg.discovery_ports
    f.api_port = cfg.api_port
    f.agent_name = cfg.name
    if cfg.coordinator is not None:
        f.coordinator_url = cfg.coordinator.url
    f.rt_priority = cfg.rt_priority
    f.key_error = fleet_key_problem(cfg.fleet_key_file)
    return cfg


def fleet_key_problem(path: str) -> str | None:
    """Why the agent would refuse its fleet key file, or None. Run as root, doctor judges a key
    that another uid owns as that uid reads it: the systemd unit runs the agent as the key's
    owner (the linkpass user), and the agent accepts a key owned by its own uid."""
    from ..agent.config import ConfigError, read_fleet_key
    from ..agent.keyfile import MAX_FILE_BYTES, load_fleet_key, mode_problem

    try:
        st = os.stat(path)
    except OSError:
        st = None
    if os.geteuid() != 0 or st is None or st.st_uid == 0:
        try:
            load_fleet_key(path)
        except ConfigError as exc:
            return str(exc)
        return None
    problem = mode_problem(st.st_mode, st.st_uid, st.st_uid)
    if problem:
        fix = f"chmod 600 {path}" if "owner only" in problem else "replace it with a file only its owner can read"
        return f"fleet_key_file: {path} {problem}: {fix}"
    try:
        with open(path, "rb") as fh:
            read_fleet_key(fh.read(MAX_FILE_BYTES + 1), f"fleet_key_file: {path}")
    except (OSError, ConfigError) as exc:
        return str(exc)
    return None


def _link_facts(f: Facts, netns: str | None, ip_json: Callable[..., Any]) -> None:
    """Links with their IPv4 addresses, neighbours, and the route to each NIC's gateway."""
    try:
        f.links = {}
        for link in ip_json(netns, "addr", "show"):
            f.links[link["ifname"]] = {
                "operstate": link.get("operstate"), "flags": link.get("flags", []),
                "addrs": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                          if a.get("family") == "inet"]}
        for n in ip_json(netns, "neigh", "show"):
            if n.get("dev"):
                f.neigh.setdefault(n["dev"], {})[n.get("dst")] = list(n.get("state") or [])
        for nic in f.nics:
            if nic.gateway:
                try:
                    got = ip_json(netns, "route", "get", nic.gateway)
                    f.gw_route[nic.gateway] = got[0] if got else None
                except OSError:
                    f.gw_route[nic.gateway] = None
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        f.links, f.links_error = None, str(exc)


def _route_facts(f: Facts, netns: str | None, ip_json: Callable[..., Any]) -> None:
    """The routes to each peer's service address."""
    try:
        for p in f.peers:
            f.peer_routes[p.service] = list(ip_json(netns, "route", "show", "match", p.service))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        f.routes_error = str(exc)


def _clock_facts(f: Facts) -> None:
    try:
        f.clock = read_clock()
    except OSError as exc:
        f.clock_error = str(exc)


def _agent_facts(f: Facts, netns: str | None) -> None:
    """The running agent's path table, from its local API."""
    try:
        rows = _http_get_json(netns, f.api_port, "/v1/state")
        f.agent_rows = rows if isinstance(rows, list) else []
    except (OSError, ValueError) as exc:
        f.agent_error = str(getattr(exc, "strerror", None) or exc)

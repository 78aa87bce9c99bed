"""What this host shows of itself, for the agent config's `auto` values (agent/config.py: HostFacts).

The host name is $LINKPASS_HOST_NAME when set (a pod takes it from its node's name), else the
short host name. Addresses are read with iproute2's JSON output in the agent's own network namespace: every address with its
interface and prefix length, and every route's next hop with its interface. Read once at start
and on each reload; never on the probe path.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess

from .config import ConfigError, HostFacts


def _ip_json(*args: str) -> list:
    try:
        out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"auto: cannot read this host's addresses (`ip -j {' '.join(args)}`: {exc})") from None
    if out.returncode != 0:
        raise ConfigError(f"auto: `ip -j {' '.join(args)}` failed: {out.stderr.strip()}")
    try:
        return json.loads(out.stdout or "[]")
    except ValueError:
        raise ConfigError(f"auto: `ip -j {' '.join(args)}` gave no JSON (iproute2 too old?)") from None


def read_host_facts() -> HostFacts:
    addrs = []
    for link in _ip_json("addr", "show"):
        for a in link.get("addr_info", ()):
            if a.get("scope") == "host" or "local" not in a:
                continue  # loopback's own 127.0.0.1/::1 name no host
            addrs.append((link["ifname"], f"{a['local']}/{a['prefixlen']}"))
    hops = []
    for family in ("-4", "-6"):
        for r in _ip_json(family, "route", "show"):
            if "gateway" in r and "dev" in r:
                hops.append((r["dev"], r["gateway"]))
            for nh in r.get("nexthops", ()):
                if "gateway" in nh and "dev" in nh:
                    hops.append((nh["dev"], nh["gateway"]))
    # $LINKPASS_HOST_NAME first: a Kubernetes pod sets it from spec.nodeName
    name = os.environ.get("LINKPASS_HOST_NAME") or socket.gethostname().split(".")[0]
    return HostFacts(name, tuple(addrs), tuple(hops))

"""One agent config for every testbed host: `--check-config` shows what `auto` found in each
host's namespace, and four agents started from that one file probe each other (what /readyz
waits for: tests/unit/test_agent_readyz.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import yaml

from linkpass.agent.config import agent_id_of
from linkpass.core.names import host_name
from linkpass.testbed.topology import host_link_addrs, nic_ifname, plane_host_block

from support.ports import free_port
from support.processes import LogDrain, stop_processes

LINKPASS = [sys.executable, "-m", "linkpass.cli"]
HOSTS = range(4)


def fleet_config(fab, directory: str, api_port: int) -> str:
    key = os.path.join(directory, "fleet.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(bytes(range(32)).hex())
    planes = range(fab.spec.planes)
    doc = {"agent_id": "auto", "name": "auto", "service": "auto", "nics": "auto", "fleet_key_file": key,
           "host": {"service_subnet": "198.18.0.0/20", "management_subnet": fab.mgmt_subnet,
                    "planes": [{"plane": p, "subnet": str(plane_host_block(p))} for p in planes]},
           "peers": [{"name": host_name(i), "agent_id": agent_id_of(fab.service_addr(i)),
                      "service": fab.service_addr(i), "nics": {p: fab.nic_addr(i, p) for p in planes}} for i in HOSTS],
           "probe": {"interval_ms": 2, "lanes_dir": os.path.join(directory, "lanes")}, "api": {"port": api_port}, "metrics": {"address": "auto", "port": 0},
           "routes": {"enabled": False}, "entropy": {"enabled": False}}
    path = os.path.join(directory, "fleet.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    return path


def in_host(fab, i: int, *cmd: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, LINKPASS_HOST_NAME=host_name(i))
    return subprocess.run(["ip", "netns", "exec", fab.netns(host_name(i)), *cmd], capture_output=True, text=True,
                          timeout=60, env=env, **kw)


def test_one_config_file_serves_every_testbed_host(clean_faults, tmp_path):
    fab = clean_faults
    port = free_port()
    path = fleet_config(fab, str(tmp_path), port)
    for i in HOSTS:  # what `auto` finds in each host's namespace
        out = in_host(fab, i, *LINKPASS, "agent", "--config", path, "--check-config", "-o", "json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["name"], doc["service"], doc["agent_id"]) == (host_name(i), fab.service_addr(i),
                                                                  agent_id_of(fab.service_addr(i)))
        assert doc["nics"] == [{"plane": p, "ifname": nic_ifname(p), "addr": fab.nic_addr(i, p),
                                "gateway": str(host_link_addrs(p, i)[0])} for p in range(fab.spec.planes)]
        assert doc["metrics"] == f"{fab.mgmt_addr(i)}:0" and doc["peers"] == 3  # itself left out
    table = in_host(fab, 0, *LINKPASS, "agent", "--config", path, "--check-config")
    assert table.returncode == 0 and f"plane 0: {nic_ifname(0)} {fab.nic_addr(0, 0)} via" in table.stdout
    env = {i: dict(os.environ, LINKPASS_HOST_NAME=host_name(i)) for i in HOSTS}
    procs = {i: subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(i)), *LINKPASS, "agent", "--config", path,
                                  "--max-seconds", "60"], stderr=subprocess.PIPE, text=True, env=env[i])
             for i in HOSTS}
    drains = {i: LogDrain(p.stderr) for i, p in procs.items()}
    try:
        for d in drains.values():
            assert d.wait_for('"event": "started"', 60), d.text(0)[-2000:]
        code = "import urllib.request, sys; r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status, r.read().decode())"
        ready = in_host(fab, 0, sys.executable, "-c", code, f"http://127.0.0.1:{port}/readyz")
        assert ready.stdout.startswith("200 ready"), ready.stdout + ready.stderr
        deadline, rows = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            out = in_host(fab, 0, *LINKPASS, "paths", "--port", str(port), "-o", "json")
            rows = json.loads(out.stdout) if out.stdout.startswith("[") else []
            if rows and all(r["replies"] > 50 for r in rows):
                break
            time.sleep(0.5)
        assert {r["peer"] for r in rows} == {"h1", "h2", "h3"} and all(r["replies"] > 50 for r in rows), rows
    finally:
        stop_processes(procs.values())

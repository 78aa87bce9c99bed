"""FRR's bfdd on testbed hosts: the peer LinkPass is measured against.

Runs zebra + bfdd (Debian `frr`) inside host namespaces, FRR's own way (`-N <netns>`: config in
/etc/frr/<netns>/, sockets and pids in /var/run/frr/<netns>/), with multihop BFD sessions between
host NIC addresses at a chosen interval (FRR's minimum: 10 ms × 3). Session state changes are
read from bfdd's log, which carries µs timestamps, so a benchmark can line them up with the time
a testbed fault took effect.

Multihop, not single-hop: the sessions run host to host across the fabric, as LinkPass's probes
do; a multihop session's packets take *one* ECMP path (their UDP source port is fixed), so BFD
watches one path per session. Minimum TTL is lowered to fit the testbed's router hops.

Everything this module creates carries the testbed prefix (directories) or lives inside the
testbed's namespaces (processes, which `testbed down` kills); `stop()` removes the directories.
"""
from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from ..core.names import host_name
from .topology import Fabric

FRR_BIN = "/usr/lib/frr"
_STATE = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) BFD: \[[^\]]+\] state-change: \[mhop:\w+ peer:(\S+) "
                    r"local:(\S+) [^\]]*\] (\w+) -> (\w+)")


class FrrError(RuntimeError):
    pass


def available() -> bool:
    return os.path.exists(f"{FRR_BIN}/bfdd") and os.path.exists(f"{FRR_BIN}/zebra") and shutil.which("vtysh") is not None


@dataclass(frozen=True)
class StateChange:
    wall_ns: int  # CLOCK_REALTIME of the log line
    peer: str
    local: str
    old: str
    new: str


def parse_state_change(line: str) -> StateChange | None:
    """One bfdd log line -> its session state change, or None."""
    m = _STATE.match(line)
    if not m:
        return None
    # bfdd logs local time: a naive datetime's timestamp() reads it as such
    stamp = dt.datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f")
    wall = round(stamp.timestamp() * 1e6) * 1000
    return StateChange(wall, m.group(2), m.group(3), m.group(4), m.group(5))


@dataclass
class Bfd:
    fab: Fabric
    hosts: list[int]
    interval_ms: int = 10
    multiplier: int = 3
    sessions: list[tuple[int, int, int]] = field(default_factory=list)  # as given to start()

    def _dirs(self, host: int) -> tuple[str, str]:
        ns = self.fab.netns(host_name(host))
        return f"/etc/frr/{ns}", f"/var/run/frr/{ns}"

    def log_path(self, host: int) -> str:
        return f"{self._dirs(host)[1]}/bfdd.log"

    def start(self, sessions: list[tuple[int, int, int]], timeout_s: float = 10.0) -> None:
        """Sessions as (host a, host b, plane); waits until all are up."""
        if not available():
            raise FrrError("FRR is not installed (Debian: apt-get install frr)")
        self.sessions = list(sessions)
        peers: dict[int, list[tuple[str, str]]] = {h: [] for h in self.hosts}
        for a, b, plane in sessions:
            peers[a].append((self.fab.nic_addr(b, plane), self.fab.nic_addr(a, plane)))
            peers[b].append((self.fab.nic_addr(a, plane), self.fab.nic_addr(b, plane)))
        for host in self.hosts:
            etc, run = self._dirs(host)
            os.makedirs(etc, exist_ok=True)
            os.makedirs(run, exist_ok=True)
            lines = ["frr defaults traditional", "log timestamp precision 6",
                     f"log file {run}/bfdd.log debugging", "debug bfd peer", "bfd"]
            for peer, local in peers[host]:
                lines += [f" peer {peer} multihop local-address {local}",
                          f"  receive-interval {self.interval_ms}", f"  transmit-interval {self.interval_ms}",
                          f"  detect-multiplier {self.multiplier}", "  minimum-ttl 250", "  no shutdown", " !"]
            with open(f"{etc}/frr.conf", "w") as f:
                f.write("\n".join(lines) + "\n!\n")
            open(f"{etc}/vtysh.conf", "w").close()
            subprocess.run(["chown", "-R", "frr:frr", etc, run], check=False)
            ns = self.fab.netns(host_name(host))
            for daemon in ("zebra", "bfdd"):
                out = subprocess.run(["ip", "netns", "exec", ns, f"{FRR_BIN}/{daemon}", "-N", ns, "-d", "-f",
                                      f"{etc}/frr.conf"], capture_output=True, text=True, timeout=30)
                if out.returncode != 0:
                    raise FrrError(f"{daemon} in {ns} failed to start: {out.stderr.strip()[-300:]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.session_states(h) and all(s == "up" for s in self.session_states(h).values())
                   for h in self.hosts):
                return
            time.sleep(0.2)
        raise FrrError(f"BFD sessions did not come up within {timeout_s} s: "
                       f"{ {h: self.session_states(h) for h in self.hosts} }")

    def session_states(self, host: int) -> dict[str, str]:
        ns = self.fab.netns(host_name(host))
        out = subprocess.run(["vtysh", "-N", ns, "-c", "show bfd peers brief"], capture_output=True, text=True,
                             timeout=10)
        states = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0].isdigit():
                states[parts[2]] = parts[3]
        return states

    def changes(self, host: int) -> list[StateChange]:
        out = []
        try:
            with open(self.log_path(host)) as f:
                for line in f:
                    change = parse_state_change(line)
                    if change:
                        out.append(change)
        except FileNotFoundError:
            pass
        return out

    def stop(self) -> None:
        for host in self.hosts:
            _, run = self._dirs(host)
            for daemon in ("bfdd", "zebra"):
                try:
                    pid = int(open(f"{run}/{daemon}.pid").read().strip())
                    os.kill(pid, 15)
                except (FileNotFoundError, ValueError, ProcessLookupError):
                    pass
        time.sleep(0.2)
        for host in self.hosts:
            for d in self._dirs(host):
                shutil.rmtree(d, ignore_errors=True)

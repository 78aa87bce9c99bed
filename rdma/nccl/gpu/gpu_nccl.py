#!/usr/bin/env python3
"""The LinkPass net plugin under real NCCL, on one GPU: two torch.distributed ranks with the NCCL
backend on cuda:0, each looking to NCCL like a host of its own (its own NCCL_HOSTID, P2P and SHM
off), so every byte between them goes through the net plugin NCCL chose.

    gpu_nccl.py plan  --out DIR --plugin SO [--python PY] [--dry-run]   print (and check) the plan
    gpu_nccl.py probe --out DIR                                          what this host allows
    gpu_nccl.py run   --out DIR --plugin SO [--budget-s S]               everything (rdma/nccl/gpu/run.sh)
                      [--kill-method auto|ss|shutdown] [--cpu-selftest]  (gloo on a CPU: checks this driver, not NCCL)
    gpu_nccl.py rank  --work DIR --rank R                                one rank (started by `run`)

One `run`, two phases, each one pair of rank processes:
  1. NCCL_NET=LinkPass (NCCL_NET_PLUGIN = the .so), planes on loopback addresses: rank r's
     LINKPASS_NICS=127.0.1.<r+1>,127.0.2.<r+1> (every 127/8 address is local on Linux, no set-up);
     all-reduce (float32, integer values so sums are exact, every result checked) of 1, 16 and
     256 MiB; then a loop of 16 MiB all-reduces during which the lanes of the plane NCCL's
     channels use most are killed (`ss -K -t dst 127.0.P.0/24`, repeatedly for a window, so the
     plane stays dead that long) and the stall is measured;
  2. NCCL_NET=Socket (NCCL's own), the same sizes; then the same loop, killing the inter-rank TCP
     connections NCCL opened after its initialisation (its Socket transport's), with a bounded
     torch timeout: what NCCL does (an error, or a hang until the timeout) is recorded.
Where `ss -K` cannot destroy sockets (no CAP_NET_ADMIN, or a kernel without
CONFIG_INET_DIAG_DESTROY) the ranks shut their own sockets down instead (shutdown(2) on a dup of
the fd: a FIN, not ss's RST), and the JSON says so.

Output in OUT: gpu_nccl.json (the benchmark format), nccl-plugin-lines.txt (NCCL's lines about
the plugin: the ABI version it loaded, the devices, the net used, the channels), probe.json, and
logs/ (every rank's NCCL log, stdout and event stream).

Standard library only, except the `rank` command, which imports torch (lazily: this module
imports without it, and its pure functions are unit-tested on a CPU, tests/unit/test_gpu_nccl.py).
"""
from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
DEFAULT_PLUGIN = os.path.join(ROOT, "rdma", "nccl", "build", "libnccl-net-linkpass.so")

MiB = 1 << 20
NRANKS = 2
SIZES_MIB = (1, 16, 256)
WARMUP_ITERS = {1: (10, 100), 16: (5, 40), 256: (2, 10)}  # MiB -> (warm-up, timed iterations)
NETS = ("LinkPass", "Socket")
PEER = "nccl-socket"
PLANE_FMT = "127.0.{plane}.{host}"  # plane p (1-based in the address), rank r is host r+1

# the kill loop: 16 MiB all-reduces for about LOOP_S; the kill starts PRE_S into it and repeats
# every EVERY_S for WINDOW_S (lanes re-made meanwhile are killed again: the plane stays dead)
KILL_MIB = 16
LOOP_S, PRE_S, WINDOW_S, EVERY_S = 10.0, 2.5, 3.0, 0.1
LOOP_MIN_ITERS, LOOP_MAX_ITERS = 40, 20000
SIZE_CAP_S = 20.0         # a size's timed iterations are cut (rank 0 decides, from its warm-up) to about this long
MIN_TIMED_ITERS = 3

TORCH_TIMEOUT_S = 45      # init_process_group(timeout=): a collective that hangs longer is aborted
PHASE_LIMIT_S = 170       # one phase (one pair of ranks, all its tries) at most
TEARDOWN_S = 20           # after the loop: destroy_process_group gets this long
REPORT_RESERVE_S = 15     # kept back from the budget to write the report
MIN_TRY_S = 60            # a (re)try is only started with this much of the budget left
DEFAULT_BUDGET_S = 400

# NCCL's lines about nets and plugins worth keeping (nccl-plugin-lines.txt)
PLUGIN_LINE = re.compile(
    r"NCCL version|NET/Plugin|net plugin|network plugin|NET plugin|Using network|NET/LinkPass|NET/Socket|"
    r"NET/IB : No device|via NET/|Duplicate GPU|same GPU|MULTI_RANK|NCCL_NET|NCCL_HOSTID|NCCL WARN|Init COMPLETE")


# ---- the plan ------------------------------------------------------------------------------------

def plane_addr(plane: int, rank: int) -> str:
    """Plane `plane` (0-based, = NCCL device = LinkPass plane) address of rank `rank`."""
    return PLANE_FMT.format(plane=plane + 1, host=rank + 1)


def plane_prefix(plane: int) -> str:
    return f"127.0.{plane + 1}."


def linkpass_nics(rank: int, nplanes: int = 2) -> str:
    return ",".join(plane_addr(p, rank) for p in range(nplanes))


def default_plan(out: str, plugin: str, python: str = sys.executable, cpu_selftest: bool = False) -> dict:
    out, plugin = os.path.abspath(out), os.path.abspath(plugin)
    if cpu_selftest:  # the driver's own check on a CPU: gloo instead of NCCL, a few iterations, no GPU
        plan = default_plan(out, plugin, python)
        plan.update(backend="gloo", iters={str(m): [1, 3] for m in SIZES_MIB})
        plan["kill"].update(loop_s=4.0, pre_s=1.0, window_s=1.5, min_iters=10)
        return plan
    return {
        "backend": "nccl",
        "out": out, "plugin": plugin, "python": python, "driver": os.path.abspath(__file__),
        "nranks": NRANKS, "sizes_mib": list(SIZES_MIB),
        "iters": {str(m): list(WARMUP_ITERS[m]) for m in SIZES_MIB},
        "kill": {"size_mib": KILL_MIB, "loop_s": LOOP_S, "pre_s": PRE_S, "window_s": WINDOW_S, "every_s": EVERY_S,
                 "min_iters": LOOP_MIN_ITERS, "max_iters": LOOP_MAX_ITERS},
        "size_cap_s": SIZE_CAP_S, "min_timed_iters": MIN_TIMED_ITERS,
        "torch_timeout_s": TORCH_TIMEOUT_S, "phase_limit_s": PHASE_LIMIT_S, "teardown_s": TEARDOWN_S,
        "lanes_dir": os.path.join(out, "lanes"),
    }


def rank_env(plan: dict, net: str, rank: int, work: str, *, multi_rank: bool = False,
             plugin_mode: str = "path") -> dict[str, str]:
    """The variables one rank runs with (on top of the caller's environment)."""
    env = {
        "NCCL_NET": net,
        "NCCL_HOSTID": f"linkpass-gpu-rank{rank}",  # each rank its own "host": no duplicate-GPU check
        "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",  # so the two ranks talk through the net
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",  # NCCL's bootstrap (and its Socket net) on 127.0.0.1
        "NCCL_RUNTIME_CONNECT": "1",  # connections at the first collective, after the socket baseline
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": os.path.join(work, f"rank{rank}.nccl.log"),  # unbuffered: survives a crash
        "PYTHONUNBUFFERED": "1",
    }
    if multi_rank:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # NCCL >= 2.30's own switch for two ranks on one GPU
    if net == "LinkPass":
        if plugin_mode == "path":
            env["NCCL_NET_PLUGIN"] = plan["plugin"]
        else:  # NCCL < 2.27 may not dlopen a path: the name, found on LD_LIBRARY_PATH
            env["NCCL_NET_PLUGIN"] = "linkpass"
            env["LD_LIBRARY_PATH"] = os.path.dirname(plan["plugin"]) + (
                ":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
        env["LINKPASS_NICS"] = linkpass_nics(rank)
        env["LINKPASS_LANES_DIR"] = plan["lanes_dir"]
        env["LINKPASS_ENTROPY_TABLE"] = "/nonexistent/linkpass-gpu-entropy"  # the plugin alone, no agent
    else:
        env["NCCL_NET_PLUGIN"] = "none"
    return env


def rank_command(plan: dict, work: str, rank: int) -> list[str]:
    return [plan["python"], plan["driver"], "rank", "--work", work, "--rank", str(rank)]


def ss_plane_filter(plane: int) -> str:
    """Both ends of every lane on the plane (listeners have no destination: they stay)."""
    return f"dst {plane_prefix(plane)}0/24"


def ss_pairs_filter(pairs: list[tuple[str, int, str, int]]) -> str:
    """Exact connections, by their ports (which also matches a v4-mapped IPv6 socket)."""
    return " or ".join(f"( sport = :{lp} and dport = :{rp} )" for _, lp, _, rp in pairs)


def validate_plan(plan: dict, budget_s: float) -> list[str]:
    """What is wrong with the plan (empty: nothing)."""
    bad = []
    if plan["nranks"] != 2:
        bad.append("two ranks on one GPU: nranks must be 2")
    for m in plan["sizes_mib"]:
        if str(m) not in plan["iters"] or min(plan["iters"][str(m)]) < 1:
            bad.append(f"{m} MiB: no warm-up/iteration counts")
        if (m * MiB) % 4:
            bad.append(f"{m} MiB is not a whole number of float32")
    if sorted(NETS) != sorted(["LinkPass", "Socket"]):
        bad.append("the nets must be LinkPass and Socket")
    addrs = [plane_addr(p, r) for p in range(2) for r in range(plan["nranks"])]
    if len(set(addrs)) != len(addrs) or any(not ipaddress.ip_address(a).is_loopback for a in addrs):
        bad.append(f"plane addresses must be distinct loopback addresses: {addrs}")
    k = plan["kill"]
    if not 0 < k["pre_s"] < k["pre_s"] + k["window_s"] < k["loop_s"]:
        bad.append("kill: pre_s + window_s must fall inside loop_s")
    if k["size_mib"] not in plan["sizes_mib"]:
        bad.append("kill: its size must be one of the benchmark sizes (its loop length comes from their timing)")
    if plan["torch_timeout_s"] >= plan["phase_limit_s"] - 30:
        bad.append("the torch timeout must end well inside a phase's limit (or a hang is never seen to end)")
    if plan["phase_limit_s"] + MIN_TRY_S + REPORT_RESERVE_S > budget_s:
        bad.append(f"budget {budget_s:.0f} s cannot hold the first phase whole, a try of the second and the report")
    if not os.path.isabs(plan["plugin"]):
        bad.append("the plugin path must be absolute (NCCL_NET_PLUGIN)")
    return bad


def plan_lines(plan: dict, budget_s: float) -> list[str]:
    """The plan, as the commands and variables `run` would use (the dry run prints them)."""
    out = []
    sizes = ", ".join(f"{m} MiB" for m in plan["sizes_mib"])
    k = plan["kill"]
    for n, net in enumerate(NETS, 1):
        work = os.path.join(plan["out"], "logs", f"{net.lower()}-try1")
        out.append(f"phase {n}: NCCL_NET={net}: all-reduce float32 of {sizes} "
                   f"({'; '.join(f'{m} MiB: {w} warm-up + {i} timed' for m, (w, i) in ((m, plan['iters'][str(m)]) for m in plan['sizes_mib']))}), "
                   f"every result checked; then {k['size_mib']} MiB all-reduces for ~{k['loop_s']:.0f} s with a kill")
        for r in range(plan["nranks"]):
            env = rank_env(plan, net, r, work)
            out.append(f"  rank {r}: " + " ".join(f"{v}={shlex.quote(env[v])}" for v in sorted(env)))
            out.append(f"          {shlex.join(rank_command(plan, work, r))}")
        if net == "LinkPass":
            out.append(f"  kill: from {k['pre_s']} s into the loop, every {k['every_s']} s for {k['window_s']} s: "
                       f"ss -K -t {shlex.quote(ss_plane_filter(0))} (plane 0; the plane NCCL's channels use most: "
                       f"'via NET/LinkPass/<dev>' in the log), both ends of every lane on it")
        else:
            out.append(f"  kill: the same window: ss -K -t '( src 127.0.0.1:P and dst 127.0.0.1:Q ) or ...' for "
                       f"every TCP connection between the two ranks opened after NCCL's initialisation (its Socket "
                       f"transport's; not the store's, not the bootstrap's); torch timeout {plan['torch_timeout_s']} s")
    out.append("  where ss -K cannot destroy sockets: each rank shuts down (shutdown(2)) its own matching sockets")
    out.append(f"retries: NCCL_MULTI_RANK_GPU_ENABLE=1 added if NCCL refuses two ranks on one GPU; "
               f"NCCL_NET_PLUGIN=linkpass with LD_LIBRARY_PATH={os.path.dirname(plan['plugin'])} if NCCL cannot "
               f"load the plugin by its path")
    out.append(f"limits: {budget_s:.0f} s for the run, {plan['phase_limit_s']} s per phase, torch timeout "
               f"{plan['torch_timeout_s']} s, {plan['teardown_s']} s for teardown")
    out.append(f"writes: {os.path.join(plan['out'], 'gpu_nccl.json')}, "
               f"{os.path.join(plan['out'], 'nccl-plugin-lines.txt')}, probe.json, logs/")
    return out


# ---- NCCL's log ------------------------------------------------------------------------------------

_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)(\S*)")
_LOADED = re.compile(r"NET/Plugin ?: Loaded net plugin (.+?) \(v(\d+)\)")
_USING = re.compile(r"NCCL INFO Using network (\S+)")
_ASSIGNED = re.compile(r"Assigned NET plugin (\S+) to comm")
_LP_DEV = re.compile(r"NET/LinkPass : device (\d+) = plane (\d+): (\S+) \(([\d.]+)\), (\d+) Mbps, listening on port (\d+)")
_SOCK_USING = re.compile(r"NET/Socket : Using((?: \[\d+\]\S+)+)")
_SOCK_DEV = re.compile(r"\[(\d+)\]([^:\s]+):(\S+?)<(\d+)>")
_CHANNEL = re.compile(r"Channel (\d+)/\d+ : (\d+)\[[^\]]*\] -> (\d+)\[[^\]]*\] \[(send|receive)\] via NET/([^/\s]+)/(\d+)")


def parse_nccl_log(text: str) -> dict:
    """What NCCL's INFO lines say about the net: its version, the plugin and ABI version it loaded,
    the net it used, the devices the net showed, and the channels per (net, device)."""
    r: dict = {"version": None, "loaded": [], "using": [], "assigned": [], "linkpass_devices": [],
               "socket_devices": [], "channels": {}, "warnings": []}
    seen_dev = set()
    for line in text.splitlines():
        if r["version"] is None and (m := _VERSION.search(line)):
            r["version"] = m.group(1)
        if m := _LOADED.search(line):
            item = {"name": m.group(1), "abi": int(m.group(2))}
            if item not in r["loaded"]:
                r["loaded"].append(item)
        if (m := _USING.search(line)) and m.group(1) not in r["using"]:
            r["using"].append(m.group(1))
        if (m := _ASSIGNED.search(line)) and m.group(1) not in r["assigned"]:
            r["assigned"].append(m.group(1))
        if m := _LP_DEV.search(line):
            key = ("lp", m.group(1), m.group(4))
            if key not in seen_dev:
                seen_dev.add(key)
                r["linkpass_devices"].append({"dev": int(m.group(1)), "plane": int(m.group(2)), "label": m.group(3),
                                              "addr": m.group(4), "mbps": int(m.group(5)), "port": int(m.group(6))})
        if m := _SOCK_USING.search(line):
            for d in _SOCK_DEV.finditer(m.group(1)):
                key = ("sock", d.group(1), d.group(3))
                if key not in seen_dev:
                    seen_dev.add(key)
                    r["socket_devices"].append({"dev": int(d.group(1)), "ifname": d.group(2), "addr": d.group(3)})
        if m := _CHANNEL.search(line):
            k = f"{m.group(5)}/{m.group(6)}"
            r["channels"][k] = r["channels"].get(k, 0) + 1
        if " NCCL WARN " in line:
            r["warnings"].append(line.split(" NCCL WARN ", 1)[1].strip())
    return r


def plugin_lines(logs: dict[str, str]) -> list[str]:
    """NCCL's lines about the net plugins, each after the name of the log it came from."""
    out = []
    for name in sorted(logs):
        for line in logs[name].splitlines():
            if PLUGIN_LINE.search(line):
                out.append(f"[{name}] {line.rstrip()}")
    return out


def busiest_device(channels: dict[str, int], net: str) -> int:
    """The device of `net` that NCCL's channels use most (0 if the log names none)."""
    counts = {int(k.split("/")[1]): v for k, v in channels.items() if k.split("/")[0].lower() == net.lower()}
    return max(sorted(counts), key=lambda d: counts[d]) if counts else 0


def init_failure_kind(text: str, net: str) -> str | None:
    """Why NCCL's initialisation failed, where a retry with other settings may help:
    'duplicate-gpu' (two ranks on one GPU refused) or 'plugin-not-loaded'; else None."""
    if re.search(r"Duplicate GPU detected|Multiple Ranks are using the same GPU|NCCL_MULTI_RANK_GPU_ENABLE", text):
        return "duplicate-gpu"
    if net == "LinkPass" and not _LOADED.search(text) and re.search(
            r"NET/Plugin ?: Could not find|Failed to initialize any NET plugin|External network plugin .* is unsupported|"
            r"network LinkPass not found|No plugin found", text):
        return "plugin-not-loaded"
    return None


# ---- sockets (/proc/net/tcp) ---------------------------------------------------------------------

ESTABLISHED, LISTEN = "01", "0A"


def _hex_addr(h: str) -> tuple[str, int]:
    ip_hex, port_hex = h.split(":")
    b = bytes.fromhex(ip_hex)
    if len(b) == 4:
        ip = socket.inet_ntoa(b[::-1])
    else:
        a = ipaddress.IPv6Address(b"".join(b[i:i + 4][::-1] for i in range(0, 16, 4)))
        ip = str(a.ipv4_mapped) if a.ipv4_mapped else str(a)
    return ip, int(port_hex, 16)


def same_endpoint(sockname, endpoint) -> bool:
    """getsockname() (v4, or v6 with a v4-mapped address) against an (ip, port) of /proc/net/tcp."""
    ip, port = sockname[0], sockname[1]
    if ip.startswith("::ffff:"):
        ip = ip[len("::ffff:"):]
    return (ip, port) == (endpoint[0], endpoint[1])


def parse_proc_net_tcp(text: str) -> list[dict]:
    """/proc/net/tcp or tcp6 -> [{local: (ip, port), remote: (ip, port), state: hex, inode: int}]."""
    socks = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        lo, re_ = _hex_addr(f[1]), _hex_addr(f[2])
        socks.append({"local": lo, "remote": re_, "state": f[3], "inode": int(f[9])})
    return socks


def socket_inodes(fd_links: dict[int, str]) -> dict[int, int]:
    """{fd: link text} as /proc/PID/fd reads -> {socket inode: fd}."""
    out = {}
    for fd, link in fd_links.items():
        if m := re.fullmatch(r"socket:\[(\d+)\]", link):
            out[int(m.group(1))] = fd
    return out


def sockets_of(tcp: list[dict], inodes: dict[int, int]) -> list[dict]:
    return [dict(s, fd=inodes[s["inode"]]) for s in tcp if s["inode"] in inodes and s["inode"] != 0]


def baseline_of(own: list[dict]) -> dict:
    """What a rank has right after NCCL's initialisation: its listening ports and connections."""
    return {"listen": sorted({s["local"][1] for s in own if s["state"] == LISTEN}),
            "est": sorted([*s["local"], *s["remote"]] for s in own if s["state"] == ESTABLISHED)}


def new_peer_connections(current: dict[int, list[dict]], baselines: dict[int, dict], store_port: int) -> list[dict]:
    """The sockets (of every rank) of TCP connections between two ranks that were opened after
    NCCL's initialisation: not in a rank's baseline, not to a port that listened then (NCCL's
    bootstrap and proxy), not the store's, not inside one process. With NCCL's Socket net these are
    its data and control connections."""
    owner = {}
    for pid, socks in current.items():
        for s in socks:
            if s["state"] == ESTABLISHED:
                owner[tuple(s["local"])] = pid
    old_listen = {p for b in baselines.values() for p in b.get("listen", [])}
    out = []
    for pid, socks in current.items():
        base = {tuple(e) for e in baselines.get(pid, {}).get("est", [])}
        for s in socks:
            if s["state"] != ESTABLISHED:
                continue
            peer = owner.get(tuple(s["remote"]))
            if peer is None or peer == pid:
                continue
            if store_port in (s["local"][1], s["remote"][1]):
                continue
            if (*s["local"], *s["remote"]) in base:
                continue
            if s["local"][1] in old_listen or s["remote"][1] in old_listen:
                continue
            out.append(dict(s, pid=pid))
    return out


def all_peer_connections(current: dict[int, list[dict]], store_port: int) -> list[dict]:
    """Every inter-rank connection but the store's (the fallback when NCCL connected at init)."""
    return new_peer_connections(current, {}, store_port)


def plane_sockets(own: list[dict], prefix: str) -> list[dict]:
    return [s for s in own if s["state"] != LISTEN and
            (s["local"][0].startswith(prefix) or s["remote"][0].startswith(prefix))]


# ---- numbers ---------------------------------------------------------------------------------------

def timed_iters(planned: int, warm_s: float, cap_s: float, least: int) -> int:
    """Timed iterations of a size: as planned, unless they would take longer than cap_s at the
    last warm-up iteration's pace (never fewer than `least`)."""
    if warm_s <= 0:
        return planned
    return max(min(least, planned), min(planned, int(cap_s / warm_s)))


def busbw_gbs(size_bytes: int, seconds: float, nranks: int = NRANKS) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(n-1)/n, GB/s (1e9)."""
    return size_bytes / seconds / 1e9 * 2 * (nranks - 1) / nranks


def stall_ms(seconds: list[float]) -> float | None:
    """Longest iteration beyond the median iteration, ms."""
    if not seconds:
        return None
    return (max(seconds) - statistics.median(seconds)) * 1000.0


def tail(values: list[float], q: float = 0.99) -> float | None:
    """The q-quantile, or None under 20 values (as sim/linkpass_sim/report.py)."""
    if len(values) < 20:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def row(case: str, metric: str, unit: str, values: list[float], peer: str | None = None,
        peer_values: list[float] | None = None, better: str = "lower", q: float = 0.99, **extra) -> dict:
    r = {"case": case, "metric": metric, "unit": unit, "n": len(values),
         "median": round(statistics.median(values), 3) if values else None,
         "p99": (round(t, 3) if (t := tail(values, q)) is not None else None) if values else None}
    if peer is not None:
        pv = peer_values or []
        r.update(peer=peer, peer_n=len(pv), peer_median=round(statistics.median(pv), 3) if pv else None,
                 peer_p99=(round(t, 3) if (t := tail(pv, q)) is not None else None) if pv else None)
        if r["median"] and r["peer_median"]:
            r["ratio"] = round(r["peer_median"] / r["median"] if better == "lower" else r["median"] / r["peer_median"], 2)
    r.update(extra)
    return r


def events_of(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a crash
    return out


def bench_of(events: list[dict], size_mib: int) -> dict | None:
    for e in events:
        if e.get("ev") == "bench" and e.get("size_mib") == size_mib:
            return e
    return None


ERROR_LINE = re.compile(r"NCCL WARN|Watchdog caught|timed out|Timeout|ncclSystemError|ncclRemoteError|"
                        r"ncclInternalError|NCCL error|Connection closed|Connection reset|Software caused|"
                        r"Broken pipe|DistBackendError|terminate called|Aborted|Process group watchdog")


def error_lines(text: str, limit: int = 12) -> list[str]:
    """The lines of ranks' output and NCCL's logs that say what went wrong (first `limit`)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if ERROR_LINE.search(line) and line not in out:
            out.append(line[:400])
            if len(out) == limit:
                break
    return out


def kill_outcome(ranks: dict[int, dict], kill: dict | None, texts: str = "",
                 torch_timeout_s: float | None = None) -> dict:
    """What became of the kill loop: `ranks` {r: {events, exit, timed_out, exit_t}}, `kill` the
    kill record (None: not done), `texts` the ranks' output and NCCL logs. outcome: completed |
    wrong-result | error | hang (ended by torch's timeout, or by the driver) | not-run."""
    ev0 = ranks.get(0, {}).get("events", [])
    start = next((e for e in ev0 if e.get("ev") == "loop-start"), None)
    if start is None:
        return {"outcome": "not-run", "why": "the loop never started"}
    its = [e for e in ev0 if e.get("ev") == "it"]
    secs = [e["dt"] for e in its]
    wrong = sum(1 for e in its if not e.get("ok"))
    ended = all(any(e.get("ev") == "loop-end" for e in ranks.get(r, {}).get("events", [])) for r in ranks)
    errors = [e.get("msg", "") for r in sorted(ranks) for e in ranks[r].get("events", []) if e.get("ev") == "error"]
    t_kill = kill.get("first_t") if kill else None
    res = {"iterations": len(its), "planned": start.get("n"), "wrong": wrong,
           "median_ms": round(statistics.median(secs) * 1000, 3) if secs else None,
           "max_ms": round(max(secs) * 1000, 3) if secs else None,
           "stall_ms": round(stall_ms(secs), 3) if secs else None}
    if t_kill is not None:
        res["after_kill"] = sum(1 for e in its if e["t0"] + e["dt"] >= t_kill)
    if wrong:
        res["outcome"] = "wrong-result"
    elif ended and len(its) == start.get("n"):
        res["outcome"] = "completed"
    elif any(ranks[r].get("timed_out") for r in ranks):
        res["outcome"] = "hang"
        res["why"] = "no end before the driver's limit: killed"
    else:
        res["outcome"] = "error"
        codes = {r: ranks[r].get("exit") for r in sorted(ranks)}
        res["why"] = (errors[0][-400:] if errors else f"rank exits {codes}")
    if res["outcome"] in ("error", "hang"):
        res["errors"] = error_lines(texts)
    if res["outcome"] in ("error", "hang") and t_kill is not None:
        ends = [ranks[r]["exit_t"] for r in ranks if ranks[r].get("exit_t")]
        if ends:
            res["end_after_kill_s"] = round(min(ends) - t_kill, 3)
            if res["outcome"] == "error" and torch_timeout_s and res["end_after_kill_s"] >= 0.9 * torch_timeout_s:
                res["outcome"] = "hang"  # nothing failed until torch's watchdog gave up on the collective
                res["why"] = f"no error until torch's timeout ({torch_timeout_s:.0f} s) ended it: {res['why']}"
        last = max((e["t0"] + e["dt"] for e in its), default=None)
        if last is not None:
            res["last_iteration_after_kill_s"] = round(last - t_kill, 3)
    if (kill is None or not kill.get("killed_total")) and res["outcome"] == "completed":
        res["outcome"] = "not-run"  # a loop that nothing disturbed says nothing about a kill
        res["why"] = "no kill was done" if kill is None else f"the kill found no socket ({kill.get('what')})"
    return res


def build_rows(phases: dict[str, dict]) -> list[dict]:
    """The benchmark rows from the two phases' results (`run`'s own record)."""
    lp, so = phases.get("LinkPass", {}), phases.get("Socket", {})
    rows = []
    for m in SIZES_MIB:
        size = m * MiB
        b_lp = bench_of(lp.get("events0", []), m)
        b_so = bench_of(so.get("events0", []), m)
        mine = [busbw_gbs(size, t) for t in (b_lp or {}).get("times", [])]
        theirs = [busbw_gbs(size, t) for t in (b_so or {}).get("times", [])]
        rows.append(row(f"allreduce-{m}MiB", "busbw", "GB/s", mine, PEER, theirs, better="higher", q=0.01,
                        wrong=(b_lp or {}).get("wrong"), peer_wrong=(b_so or {}).get("wrong"),
                        warmup=(b_lp or b_so or {}).get("warmup"),
                        note="float32 sum over 2 ranks on one GPU, every result checked exactly; "
                             "p99: the busbw of the p99-slowest iteration (the 1st percentile)"))
    o_lp, o_so = lp.get("kill_outcome", {}), so.get("kill_outcome", {})
    s_lp = [o_lp["stall_ms"]] if o_lp.get("outcome") == "completed" and o_lp.get("stall_ms") is not None else []
    s_so = [o_so["stall_ms"]] if o_so.get("outcome") == "completed" and o_so.get("stall_ms") is not None else []
    rows.append(row(f"plane-kill-{KILL_MIB}MiB", "stall", "ms", s_lp, PEER, s_so,
                    outcome=o_lp.get("outcome", "not-run"), peer_outcome=o_so.get("outcome", "not-run"),
                    detail=o_lp, peer_detail=o_so,
                    kill=(lp.get("kill") or {}).get("what"), peer_kill=(so.get("kill") or {}).get("what"),
                    kill_method=(lp.get("kill") or {}).get("method"),
                    note="stall: the longest 16 MiB all-reduce of the loop beyond its median; a peer that "
                         "does not complete has no stall (peer_outcome says what it did)"))
    return rows


def document(rows: list[dict], machine: str, **extra) -> dict:
    return {"benchmark": "gpu_nccl", "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine, "rows": rows, **extra}


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<20} {'metric':<14} {'n':>4} {'median':>10} {'p99':>10} {'peer':<12} {'peer_med':>10} "
             f"{'ratio':>6}  outcome"]
    for r in rows:
        oc = f"{r.get('outcome', '')} / {r.get('peer_outcome', '')}" if "outcome" in r else ""
        lines.append(f"{r['case']:<20} {r['metric'] + ' ' + r['unit']:<14} {r['n']:>4} {_f(r['median']):>10} "
                     f"{_f(r['p99']):>10} {r.get('peer', ''):<12} {_f(r.get('peer_median')):>10} "
                     f"{_f(r.get('ratio')):>6}  {oc}")
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


# ---- the probe ---------------------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float = 5, keep: int = 500) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr).strip()[-keep:]
    except FileNotFoundError:
        return 127, "not installed"
    except subprocess.TimeoutExpired:
        return 124, "timed out"


def probe_loopback_planes() -> dict:
    """Can a socket bind each plane address and reach the other rank's one on it?"""
    res = {}
    for p in range(2):
        a, b = plane_addr(p, 0), plane_addr(p, 1)
        try:
            with socket.socket() as srv, socket.socket() as cli:
                srv.bind((b, 0))
                srv.listen(1)
                cli.bind((a, 0))
                cli.settimeout(2)
                cli.connect(srv.getsockname())
                res[f"plane{p}"] = f"ok ({a} -> {b})"
        except OSError as e:
            res[f"plane{p}"] = f"failed: {e}"
    return res


def probe_ss_kill() -> dict:
    """Does `ss -K` destroy a socket here? (CAP_NET_ADMIN and CONFIG_INET_DIAG_DESTROY.) Tried on
    a connection of our own between 127.0.9.2 and 127.0.9.1, nothing else."""
    if not shutil.which("ss"):
        return {"ok": False, "why": "ss is not installed"}
    try:
        with socket.socket() as srv, socket.socket() as cli:
            srv.bind(("127.0.9.1", 0))
            srv.listen(1)
            cli.bind(("127.0.9.2", 0))
            cli.connect(srv.getsockname())
            acc, _ = srv.accept()
            with acc:
                (la, lp), (ra, rp) = cli.getsockname(), cli.getpeername()
                rc, out = _run(["ss", "-K", "-tnH", ss_pairs_filter([(la, lp, ra, rp)])])
                cli.settimeout(1.0)
                try:
                    data = cli.recv(1)
                    killed, how = data == b"", "recv returned end of stream"
                except socket.timeout:
                    killed, how = False, "the socket lived on"
                except OSError as e:
                    killed, how = True, f"recv: {e.strerror or e}"
        return {"ok": killed, "ss_rc": rc, "ss_output": out, "seen": how}
    except OSError as e:
        return {"ok": False, "why": f"test connection: {e}"}


def cap_net_admin() -> bool | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 12))
    except OSError:
        pass
    return None


def kernel_config(option: str) -> str | None:
    import gzip
    for path in ("/proc/config.gz", f"/boot/config-{platform.release()}"):
        try:
            text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
        except OSError:
            continue
        m = re.search(rf"^{option}=(\S+)", text, re.M)
        return m.group(1) if m else "not set"
    return None


def probe() -> dict:
    tools = {t: shutil.which(t) for t in ("ss", "ip", "nft", "tc", "unshare", "nvidia-smi", "nvcc", "make", "cc",
                                          "nm", "timeout")}
    rc_ns, out_ns = _run(["unshare", "-n", "true"])
    rc_nft, out_nft = _run(["nft", "list", "tables"])
    rc_tc, out_tc = _run(["tc", "qdisc", "show", "dev", "lo"])
    return {
        "kernel": platform.release(), "uid": os.geteuid(), "cap_net_admin": cap_net_admin(),
        "config_inet_diag_destroy": kernel_config("CONFIG_INET_DIAG_DESTROY"),
        "tools": tools,
        "netns": {"ok": rc_ns == 0, "detail": out_ns},
        "nft": {"ok": rc_nft == 0, "detail": out_nft[:200]},
        "tc": {"ok": rc_tc == 0, "detail": out_tc[:200]},
        "loopback_planes": probe_loopback_planes(),
        "ss_kill": probe_ss_kill(),
        "note": "the run uses loopback addresses as planes (no namespaces); nft, tc and namespaces are only recorded",
    }


def gpu_info() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"nvidia_smi": "not installed"}
    rc, out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode",
                    "--format=csv,noheader"], timeout=20)
    return {"nvidia_smi": out if rc == 0 else f"failed ({rc}): {out}"}


# ---- the run ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _proc_sockets(pid: int | str) -> list[dict]:
    tcp = []
    for name in ("tcp", "tcp6"):
        tcp += parse_proc_net_tcp(_read(f"/proc/{pid}/net/{name}"))
    links = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            links[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return sockets_of(tcp, socket_inodes(links))


def _event(path: str, name: str) -> dict | None:
    """The first event `name` in a rank's event stream (only its lines are parsed: cheap to poll)."""
    tag = f'"ev": "{name}"'
    for line in _read(path).splitlines():
        if tag in line:
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _write_json(path: str, doc) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


class Phase:
    """One pair of ranks for one net, with its kill; retried with other settings where NCCL says why."""

    def __init__(self, plan: dict, net: str, deadline: float, state: dict, kill_mode: str, log):
        self.plan, self.net, self.deadline, self.state, self.kill_mode, self.log = plan, net, deadline, state, kill_mode, log

    def run(self) -> dict:
        tries = []
        res: dict = {}
        for attempt in range(1, 4):
            left = self.deadline - time.time()
            if left < MIN_TRY_S:
                tries.append({"try": attempt, "skipped": f"only {left:.0f} s of the budget left"})
                break
            res = self.once(attempt, min(self.plan["phase_limit_s"], left))
            tries.append({"try": attempt, "multi_rank": self.state["multi_rank"],
                          "plugin_mode": self.state["plugin_mode"], "ready": res["ready"],
                          "elapsed_s": res["elapsed_s"]})
            if res["ready"]:
                break
            kind = init_failure_kind(res["nccl_text"] + res["out_text"], self.net)
            tries[-1]["failure"] = kind or "unknown"
            if kind == "duplicate-gpu" and not self.state["multi_rank"]:
                self.state["multi_rank"] = True
            elif kind == "plugin-not-loaded" and self.state["plugin_mode"] == "path":
                self.state["plugin_mode"] = "name"
            else:
                break
            self.log(f"{self.net}: NCCL's initialisation failed ({kind}); trying again with other settings")
        res["tries"] = tries
        return res

    def once(self, attempt: int, limit: float) -> dict:
        plan, net = self.plan, self.net
        work = os.path.join(plan["out"], "logs", f"{net.lower()}-try{attempt}")
        os.makedirs(work, exist_ok=True)
        port = _free_port()
        _write_json(os.path.join(work, "rank-plan.json"), dict(plan, net=net, store_port=port,
                                                               kill_mode=self.kill_mode))
        procs = {}
        envs = {}
        t0 = time.time()
        for r in range(plan["nranks"]):
            envs[r] = rank_env(plan, net, r, work, multi_rank=self.state["multi_rank"],
                               plugin_mode=self.state["plugin_mode"])
            out = open(os.path.join(work, f"rank{r}.out"), "w")
            procs[r] = subprocess.Popen(rank_command(plan, work, r), env=dict(os.environ, **envs[r]), stdout=out,
                                        stderr=subprocess.STDOUT, cwd=work)  # in our process group: timeout(1) reaches it
            out.close()
            LIVE.append(procs[r])
        _write_json(os.path.join(work, "env.json"), {str(r): envs[r] for r in envs})
        self.log(f"{net} try {attempt}: ranks {[p.pid for p in procs.values()]} started (limit {limit:.0f} s)")
        self.exit_t: dict[int, float] = {}
        timed_out = teardown_killed = False
        kill = None
        loop_end_seen_t = None
        while True:
            now = time.time()
            if self.poll(procs):
                break
            start = _event(os.path.join(work, "rank0.events.jsonl"), "loop-start")
            if start and kill is None:
                kill = self.kill_window(work, start["t"], procs, port)
            ended = all(_event(os.path.join(work, f"rank{r}.events.jsonl"), "loop-end") for r in procs)
            if ended and loop_end_seen_t is None:
                loop_end_seen_t = now
            over = now - t0 > limit or (loop_end_seen_t is not None and now - loop_end_seen_t > plan["teardown_s"])
            if over:
                timed_out, teardown_killed = not ended, ended
                for r, p in procs.items():
                    if p.poll() is None:
                        self.log(f"{net}: rank {r} still running after {now - t0:.0f} s: killing it")
                        self.exit_t.setdefault(r, time.time())
                        _kill_group(p)
                break
            time.sleep(0.1)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(p, sig=signal.SIGKILL)
        for p in procs.values():
            if p in LIVE:
                LIVE.remove(p)
        exit_t = self.exit_t
        ranks = {}
        for r, p in procs.items():
            ranks[r] = {"events": events_of(_read(os.path.join(work, f"rank{r}.events.jsonl"))),
                        "exit": p.returncode, "exit_t": exit_t.get(r), "timed_out": timed_out}
        nccl_text = "\n".join(_read(os.path.join(work, f"rank{r}.nccl.log")) for r in procs)
        out_text = "\n".join(_read(os.path.join(work, f"rank{r}.out")) for r in procs)
        ready = all(any(e.get("ev") == "ready" for e in ranks[r]["events"]) for r in ranks)
        if kill:
            _write_json(os.path.join(work, "kill.json"), kill)
        texts = "\n".join(_read(os.path.join(work, f"rank{r}.out")) + "\n" + _read(os.path.join(work, f"rank{r}.nccl.log"))
                          for r in procs)
        return {"work": work, "ready": ready, "elapsed_s": round(time.time() - t0, 1), "ranks": ranks,
                "events0": ranks[0]["events"], "exits": {r: ranks[r]["exit"] for r in ranks},
                "teardown_killed": teardown_killed,
                "nccl_text": nccl_text, "out_text": out_text, "kill": kill,
                "kill_outcome": kill_outcome(ranks, kill, texts, plan["torch_timeout_s"]), "env": envs}

    def poll(self, procs: dict) -> bool:
        """Note when each rank ended; True when all have."""
        for r, p in procs.items():
            if r not in self.exit_t and p.poll() is not None:
                self.exit_t[r] = time.time()
        return len(self.exit_t) == len(procs)

    def kill_window(self, work: str, loop_t: float, procs: dict, store_port: int) -> dict:
        """Wait for the window, then kill (repeatedly) what this net's case kills; returns the record."""
        k = self.plan["kill"]
        start, end = loop_t + k["pre_s"], loop_t + k["pre_s"] + k["window_s"]
        while time.time() < start:
            self.poll(procs)
            if self.exit_t:
                return {"method": None, "what": "not done: a rank ended before the window", "ticks": []}
            time.sleep(0.01)
        rec: dict = {"method": self.kill_mode, "window": [start, end], "every_s": k["every_s"], "ticks": []}
        if self.net == "LinkPass":
            text = "\n".join(_read(os.path.join(work, f"rank{r}.nccl.log")) for r in procs)
            plane = busiest_device(parse_nccl_log(text)["channels"], "LinkPass")
            rec["plane"] = plane
            rec["what"] = f"plane {plane}: every lane with an end on {plane_prefix(plane)}x"
            spec = {"prefix": plane_prefix(plane)}
            ss_filter = ss_plane_filter(plane)
        else:
            baselines = {}
            for r, p in procs.items():
                b = _event(os.path.join(work, f"rank{r}.events.jsonl"), "ready") or {}
                baselines[p.pid] = b.get("baseline", {})
            current = {p.pid: _proc_sockets(p.pid) for p in procs.values()}
            targets = new_peer_connections(current, baselines, store_port)
            scope = "opened after NCCL's initialisation (its Socket transport's)"
            if not targets:
                targets = all_peer_connections(current, store_port)
                scope = "every one between the ranks but the store's (none was opened after initialisation)"
            rec["what"] = f"{len(targets)} TCP sockets of connections between the ranks, {scope}"
            rec["targets"] = [{"pid": t["pid"], "local": t["local"], "remote": t["remote"]} for t in targets]
            pairs = [(*t["local"], *t["remote"]) for t in targets]
            spec = {"pairs": {str(t["pid"]): [] for t in targets}}
            for t in targets:
                spec["pairs"][str(t["pid"])].append([*t["local"], *t["remote"]])
            ss_filter = ss_pairs_filter(pairs) if pairs else None
        rec["filter"] = ss_filter
        if self.kill_mode == "ss":
            rec["first_t"] = time.time()
            while time.time() < end:
                if ss_filter:
                    rc, out = _run(["ss", "-K", "-tnH", ss_filter], timeout=5, keep=1 << 20)
                    n = len([ln for ln in out.splitlines() if ln.strip()]) if rc == 0 else 0
                    rec["ticks"].append({"t": round(time.time(), 3), "killed": n, "rc": rc})
                if self.poll(procs):
                    break
                time.sleep(k["every_s"])
        else:  # the ranks shut their own sockets down (rank_killer)
            spec.update(start=start, end=end, every=k["every_s"])
            _write_json(os.path.join(work, "kill-spec.json"), spec)
            rec["first_t"] = start
            while time.time() < end + 0.5 and not self.poll(procs):
                time.sleep(0.02)
            for r in procs:
                for e in events_of(_read(os.path.join(work, f"rank{r}.events.jsonl"))):
                    if e.get("ev") == "kill-tick":
                        rec["ticks"].append({"rank": r, "t": e["t"], "killed": e["killed"]})
        rec["killed_total"] = sum(t["killed"] for t in rec["ticks"])
        self.log(f"{self.net}: kill window over: {rec['what']}; {rec['killed_total']} sockets killed "
                 f"({self.kill_mode})")
        return rec


LIVE: list[subprocess.Popen] = []  # the rank processes this driver started and has not reaped


def _kill_group(p: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """End one rank we started, by its pid: SIGTERM, then SIGKILL after 3 s."""
    try:
        p.send_signal(sig)
    except OSError:
        pass
    if sig == signal.SIGTERM:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            try:
                p.kill()
            except OSError:
                pass


def _on_term(signum, frame) -> None:
    """timeout(1) or the caller ends the run: end our ranks first (they may be stuck in NCCL)."""
    for p in list(LIVE):
        try:
            p.kill()
        except OSError:
            pass
    print(f"gpu_nccl: signal {signum}: ranks killed, no report written", file=sys.stderr, flush=True)
    os._exit(124)


def run(a) -> int:
    t_start = time.time()
    deadline = t_start + a.budget_s - REPORT_RESERVE_S
    signal.signal(signal.SIGTERM, _on_term)
    plan = default_plan(a.out, a.plugin, sys.executable, cpu_selftest=a.cpu_selftest)
    os.makedirs(os.path.join(plan["out"], "logs"), exist_ok=True)
    os.makedirs(plan["lanes_dir"], exist_ok=True)

    def log(msg: str) -> None:
        print(f"  {time.strftime('%H:%M:%S')} {msg}", flush=True)

    bad = validate_plan(plan, a.budget_s)
    if bad:
        print("plan not valid:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    pr = probe()
    _write_json(os.path.join(plan["out"], "probe.json"), pr)
    kill_mode = a.kill_method if a.kill_method != "auto" else ("ss" if pr["ss_kill"]["ok"] else "shutdown")
    log(f"probe: ss -K {'works' if kill_mode == 'ss' else 'refused: ' + json.dumps(pr['ss_kill'])}; "
        f"netns {pr['netns']['ok']}, nft {pr['nft']['ok']}, tc {pr['tc']['ok']}; planes {pr['loopback_planes']}")
    gi = gpu_info()
    log(f"gpu: {gi}")
    state = {"multi_rank": False, "plugin_mode": "path"}
    phases: dict[str, dict] = {}
    for net in NETS:
        phases[net] = Phase(plan, net, deadline, state, kill_mode, log).run()
        ko = phases[net].get("kill_outcome", {})
        log(f"{net}: ready={phases[net].get('ready')} kill loop: {ko.get('outcome')} {ko.get('why', '')}")
    logs = {}
    for net, ph in phases.items():
        for r in range(NRANKS):
            path = os.path.join(ph.get("work", ""), f"rank{r}.nccl.log")
            if ph.get("work") and os.path.exists(path):
                logs[f"{net.lower()} rank{r}"] = _read(path)
    lines = plugin_lines(logs)
    with open(os.path.join(plan["out"], "nccl-plugin-lines.txt"), "w") as f:
        f.write("\n".join(lines) + ("\n" if lines else ""))
    nccl = {net: parse_nccl_log(ph.get("nccl_text", "")) for net, ph in phases.items()}
    for v in nccl.values():
        v["warnings"] = v["warnings"][:20]
    ev0 = phases.get("LinkPass", {}).get("events0", []) or phases.get("Socket", {}).get("events0", [])
    cuda = next((e for e in ev0 if e.get("ev") == "cuda"), {})
    smi = gi.get("nvidia_smi", "")
    gpu = cuda.get("gpu") or (smi.split(",")[0] if smi and not smi.startswith(("failed", "not installed"))
                              else "no GPU seen")
    machine = f"{gpu}, {os.cpu_count()} cores, Linux {platform.release().split('-')[0]}"
    rows = build_rows(phases)
    doc = document(rows, machine,
                   versions={k: cuda.get(k) for k in ("torch", "cuda", "nccl")} | {"nccl_log": next(
                       (v["version"] for v in nccl.values() if v["version"]), None)},
                   nccl=nccl, probe=pr, gpu=gi, settings=state | {"kill_method": kill_mode},
                   phases={net: {"tries": ph.get("tries"), "exits": ph.get("exits"), "ready": ph.get("ready"),
                                 "kill": {k: v for k, v in (ph.get("kill") or {}).items() if k != "ticks"},
                                 "logs": os.path.relpath(ph["work"], plan["out"]) if ph.get("work") else None}
                           for net, ph in phases.items()},
                   elapsed_s=round(time.time() - t_start, 1))
    _write_json(os.path.join(plan["out"], "gpu_nccl.json"), doc)
    summary = table(rows)
    with open(os.path.join(plan["out"], "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary)
    for net, v in nccl.items():
        print(f"{net}: loaded {v['loaded']} using {v['using']} devices "
              f"{v['linkpass_devices'] or v['socket_devices']} channels {v['channels']}")
    print(f"wrote {os.path.join(plan['out'], 'gpu_nccl.json')} and nccl-plugin-lines.txt ({len(lines)} lines)")
    return 0 if phases.get("LinkPass", {}).get("ready") else 1


# ---- one rank (torch) ---------------------------------------------------------------------------------

class Events:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def put(self, ev: str, **kw) -> None:
        with self.lock:
            self.f.write(json.dumps({"ev": ev, "t": time.time(), **kw}) + "\n")
            self.f.flush()


def own_sockets() -> list[dict]:
    return _proc_sockets("self")


def rank_killer(work: str, ev: Events, stop: threading.Event) -> None:
    """The fallback kill, inside the rank: wait for kill-spec.json, then for its window shut down
    (shutdown(2) on a dup of the fd) this process's sockets it names: by plane prefix, or exact
    connections. No C code involved; NCCL's and the plugin's threads see EOF and errors."""
    path = os.path.join(work, "kill-spec.json")
    while not stop.is_set() and not os.path.exists(path):
        time.sleep(0.01)
    if stop.is_set():
        return
    spec = json.loads(_read(path))
    mine = [tuple(x) for x in spec.get("pairs", {}).get(str(os.getpid()), [])]
    while time.time() < spec["start"] and not stop.is_set():
        time.sleep(0.005)
    while time.time() < spec["end"] and not stop.is_set():
        own = own_sockets()
        if spec.get("prefix"):
            targets = plane_sockets(own, spec["prefix"])
        else:
            targets = [s for s in own if (*s["local"], *s["remote"]) in mine and s["state"] == ESTABLISHED]
        n = 0
        for s in targets:
            try:
                d = os.dup(s["fd"])
            except OSError:
                continue
            try:
                so = socket.socket(fileno=d)
            except OSError:
                os.close(d)
                continue
            try:
                if same_endpoint(so.getsockname(), s["local"]):  # the fd still holds that socket
                    so.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:
                pass
            finally:
                so.close()  # the dup only: the rank's own fd stays, now shut down
        ev.put("kill-tick", killed=n)
        time.sleep(spec["every"])


def rank_main(a) -> int:
    work, r = a.work, a.rank
    plan = json.loads(_read(os.path.join(work, "rank-plan.json")))
    ev = Events(os.path.join(work, f"rank{r}.events.jsonl"))
    ev.put("start", pid=os.getpid(), env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "LINKPASS_"))})
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        ev.put("error", msg=f"import torch: {e!r}")
        return 3
    stop = threading.Event()
    try:
        timeout = dt.timedelta(seconds=plan["torch_timeout_s"])
        store = dist.TCPStore("127.0.0.1", plan["store_port"], plan["nranks"], r == 0, timeout=timeout)
        gpu = plan.get("backend", "nccl") == "nccl"
        if gpu:
            dev = torch.device("cuda", 0)
            torch.cuda.set_device(dev)
            try:
                v = torch.cuda.nccl.version()
                nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                nccl = f"unknown ({e!r})"
            ev.put("cuda", gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                   nccl=nccl, capability=".".join(map(str, torch.cuda.get_device_capability(0))))
            sync = torch.cuda.synchronize
            try:
                dist.init_process_group("nccl", store=store, rank=r, world_size=plan["nranks"], timeout=timeout,
                                        device_id=dev)  # eager: NCCL's comm (and bootstrap) exists after this
            except TypeError:
                dist.init_process_group("nccl", store=store, rank=r, world_size=plan["nranks"], timeout=timeout)
        else:  # --cpu-selftest
            dev = torch.device("cpu")
            ev.put("cuda", gpu=None, torch=torch.__version__, cuda=None, nccl=None)

            def sync() -> None:
                pass
            dist.init_process_group("gloo", store=store, rank=r, world_size=plan["nranks"], timeout=timeout)
        nccl_log = _read(os.environ.get("NCCL_DEBUG_FILE", "/nonexistent"))
        ev.put("ready", baseline=baseline_of(own_sockets()), eager_init="Init COMPLETE" in nccl_log)
        store.set(f"ready{r}", "1")
        store.wait([f"ready{q}" for q in range(plan["nranks"])])
        if plan.get("kill_mode") == "shutdown":
            threading.Thread(target=rank_killer, args=(work, ev, stop), daemon=True).start()

        def agree(key: str, decide) -> int:
            """A count every rank uses: rank 0 decides it, the store carries it (a collective
            loop whose ranks disagree on its length hangs)."""
            if r == 0:
                store.set(key, str(int(decide())))
            return int(store.get(key))

        def make(count: int):
            idx = torch.arange(count, dtype=torch.int32, device=dev)

            def fill(seed: int):
                v = torch.remainder(idx + seed, 1009) + 1  # 1..1009: exact in float32, sums too
                x = (v + 2048 * r).to(torch.float32)
                expect = (v * plan["nranks"] + 2048 * sum(range(plan["nranks"]))).to(torch.float32)
                return x, expect
            return fill

        def once(fill, seed: int) -> tuple[float, bool, float]:
            """One checked all-reduce: (seconds, result exact, wall-clock start)."""
            x, expect = fill(seed)
            sync()
            wall, t0 = time.time(), time.perf_counter()
            dist.all_reduce(x)
            sync()
            secs = time.perf_counter() - t0
            return secs, bool(torch.equal(x, expect)), wall

        for m in plan["sizes_mib"]:
            warm, planned = plan["iters"][str(m)]
            fill = make(m * MiB // 4)
            wrong = 0
            warm_times = []
            for i in range(warm):
                secs, ok, _ = once(fill, i)
                warm_times.append(secs)
                wrong += not ok
            iters = agree(f"iters{m}", lambda: timed_iters(planned, warm_times[-1], plan["size_cap_s"],
                                                            plan["min_timed_iters"]))
            times = []
            for i in range(iters):
                secs, ok, _ = once(fill, warm + i)
                times.append(secs)
                wrong += not ok
            ev.put("bench", size_mib=m, warmup=warm, iters=iters, times=times, wrong=wrong, warm_times=warm_times)
            del fill
        k = plan["kill"]

        def loop_n() -> int:
            b = [e for e in events_of(_read(os.path.join(work, "rank0.events.jsonl")))
                 if e.get("ev") == "bench" and e.get("size_mib") == k["size_mib"]]
            med = statistics.median(b[0]["times"]) if b and b[0]["times"] else 0.05
            return int(min(k["max_iters"], max(k["min_iters"], k["loop_s"] / max(med, 1e-4))))
        n = agree("loop_n", loop_n)
        fill = make(k["size_mib"] * MiB // 4)
        ev.put("loop-start", n=n, size_mib=k["size_mib"])
        for i in range(n):
            secs, ok, wall = once(fill, i)
            ev.put("it", i=i, t0=wall, dt=secs, ok=ok)
        ev.put("loop-end")
        stop.set()
        dist.destroy_process_group()
        ev.put("done")
        return 0
    except BaseException as e:  # noqa: BLE001 - recorded for the report; the exit code says it too
        import traceback
        ev.put("error", msg=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
        stop.set()
        sys.stdout.flush()
        os._exit(3)  # NCCL's threads may hold the process: leave now


# ---- the command line ------------------------------------------------------------------------------------

def plan_cmd(a) -> int:
    plan = default_plan(a.out, a.plugin, a.python)
    print("gpu_nccl plan" + (" (dry run: nothing is started, no GPU is touched)" if a.dry_run else ""))
    print(f"plugin: {plan['plugin']} ({'present' if os.path.isfile(plan['plugin']) else 'MISSING'})")
    print(f"python: {plan['python']} (the ranks import torch; this plan does not)")
    print(f"nets: LinkPass (NCCL_NET=LinkPass, the plugin) and Socket (NCCL_NET=Socket, NCCL's own; peer '{PEER}')")
    print(f"sizes: {', '.join(f'{m} MiB' for m in plan['sizes_mib'])}")
    for line in plan_lines(plan, a.budget_s):
        print(line)
    bad = validate_plan(plan, a.budget_s)
    if not os.path.isfile(plan["plugin"]):
        bad.append(f"no plugin at {plan['plugin']}")
    if a.dry_run:
        os.makedirs(a.out, exist_ok=True)
        pr = probe()
        _write_json(os.path.join(os.path.abspath(a.out), "probe.json"), pr)
        print(f"probe (this host): ss -K {'works' if pr['ss_kill']['ok'] else 'refused'}, netns "
              f"{'yes' if pr['netns']['ok'] else 'no'}, nft {'yes' if pr['nft']['ok'] else 'no'}, tc "
              f"{'yes' if pr['tc']['ok'] else 'no'}, planes {pr['loopback_planes']}")
    if bad:
        print("plan NOT valid:\n  " + "\n  ".join(bad))
        return 2
    print("plan ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--plugin", default=DEFAULT_PLUGIN)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("probe")
    p.add_argument("--out", required=True)
    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--plugin", default=DEFAULT_PLUGIN)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--kill-method", choices=("auto", "ss", "shutdown"), default="auto",
                   help="auto: ss -K where the probe saw it work, else shutdown(2) inside the ranks")
    p.add_argument("--cpu-selftest", action="store_true",
                   help="check this driver on a CPU: gloo ranks instead of NCCL, a few iterations (no GPU)")
    p = sub.add_parser("rank")
    p.add_argument("--work", required=True)
    p.add_argument("--rank", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan_cmd(a)
    if a.cmd == "probe":
        os.makedirs(a.out, exist_ok=True)
        pr = probe()
        _write_json(os.path.join(a.out, "probe.json"), pr)
        print(json.dumps(pr, indent=2))
        return 0
    if a.cmd == "run":
        return run(a)
    return rank_main(a)


if __name__ == "__main__":
    sys.exit(main())

"""Faults on testbed links, each made of a real kernel mechanism (this kernel has no netem).

    down      the link loses carrier: the upper end (leaf port, spine port) goes admin-down;
              routes through the link stay on the lower end (marked linkdown), so traffic that
              hashes onto it is black-holed until someone reroutes, as with a cut fibre
    flap      down/up every --period, by a bounded background process
    loss      random loss of PCT % (nftables `numgen random`), one direction or both
    mtu       drop IP packets larger than N bytes (an MTU black hole)
    congest   token-bucket rate limit (tbf) with its queue: throughput cap plus queueing delay

Loss and MTU rules of a link live in ONE nftables transaction in the upper end's namespace:
traffic towards the upper end is filtered on that interface's `ingress` hook, traffic from it
on its `egress` hook, so a two-way fault takes effect at a single instant. Every apply and clear
rewrites the namespace's whole table in one `nft -f` transaction (add, delete, re-create).

The pure part (FaultSpec, validation, rendering of nft scripts) has no I/O; `apply`/`clear`
do the kernel work and record each fault, with the time it took effect, in the state file.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from ..kernel.rtnl import TC_H_ROOT, IPRoute

from ..kernel import netns as ns_io
from . import state
from .build import TestbedError, ensure_neighbors, ensure_routes, load_fabric
from .topology import Fabric, Link, Route

KINDS = ("down", "flap", "loss", "mtu", "congest")
IFF_UP = 0x1  # <linux/if.h>
L2_HEADER = 14  # netdev egress sees the Ethernet header in `meta length`, ingress does not
LOSS_SCALE = 1_000_000  # loss resolution: 1 ppm
MAX_FLAP_DURATION_S = 3600.0


# ---- parsing (pure) -----------------------------------------------------------------------

_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_UNITS_BPS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_duration(text: str | float, what: str) -> float:
    """'200ms' -> 0.2; a bare number means seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|m)?\s*", str(text))
    if not m:
        raise TestbedError(f"{what}: {text!r} is not a duration; use e.g. 200ms, 1.5s")
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]


def parse_rate(text: str | float, what: str) -> int:
    """'10mbit' -> 10_000_000 bits per second."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)\s*", str(text).lower())
    if not m:
        raise TestbedError(f"{what}: {text!r} is not a rate; use e.g. 10mbit, 1gbit")
    return int(float(m.group(1)) * _UNITS_BPS[m.group(2)])


@dataclass
class FaultSpec:
    kind: str
    link: str
    direction: str | None = None  # node the affected traffic leaves from; None = both ways
    params: dict = field(default_factory=dict)


def validate(fab: Fabric, spec: FaultSpec) -> FaultSpec:
    """Check a fault against the fabric; return it with the link name made canonical."""
    if spec.kind not in KINDS:
        raise TestbedError(f"fault kind {spec.kind!r} is unknown; choose one of {', '.join(KINDS)}")
    lk = fab.link(spec.link)
    if spec.direction is not None:
        if spec.kind in ("down", "flap"):
            raise TestbedError(f"{spec.kind} takes the whole link down; --from applies to loss, mtu and congest")
        if spec.direction not in (lk.a, lk.b):
            raise TestbedError(f"--from {spec.direction!r}: must be one end of {lk.name} ({lk.a} or {lk.b})")
    p = dict(spec.params)
    if spec.kind == "loss":
        pct = p.get("pct")
        if not isinstance(pct, (int, float)) or not 0 < pct <= 100:
            raise TestbedError(f"loss: PCT must be a number in (0, 100], got {pct!r}")
    elif spec.kind == "mtu":
        size = p.get("bytes")
        if not isinstance(size, int) or not 68 <= size < fab.spec.mtu:
            raise TestbedError(f"mtu: N must be an integer IP packet size 68..{fab.spec.mtu - 1}, got {size!r}")
    elif spec.kind == "congest":
        p["rate_bps"] = parse_rate(p.get("rate", "100mbit"), "congest --rate")
        p["queue_s"] = parse_duration(p.get("queue", "20ms"), "congest --queue")
        if not 8_000 <= p["rate_bps"] <= 32_000_000_000:
            raise TestbedError("congest --rate: must be between 8kbit and 32gbit")
        if not 0.001 <= p["queue_s"] <= 2.0:
            raise TestbedError("congest --queue: must be between 1ms and 2s")
        if fab.is_guest(lk.a) and "up" in _directions(lk, spec.direction):
            raise TestbedError(f"congest: traffic leaving {lk.a} queues inside that Soft-RoCE guest, out of the "
                               f"testbed's reach; shape the other direction with --from {lk.b}, or use loss")
    elif spec.kind == "flap":
        p["period_s"] = parse_duration(p.get("period", "1s"), "flap --period")
        p["duration_s"] = parse_duration(p.get("duration", "600s"), "flap --duration")
        if not 0.01 <= p["period_s"] <= 600:
            raise TestbedError("flap --period: must be between 10ms and 600s")
        if not 0 < p["duration_s"] <= MAX_FLAP_DURATION_S:
            raise TestbedError(f"flap --duration: must be between 0 and {MAX_FLAP_DURATION_S:.0f}s (flapping is bounded)")
    return FaultSpec(spec.kind, lk.name, spec.direction, p)


def _directions(lk: Link, direction: str | None) -> list[str]:
    """'up' = from a (lower) to b (upper), 'down' = from b to a."""
    if direction is None:
        return ["up", "down"]
    return ["up"] if direction == lk.a else ["down"]


def restorable(routes: list[Route], up_ifnames: set[str]) -> list[Route]:
    """The baseline routes that can be put back while only `up_ifnames` are up: the kernel refuses
    a nexthop on an admin-down port (ENETUNREACH), so a route keeps its hops on ports that are up
    and is left out when it has none. Bringing up the other ports restores the rest."""
    out = []
    for route in routes:
        via = tuple(hop for hop in route.via if hop[1] in up_ifnames)
        if via:
            out.append(route if via == route.via else Route(route.dst, via, route.src))
    return out


def nft_table(prefix: str) -> str:
    return f"{prefix}_faults"


def render_nft(prefix: str, fab: Fabric, faults: list[dict], node: str) -> str:
    """The whole fault table of one namespace as a single atomic nft transaction."""
    table = nft_table(prefix)
    chains: dict[str, list[str]] = {}
    for f in faults:
        if f["kind"] not in ("loss", "mtu"):
            continue
        lk = fab.link(f["link"])
        if lk.b != node:
            continue
        for d in _directions(lk, f.get("direction")):
            hook = "ingress" if d == "up" else "egress"
            key = f"{hook}:{lk.b_if}"
            if f["kind"] == "loss":
                thr = round(f["params"]["pct"] * LOSS_SCALE / 100)
                rule = "counter drop" if thr >= LOSS_SCALE else f"numgen random mod {LOSS_SCALE} < {thr} counter drop"
            else:
                limit = f["params"]["bytes"] + (L2_HEADER if hook == "egress" else 0)
                rule = f"meta length > {limit} counter drop"
            chains.setdefault(key, []).append(f'{rule} comment "fault {f["id"]}"')
    lines = [f"table netdev {table}", f"delete table netdev {table}"]
    if chains:
        lines.append(f"table netdev {table} {{")
        for key, rules in sorted(chains.items()):
            hook, dev = key.split(":")
            lines.append(f" chain {hook}_{dev} {{")
            lines.append(f'  type filter hook {hook} device "{dev}" priority 0; policy accept;')
            lines.extend(f"  {r}" for r in rules)
            lines.append(" }")
        lines.append("}")
    return "\n".join(lines) + "\n"


# ---- kernel actions --------------------------------------------------------------------

# Where inside the kernel call a fault starts dropping packets, as a share of the call's duration.
# Measured on this machine with a 20 µs UDP stream (6 tries each): a port going admin-down stops
# traffic at the call's midpoint (±0.03 ms of 0.5-1.4 ms calls; the acknowledgement waits for
# RCU grace periods after the device is closed); a testbed loss fault (`nft -f` of the leaf's
# table, h0 -> h2 across it) drops from 36-50 % (median 40 %) into its 9-20 ms: exec, parse,
# commit, then teardown. The call's bounds are recorded (`effective_window_ns`): the fault
# began inside them.
LINK_DOWN_SHARE = 0.5
NFT_COMMIT_SHARE = 0.4
# The call that takes a link down (or up) runs at this SCHED_FIFO priority, above the agents' probe threads
# (probe.rt_priority, 10 by default) and decision loops: a fault is the fabric's, not this
# host's, and at normal priority the call that makes it waits for a CPU behind the agents'
# reaction to it. Measured on the testbed: at normal priority such calls took up to 12 ms and
# agents saw the silence begin up to 2 ms before the midpoint stamp; above the agents they take
# 0.6-0.9 ms and the first lost probe was sent 0.27-1.4 ms after the stamp (a probe interval).
FAULT_RT_PRIORITY = 50


@contextlib.contextmanager
def _above_agents():
    """SCHED_FIFO at FAULT_RT_PRIORITY for the calling thread while the link changes state;
    normal scheduling where the kernel refuses (not root)."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FAULT_RT_PRIORITY))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def _stamp(before: int, after: int, share: float) -> tuple[int, int, int]:
    return before + int((after - before) * share), before, after


def set_link_state(fab: Fabric, lk: Link, up: bool) -> tuple[int, int, int]:
    """Carrier on/off for a link by its upper end; on up, restore that end's routes.

    Returns CLOCK_MONOTONIC ns (estimate, call start, call end) of the change (LINK_DOWN_SHARE)."""
    with IPRoute(netns=fab.netns(lk.b)) as ipr:
        idx = ipr.link_lookup(ifname=lk.b_if)[0]
        with _above_agents():
            before = time.monotonic_ns()
            ipr.link("set", index=idx, state="up" if up else "down")
            after = time.monotonic_ns()
        stamp = _stamp(before, after, LINK_DOWN_SHARE)
        if up:
            # admin-down flushed the neighbours and routes of this port; put the baseline back,
            # through the ports that are up (another link of this node may still be down)
            up_ifnames = {ln.get_attr("IFLA_IFNAME") for ln in ipr.get_links() if ln["flags"] & IFF_UP}
            ensure_neighbors(ipr, [n for n in fab.neighbors(lk.b) if n[0] in up_ifnames])
            ensure_routes(ipr, restorable(fab.routes.get(lk.b, []), up_ifnames))
    return stamp


def _apply_nft(fab: Fabric, faults: list[dict], node: str) -> tuple[int, int, int]:
    script = render_nft(fab.prefix, fab, faults, node)
    before = time.monotonic_ns()  # not above the agents: `nft` parses for ~10 ms, too long to hold a CPU
    ns_io.exec_in_netns(fab.netns(node), ["nft", "-f", "-"], input=script)
    return _stamp(before, time.monotonic_ns(), NFT_COMMIT_SHARE)


def _apply_tbf(fab: Fabric, node: str, ifname: str, rate_bps: int, queue_s: float) -> int:
    with IPRoute(netns=fab.netns(node)) as ipr:
        idx = ipr.link_lookup(ifname=ifname)[0]
        burst = max(fab.spec.mtu * 2, rate_bps // 8 // 250)  # ~4 ms of tokens, at least 2 MTUs
        # the queue holds `queue_s` worth of bytes at the shaped rate, as tc's `latency` would
        limit = int(rate_bps / 8 * queue_s) + burst
        ipr.tc("replace", "tbf", idx, rate=f"{rate_bps}bit", burst=burst, limit=limit)
        return time.monotonic_ns()


def _clear_tbf(fab: Fabric, node: str, ifname: str) -> None:
    with IPRoute(netns=fab.netns(node)) as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if idx:
            try:
                ipr.tc("del", index=idx[0], parent=TC_H_ROOT)
            except Exception as exc:  # ENOENT: no root qdisc of ours left
                if getattr(exc, "code", None) != errno.ENOENT:
                    raise


def _congest_ends(lk: Link, direction: str | None) -> list[tuple[str, str]]:
    """(node, interface) whose egress queue shapes each affected direction."""
    return [(lk.a, lk.a_if) if d == "up" else (lk.b, lk.b_if) for d in _directions(lk, direction)]


def _conflict(existing: list[dict], new: FaultSpec, lk: Link) -> str | None:
    for f in existing:
        if f["link"] != new.link:
            continue
        if f["kind"] in ("down", "flap") and new.kind in ("down", "flap"):
            return f"link {lk.name} is already {f['kind']} (fault {f['id']})"
        if f["kind"] == new.kind and new.kind in ("loss", "mtu", "congest"):
            mine = set(_directions(lk, new.direction))
            theirs = set(_directions(lk, f.get("direction")))
            if mine & theirs:
                return f"link {lk.name} already has a {f['kind']} fault in that direction (fault {f['id']})"
    return None


def apply(prefix: str, spec: FaultSpec) -> dict:
    """Apply a fault; return its record (with `effective_at`, the time it took effect)."""
    fab = load_fabric(prefix)
    spec = validate(fab, spec)
    lk = fab.link(spec.link)
    with state.locked(prefix):
        doc = state.load(prefix)
        if doc is None:
            raise TestbedError(f"testbed {prefix!r} went away")
        clash = _conflict(doc["faults"], spec, lk)
        if clash:
            raise TestbedError(f"{clash}; clear it first with `linkpass testbed fault --clear {lk.name}`")
        rec = {"id": doc["next_fault_id"], **asdict(spec)}
        t0 = time.perf_counter()
        window = None
        if spec.kind == "down":
            effective, *window = set_link_state(fab, lk, up=False)
        elif spec.kind in ("loss", "mtu"):
            effective, *window = _apply_nft(fab, doc["faults"] + [rec], lk.b)
        elif spec.kind == "congest":
            effective = 0
            for node, ifname in _congest_ends(lk, spec.direction):
                effective = _apply_tbf(fab, node, ifname, spec.params["rate_bps"], spec.params["queue_s"])
        else:  # flap
            effective = time.monotonic_ns()
            rec["pid"] = _start_flapper(prefix, rec)
        if window:
            rec["effective_window_ns"] = window
        rec["apply_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        wall_offset = time.time_ns() - time.monotonic_ns()
        rec["effective_mono_ns"] = effective
        rec["effective_at"] = _dt.datetime.fromtimestamp((effective + wall_offset) / 1e9, _dt.timezone.utc).isoformat(
            timespec="microseconds")
        doc["faults"].append(rec)
        doc["next_fault_id"] += 1
        state.save(prefix, doc)
    return rec


def clear(prefix: str, link: str | None = None) -> list[dict]:
    """Remove all faults (or those on one link). Returns the removed records."""
    canonical = load_fabric(prefix).link(link).name if link else None
    return _clear_where(prefix, lambda f: canonical is None or f["link"] == canonical)


def clear_ids(prefix: str, ids: list[int]) -> list[dict]:
    return _clear_where(prefix, lambda f: f["id"] in ids)


def _clear_where(prefix: str, selected) -> list[dict]:
    """Undo the selected faults; each removed record gets `cleared_mono_ns`, when it stopped.

    Each fault is undone on its own: one that cannot be (the kernel refused) keeps its record,
    the others are cleared and recorded as such, and the error names what is left."""
    fab = load_fabric(prefix)
    with state.locked(prefix):
        doc = state.load(prefix)
        if doc is None:
            raise TestbedError(f"testbed {prefix!r} went away")
        chosen = [f for f in doc["faults"] if selected(f)]
        gone, failed = [], []
        nft_nodes = set()
        for f in chosen:
            lk = fab.link(f["link"])
            try:
                if f["kind"] == "flap":
                    _stop_flapper(f.get("pid"))
                    effective = set_link_state(fab, lk, up=True)[0]
                elif f["kind"] == "down":
                    effective = set_link_state(fab, lk, up=True)[0]
                elif f["kind"] == "congest":
                    for node, ifname in _congest_ends(lk, f.get("direction")):
                        _clear_tbf(fab, node, ifname)
                    effective = time.monotonic_ns()
                else:
                    nft_nodes.add(lk.b)
                    effective = None
            except Exception as exc:  # noqa: BLE001 - reported below, with the fault it belongs to
                failed.append((f, exc))
                continue
            f["cleared_mono_ns"] = effective
            gone.append(f)
        keep = [f for f in doc["faults"] if f not in gone]
        for node in sorted(nft_nodes):
            t = _apply_nft(fab, keep, node)[0]
            for f in gone:
                if f["cleared_mono_ns"] is None and fab.link(f["link"]).b == node:
                    f["cleared_mono_ns"] = t
        doc["faults"] = keep
        state.save(prefix, doc)
    if failed:
        what = "; ".join(f"fault {f['id']} ({f['kind']} on {f['link']}): {exc}" for f, exc in failed)
        raise TestbedError(f"{len(failed)} of {len(chosen)} faults could not be cleared and are still recorded: "
                           f"{what}; `linkpass testbed down --prefix {prefix}` removes the whole testbed")
    return gone


def active(prefix: str) -> list[dict]:
    doc = state.load(prefix)
    if doc is None:
        raise TestbedError(f"no testbed with prefix {prefix!r} is up")
    faults = doc["faults"]
    for f in faults:
        if f["kind"] == "flap":
            f["running"] = bool(f.get("pid")) and os.path.exists(f"/proc/{f['pid']}")
    return faults


# ---- the flapper process -----------------------------------------------------------------

def _start_flapper(prefix: str, rec: dict) -> int:
    log = open(state.flap_log_path(prefix, rec["id"]), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "linkpass.testbed.flapper", "--prefix", prefix, "--link", rec["link"],
         "--period", str(rec["params"]["period_s"]), "--duration", str(rec["params"]["duration_s"])],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return proc.pid


def flap_transitions(prefix: str, fault_id: int) -> list[tuple[int, str]]:
    """A flap fault's transitions so far: (CLOCK_MONOTONIC ns when it took effect, "down"/"up")."""
    try:
        with open(state.flap_log_path(prefix, fault_id)) as f:
            lines = [ln.split() for ln in f if ln.endswith("\n")]
    except FileNotFoundError:
        return []
    return [(int(p[0]), p[1]) for p in lines if len(p) >= 2 and p[0].isdigit()]


def _stop_flapper(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)  # reap if it is our child
            if waited == pid:
                return
        except ChildProcessError:
            pass
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.01)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

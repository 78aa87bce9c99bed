"""How often each of the agent's paths is probed: its *rate*, from what the job's traffic uses,
within the probe budget. Runs on the agent's main loop (`tick`), with one thread of its own that
samples this host's TCP connections and RDMA counters (`start`/`stop`).

    TCP sampler (thread, once per idle interval) ──┐
    lane reports (lanes_reader.py, every few ms) ───┼─► Activity (core/activity.py) ─► each path's rate
    RDMA counters beyond the probes ────────────────┘       │
                                                             ▼
    probe budget (core/budget.py: pps ceiling × CPU governor) ─► apportion ─► engine.set_interval

The fastest path's interval also sets how often on-time replies are taken (`batch_s`,
`next_batch`): the main loop's poll follows it. Logs `path_rates` and `probe_budget` at most
once a second, `rdma_unreported` when the planes it marks change.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..core.activity import (ACTIVE, IDLE, PROGRESSING, RATES, STANDBY, WRITER_SILENT_WINDOWS, Activity, LaneSeen,
                             PathKey, UnreportedRdma, batch_interval_s)
from ..core.budget import (ACTIVE as B_ACTIVE, COVERAGE, REST, STANDBY as B_STANDBY, Apportioned, CpuGovernor,
                           apportion)
from ..kernel.rdma import Device, RdmaUnavailable, port_packets
from ..kernel.sockdiag import TcpActivity, peer_addresses
from .config import AgentConfig
from .lanes_reader import LanesReader

RATES_LOG_EVERY_NS = 1_000_000_000
RATES_FULL_EVERY_NS = 50_000_000  # every path classified again at least this often: stall holds and idle_after run out


class Rates:
    """The rates of one agent's paths. `cfg`: the agent's config now (a reload or a plan replaces
    it); `labels`: the agent's paths (peer, plane, ...), shared; `is_config_peer`: whether a peer
    is the config file's (the job's, with rates off); `errors`: the loop's error counter;
    `stopping`: set when the agent stops; `log`: the agent's log."""

    def __init__(self, cfg: Callable[[], AgentConfig], engine, labels: dict, is_config_peer: Callable[[str], bool],
                 errors, stopping: threading.Event, dry_run: bool, log):
        self._cfg = cfg
        self.log = log
        cfg = cfg()
        self.engine = engine
        self.labels = labels
        self.is_config_peer = is_config_peer
        self.errors = errors
        self.stopping = stopping
        # the probe core's lane watch (linkpass/probe/lane_watch.h), when the engine has one: the lane
        # reader's generation of reports it was given, so a new or gone report is passed on (None: no watch)
        self._watched: int | None = None
        # what the job's traffic uses (TCP sampled once per idle interval, lane reports every
        # few ms) sets each path's rate (linkpass/core/activity.py)
        self.activity = Activity(int(cfg.idle_after_ms * 1e6), int(cfg.progress_window_ms * 1e6)) if cfg.idle_rates else None
        self.lanes = _lanes_reader(cfg, log) if cfg.idle_rates and not dry_run else None
        self.lane_addrs: tuple[tuple, dict[str, tuple[str, int]]] = ((), {})  # (peers, address -> (peer, plane))
        self.path_keys: dict[int, PathKey] = {}
        self.intervals: dict[int, float] = {}  # path -> the interval it is probed at now, seconds
        self.batch_s = cfg.batch_ms / 1000  # how often on-time replies are taken now: follows the fastest path
        self.next_batch = 0.0  # when on-time replies are next taken (monotonic s)
        self.moving: tuple[int, set[tuple[str, int | None]]] | None = None  # the sampler's latest look
        self._moving_fed: tuple | None = None  # ... as last given to the rates
        self._rates_full_at = 0  # when every path was last classified
        # RDMA traffic no lane reports: the sampler's latest read of each plane's RDMA packet
        # counter (when, plane -> packets), and which planes that made active, as last logged
        self.rdma_ports: tuple[int, dict[int, int]] | None = None
        self.unreported: UnreportedRdma | None = None
        self._rdma_fed = 0
        self._rdma_said: list[int] = []
        self._rdma_pps: dict[int, float] = {}  # plane -> packets/s beyond the probes, at its latest look over the floor
        self._rates_went: dict[str, set[str]] = {}  # rate -> peers with paths that went to it, not logged yet
        self._rates_logged = 0
        # the probe budget (linkpass/core/budget.py): the pps ceiling, times the CPU governor's factor
        self.governor = CpuGovernor(cfg.budget_cpu_pct / 100)
        self.budget: Apportioned | None = None
        self._budget_logged: tuple[int, tuple] = (0, ())  # when, and the degraded classes it said
        self._cpu_at = (time.process_time(), time.monotonic())
        self.sampler: threading.Thread | None = None
        self.next_look = 0.0  # when rates are next looked at
        self.next_cpu = 0.0  # when the CPU governor next looks (probe.budget_cpu_pct)

    @property
    def cfg(self) -> AgentConfig:
        return self._cfg()

    # ---- the agent's calls -------------------------------------------------------------
    def rate_of(self, pid: int) -> str:
        return self.activity.rate.get(pid, ACTIVE) if self.activity is not None else ACTIVE

    def add_path(self, pid: int, key: PathKey) -> None:
        """A new path, at the active interval until its rate is known."""
        self.path_keys[pid] = key
        self.intervals[pid] = self.cfg.interval_ms / 1000

    def remove_path(self, pid: int) -> None:
        self.path_keys.pop(pid, None)
        self.intervals.pop(pid, None)

    def paths_added(self) -> None:
        """After paths were added: each at its rate from its first probes (all at the active rate, a
        host with many paths would spend its first seconds saturated, deciding late on a backlog),
        within the budget."""
        if self.activity is not None:
            self.update(full=True)
        self.apply_intervals()

    def reconfigured(self) -> None:
        """After a reload: the windows and the CPU share it may have changed."""
        cfg = self.cfg
        if self.activity is not None:
            self.activity.idle_after_ns = int(cfg.idle_after_ms * 1e6)
            self.activity.progress_window_ns = int(cfg.progress_window_ms * 1e6)
            if self._watched is not None:
                self._watched = -1  # the watch takes the new window at the next look
        self.governor.share = cfg.budget_cpu_pct / 100
        if not self.governor.share:
            self.governor.factor = 1.0
        self.apply_intervals()

    def tick(self, run) -> None:
        """The main loop's step (`run`: its error-counting runner): rates looked at when due or when
        the lane watch saw a change; the CPU governor once a second."""
        if self.activity is not None:
            watch_saw = self._watched is not None and self.engine.lanes_changed()
            if watch_saw or time.monotonic() >= self.next_look:
                if watch_saw:
                    self.activity.unsettle(time.monotonic_ns())
                run("rates", self.update)
                # after the look: one that found a change keeps looking often until the view settles
                self.next_look = time.monotonic() + self.every_s()
        if self.cfg.budget_cpu_pct and time.monotonic() >= self.next_cpu:
            self.next_cpu = time.monotonic() + 1.0
            run("rates", self.update_cpu)

    def wait_s(self) -> float | None:
        """How long the main loop may sleep before rates are due (None: rates off)."""
        return None if self.activity is None else self.next_look - time.monotonic()

    def health(self) -> dict:
        """For the agent's metrics (read from the scrape's thread: whole objects the loop replaces)."""
        return {"paths_by_rate": self.activity.counts() if self.activity is not None else {ACTIVE: len(self.labels)},
                "lanes": dict(self.lanes.counts) if self.lanes is not None else None,
                "rdma_unreported_planes": len(self._rdma_said) if self.activity is not None else None,
                "budget": self.budget}

    def start(self) -> None:
        if self.activity is not None:
            self.sampler = threading.Thread(target=self._sample, name="traffic-sampler", daemon=True)
            self.sampler.start()

    def stop(self) -> None:
        """After the agent's `stopping` is set."""
        if self.sampler is not None:
            self.sampler.join(timeout=2)
        if self.lanes is not None:
            self.lanes.close()

    # ---- the rates ---------------------------------------------------------------------
    def _interval_s(self, pid: int) -> float:
        """The interval the path's rate asks for (the probe budget may stretch it)."""
        rate = self.activity.rate.get(pid, ACTIVE) if self.activity is not None else ACTIVE
        return {ACTIVE: self.cfg.interval_ms, PROGRESSING: self.cfg.progress_interval_ms,
                STANDBY: self.cfg.standby_interval_ms, IDLE: self.cfg.idle_interval_ms}[rate] / 1000

    def _priority(self, pid: int) -> str:
        """The path's class for the probe budget: the job's paths, its failover targets, the
        coordinator's coverage, the rest."""
        rate = self.activity.rate.get(pid, ACTIVE) if self.activity is not None else None
        if rate in (ACTIVE, PROGRESSING):
            return B_ACTIVE
        if rate == STANDBY:
            return B_STANDBY
        if not self.is_config_peer(self.labels[pid].peer):
            return COVERAGE
        return B_ACTIVE if rate is None else REST  # with rates off, the configured peers are the job's

    def apply_intervals(self) -> None:
        """Give every path the interval its rate asks for, stretched by priority where the wanted
        total exceeds the budget; logs when the budget starts or stops degrading a class."""
        wanted = {pid: (self._priority(pid), self._interval_s(pid)) for pid in self.labels}
        ceiling = self.cfg.budget_pps
        if self.governor.factor < 1:
            ceiling = (ceiling or sum(1 / iv for _, iv in wanted.values())) * self.governor.factor
        got = apportion(wanted, ceiling)
        for pid, interval in got.intervals.items():
            if self.intervals.get(pid) != interval:
                self.engine.set_interval(pid, interval)
                self.intervals[pid] = interval
        self.budget = got
        batch_s = batch_interval_s(self.intervals.values(), self.cfg.batch_ms / 1000)
        if batch_s < self.batch_s:  # a path went fast: its replies are taken at its pace from now on
            self.next_batch = min(self.next_batch, time.monotonic() + batch_s)
        self.batch_s = batch_s
        now = time.monotonic_ns()
        # once a second at most, as path_rates: the classes degraded now, if they changed
        if got.degraded != self._budget_logged[1] and now >= self._budget_logged[0] + RATES_LOG_EVERY_NS:
            self._budget_logged = (now, got.degraded)
            self.log("probe_budget", degraded=list(got.degraded), budget_pps=round(got.budget_pps, 1),
                wanted_pps=round(got.wanted_pps, 1), granted_pps=round(got.pps, 1),
                cpu_factor=round(self.governor.factor, 3),
                classes={c: share.to_dict() for c, share in got.classes.items()})

    def update_cpu(self) -> None:
        """Once a second with probe.budget_cpu_pct: the process's CPU share since the last call
        moves the governor's factor; a changed factor re-apportions the rates."""
        cpu, wall = time.process_time(), time.monotonic()
        before = self.governor.factor
        self.governor.update(cpu - self._cpu_at[0], wall - self._cpu_at[1])
        self._cpu_at = (cpu, wall)
        if abs(self.governor.factor - before) > 0.02 * before:
            self.apply_intervals()

    def _sample(self) -> None:
        """The traffic sampler's thread: once per idle interval, which peers this host's TCP
        connections moved data with. Off the main loop, because a dump walks the kernel's whole
        TCP table (~2 ms measured here) and the main loop decides failovers."""
        tcp: list[TcpActivity] = []
        addrs: tuple[tuple, dict[bytes, str]] = ((), {})

        devices: list[dict[int, str]] = []  # plane -> its NIC's RDMA device, found once

        def sample() -> None:
            nonlocal addrs
            if self.cfg.unreported_rdma_pps:
                if not devices:
                    devices.append(self._rdma_devices())
                if devices[0]:
                    self.rdma_ports = (time.monotonic_ns(), {plane: n for plane, dev in devices[0].items()
                                                             if (n := port_packets(dev)) is not None})
            if addrs[0] is not self.cfg.peers:  # a reload or a plan changed the peers
                peers = self.cfg.peers
                addrs = (peers, peer_addresses(peers))
            if not tcp:
                tcp.append(TcpActivity())
            try:
                self.moving = (time.monotonic_ns(), tcp[0].moving(addrs[1], int(2 * self.cfg.idle_interval_ms) + 1))
            except OSError:
                tcp.pop().close()  # a dump cut short leaves messages behind: a new socket next time
                raise

        while not self.stopping.wait(self.cfg.idle_interval_ms / 1000):
            self.errors.run("rates", sample)
        for t in tcp:
            t.close()

    def update(self, full: bool = False) -> None:
        """Each path's rate (linkpass/core/activity.py) from the traffic sampler's latest look and
        the lane reports now; logs the peers whose paths changed rate. Every path is classified
        again only when something it depends on changed (`full`: the paths did), or every
        RATES_FULL_EVERY_NS for what runs out with time: at every 2 ms look that would be most
        of what the agent costs a host whose lanes simply keep progressing."""
        now = time.monotonic_ns()
        if self.moving is not None and self.moving is not self._moving_fed:
            self._moving_fed = self.moving
            when, seen = self.moving
            self.activity.saw([peer for peer, plane in seen if plane is None], when)
            self.activity.saw_planes([(peer, plane) for peer, plane in seen if plane is not None], when)
            full = True
        lanes = []
        if self.lanes is not None:
            lanes = self.lanes.look(now)
            full |= self.activity.saw_lanes(self._lanes_seen(lanes), now)
            self._watch_lanes()
        full |= self._see_unreported_rdma({lane.plane for lane in lanes}, now)
        changes = []
        if full or now >= self._rates_full_at + RATES_FULL_EVERY_NS:
            self._rates_full_at = now
            changes = self.activity.update(self.path_keys, now)
        if changes:
            self.apply_intervals()
            for c in changes:
                self._rates_went.setdefault(c.rate, set()).add(c.peer)
        # one line a second at most: a bursty job's paths change rate many times a second
        if self._rates_went and now >= self._rates_logged + RATES_LOG_EVERY_NS:
            self._rates_logged = now
            went = {rate: sorted(self._rates_went.get(rate, ())) for rate in RATES}
            self._rates_went = {}
            self.log("path_rates", **went, paths=self.activity.counts(), batch_ms=round(self.batch_s * 1000, 3))

    def _rdma_devices(self) -> dict[int, str]:
        """Each plane's RDMA device (by its NIC's address), for its packet counters; planes
        without one are left out (their traffic is TCP, which the sockets show)."""
        out = {}
        for nic in self.cfg.nics:
            try:
                out[nic.plane] = Device.for_address(nic.addr).name
            except (RdmaUnavailable, OSError, ValueError):
                continue
        return out

    def _see_unreported_rdma(self, lane_planes: set[int], now: int) -> bool:
        """Planes whose RDMA device moved more packets than this agent's probes, with no lane
        report naming them (NCCL's own IB transport, another RDMA application): every path of
        such a plane is active, since no report says which peers the traffic goes to. Returns
        whether the planes so marked changed."""
        if self.rdma_ports is None and not self._rdma_said:
            return False  # no RDMA device read yet (a host without one never has): every 2 ms, nothing to do
        floor = self.cfg.unreported_rdma_pps
        if self.rdma_ports is not None and self.rdma_ports[0] != self._rdma_fed and floor:
            if self.unreported is None or self.unreported.floor_pps != floor:
                self.unreported = UnreportedRdma(floor)  # first look, or a reload changed the floor
            when, counts = self.rdma_ports
            self._rdma_fed = when
            stats = self.engine.stats  # each exchange: a request and its reply, ours or reflected
            planes = self.unreported.look(when, counts, 2 * (stats["sent"] + stats["reflected"]), lane_planes)
            self._rdma_pps.update(planes)
            self.activity.saw_unreported_rdma(planes, when)
        now_planes = self.activity.unreported_rdma_planes(now)
        if now_planes != self._rdma_said:
            self._rdma_said = now_planes
            self.log("rdma_unreported", planes=now_planes, pps={p: round(self._rdma_pps.get(p, 0)) for p in now_planes},
                note="RDMA traffic no lane report names: every path of these planes is probed at the active rate"
                if now_planes else "no RDMA traffic without lane reports")
            return True
        return False

    def _lanes_seen(self, lanes) -> list[LaneSeen]:
        """The reported lanes on paths this agent probes: a lane to an address no peer has on the
        lane's plane is not one of ours (counted, ignored)."""
        if self.lane_addrs[0] is not self.cfg.peers:
            self.lane_addrs = (self.cfg.peers, {a: (p.name, pl) for p in self.cfg.peers for pl, a in p.nics.items()})
        by_addr, out = self.lane_addrs[1], []
        for lane in lanes:
            where = by_addr.get(lane.peer)
            if where is None or where[1] != lane.plane:
                self.lanes.counts["lanes_unknown"] += 1
                continue
            out.append(LaneSeen(where[0], lane.plane, lane.sport, lane.progress_ns, lane.bytes_acked < lane.bytes_sent,
                                lane.looked_ns))
        return out

    def _watch_lanes(self) -> None:
        """Hand the probe core's lane watch the reports the reader has open, when they changed."""
        if not getattr(self.engine, "LANE_WATCH", False) or self._watched == self.lanes.generation:
            return
        window = self.activity.progress_window_ns
        self.engine.watch_lanes(self.lanes.fds(), window, WRITER_SILENT_WINDOWS * window)
        self._watched = self.lanes.generation

    def every_s(self) -> float:
        """How often rates are looked at: every half progress window while lane reports are live
        (the window bounds how stale transport progress may be), else once per idle interval.
        With the probe core watching the lanes, a settled view is looked at once per idle
        interval too: the watch wakes the loop (lanes_changed) when a lane changes."""
        if self.lanes is not None and self.lanes.live:
            if self._watched is not None and self.activity.lanes_settled(time.monotonic_ns()):
                return self.cfg.idle_interval_ms / 1000
            return min(self.cfg.progress_window_ms / 2, self.cfg.idle_interval_ms) / 1000
        return self.cfg.idle_interval_ms / 1000


def _lanes_reader(cfg: AgentConfig, log) -> LanesReader | None:
    try:
        return LanesReader(cfg.lanes_dir)
    except OSError as exc:
        log("lanes_unread", dir=cfg.lanes_dir, error=exc.strerror,
            note="lane reports are not read: RDMA and NCCL plugin traffic counts as no traffic; "
                 "make the directory's parent writable by the agent")
        return None

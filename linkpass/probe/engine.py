"""The agent's probe engine: the per-packet data path in C (linkpass/probe/_probecore.c), and
its binding.

The C loop sends every path's probes on time, reflects peers' probes, timestamps and matches
replies; Python gets either completed exchanges (`absorb`, `take_records`: the testbed's mesh
and the benchmarks) or, in judging mode (`track(True)`, the agent), `ProbeEvent`s judged
against each path's deadline (`poll`). Either way the replies go into per-path telemetry here
before anyone reads them. Sockets and path specs: common.py; the same engine in pure Python,
the reference the C core is tested and measured against: reference.py.

Timestamps: t2 and t4 are kernel RX stamps, t1 and t3 are read when the packet is built
(CLOCK_REALTIME, user space), all four mapped onto the agent's clock: the identity in production,
a synthetic clock per agent on the testbed (`clock_segment`), where all agents share one kernel.

Bounded everywhere: per-path rings of outstanding requests, a reflector table whose idle entries
expire, bounded batches per wake-up; nothing waits on a peer: sockets are non-blocking, a full
send buffer is a counted drop. Hostile input is cheap (linkpass/probe/probe_rx.h): sizes nobody
here sends or expects are dropped before any hashing (`expect_sizes` declares the peers'), and
each source's forged packets are checked only within its budget. Path ids are reused
(`new_path_id`), so a peer's reflector table holds only the paths that exist.
"""
from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import replace
from typing import Callable

from ..core import wire
from ..core.constants import CONFIRM_BURST, CONFIRM_PER_PEER_PER_S, HOST_STALL_SPREAD_NS
from ..core.probe_event import ProbeEvent, from_record
from ..core.telemetry import PathTelemetry, feed_events
from .common import ExchangeRecord, PathIds, PathSpec, ProbedPath, check_engine_args, open_nic_sockets

SENT_EVERY_S = 0.1  # judging mode: each path's requests-sent count (for the views) is read this often


class CoreProbeEngine:
    """One agent's probes and reflector, the per-packet loop in C (linkpass.probe._probecore);
    the interface of reference.ReferenceEngine, plus the background thread and judging mode.

    `run()` hands the loop to C in slices (GIL released) and, between slices, turns the
    completed exchanges into per-path telemetry and `on_exchange` calls. The clock is a linear
    map per slice, `clock_segment(true_ns) -> (base_true_ns, base_local_ns, rate_ppb)`, so a
    synthetic clock's random walk is followed piecewise.
    """

    RECORD = struct.Struct("<IIQqqqq")  # xrec_t: path_id, rx_count, seq, t1..t4
    EVENT = struct.Struct("<IIQIIIIqqqq")  # ev_t: ProbeEvent's fields, in its order
    MAX_KEPT = 1_000_000
    LANE_WATCH = True  # watch_lanes(): the loop reads lane reports, Python looks when they change
    # the counters `stats` reports (drop counters by reason: `drops`); reflector_entries is a level
    # other_key: packets authenticated with the other fleet key accepted during a key rotation;
    # confirm_*: confirmation rounds (set_confirm) sent, the probes they sent, rounds refused by the budget
    STATS = ("sent", "reflected", "replies", "received", "reflector_entries", "reflector_expired", "other_key",
             "confirm_rounds", "confirm_probes", "confirm_refused")

    def __init__(self, agent_id: int, key: bytes, netns: str | None = None,
                 clock_segment: Callable[[int], tuple[int, int, int]] | None = None, seed: int = 1,
                 jitter: float = 0.1, slice_s: float = 0.05,
                 on_exchange: Callable[[ExchangeRecord], None] | None = None, accept_key: bytes | None = None):
        from . import _probecore

        check_engine_args(agent_id, jitter)
        self.agent_id = agent_id
        self.netns = netns
        self.core = _probecore.Core(key, agent_id, seed=seed or 1, jitter_ppm=int(jitter * 1e6),
                                    accept_key=accept_key or b"")
        self.clock_segment = clock_segment
        self.slice_s = slice_s
        self.on_exchange = on_exchange
        self.nics: dict[str, tuple[int, socket.socket, socket.socket]] = {}
        self.paths: dict[int, ProbedPath] = {}
        self.path_ids = PathIds()
        self._telemetry: dict[int, PathTelemetry] = {}  # path -> its telemetry, what poll() feeds
        self._collect: list[ExchangeRecord] | None = None
        self._sent_at = 0.0  # when poll() last read every path's sent count
        self.background = False
        assert self.RECORD.size == _probecore.RECORD_SIZE and self.EVENT.size == _probecore.EVENT_SIZE
        assert _probecore.MAX_PAD == wire.MAX_PAD

    def add_nic(self, name: str, ifname: str, addr: str) -> None:
        rx, tx = open_nic_sockets(self.netns, ifname, addr)
        index = self.core.add_nic(rx.fileno(), tx.fileno(), socket.inet_aton(addr))
        self.nics[name] = (index, rx, tx)

    def new_path_id(self) -> int:
        """The lowest path id not in use (ids of removed paths are reused); add_path() it next."""
        return self.path_ids.lowest_free()

    def add_path(self, spec: PathSpec, first_due_s: float = 0.0) -> None:
        if spec.nic not in self.nics:
            raise ValueError(f"path {spec.path_id}: unknown NIC {spec.nic!r}; add_nic() it first")
        self.path_ids.claim(spec.path_id)
        try:
            self.core.add_path(spec.path_id, self.nics[spec.nic][0], spec.peer_id, socket.inet_aton(spec.peer_addr),
                               spec.sport, int(spec.interval_s * 1e9), spec.pad,
                               time.monotonic_ns() + int(first_due_s * 1e9), int(spec.pair_gap_s * 1e9))
        except Exception:
            self.path_ids.release(spec.path_id)
            raise
        self.paths[spec.path_id] = path = ProbedPath(spec, PathTelemetry())
        self._telemetry[spec.path_id] = path.telemetry

    def remove_path(self, path_id: int) -> None:
        self.core.remove_path(path_id)
        del self.paths[path_id]
        del self._telemetry[path_id]
        self.path_ids.release(path_id)

    def expect_sizes(self, ip_sizes) -> None:
        """The full-size probes peers send this host (IP packet sizes), besides the small probe
        and this engine's own paths' sizes, which pass anyway; any other size is dropped before
        it costs a hash (counted as unexpected_size). Replaces the sizes declared before."""
        pads = []
        for size in ip_sizes:
            try:
                pads.append(wire.pad_for_ip_size(size))
            except ValueError as exc:
                raise ValueError(f"expected probe size {size} bytes: {exc}") from None
        self.core.declare_pads(sorted(set(pads)))

    def set_budget(self, per_source_bytes_s: int, per_source_burst: int, shared_bytes_s: int,
                   shared_burst: int) -> None:
        """How many bytes of forged packets (failed ICRC or tag) are checked, per second and at
        once, for each source, and for all untrusted sources together; beyond it a source's
        packets are dropped unchecked (source_over_budget). Defaults: probe_rx.h."""
        self.core.set_budget(per_source_bytes_s, per_source_burst, shared_bytes_s, shared_burst)

    def set_reflector_idle(self, idle_s: float) -> None:
        """A reflector entry (a peer's path) not heard from for this long is freed."""
        self.core.set_reflector_idle(int(idle_s * 1e9))

    def set_confirm(self, miss_threshold: int, per_peer_per_s: float = CONFIRM_PER_PEER_PER_S,
                    burst: int = CONFIRM_BURST, spread_ns: int = HOST_STALL_SPREAD_NS) -> None:
        """On each miss of a streak, up to the one that completes `miss_threshold` misses in a
        row on a path (the detector's DOWN), probe every path to that peer at once and hand their
        on-time answers to Python at once: the streak's misses come a timeout apart, and the last
        round's answers confirm the DOWN a round trip later; that round goes out no sooner than
        `spread_ns` after the streak's first miss was sent (the answers Failover takes as
        confirmation). At most `burst` rounds per peer, refilled at `per_peer_per_s`; 0 turns it off."""
        self.core.set_confirm(miss_threshold, per_peer_per_s, burst, spread_ns)

    def set_interval(self, path_id: int, interval_s: float) -> None:
        """Probe a path faster (active: traffic on it) or slower (idle); a faster rate starts at once."""
        self.core.set_interval(path_id, int(interval_s * 1e9))
        path = self.paths[path_id]
        path.spec = replace(path.spec, interval_s=interval_s)

    def start_background(self, rt_priority: int = 0) -> str | None:
        """Run the loop in a native thread from now on: it keeps receiving, reflecting and
        probing while Python is busy (a paused reflector makes its peers see false misses).
        `rt_priority` > 0 asks for SCHED_FIFO; returns None, or why that was refused."""
        self.core.start(rt_priority)
        self.background = True
        if rt_priority:
            time.sleep(0.01)  # the thread asks first thing
            err = self.core.rt_status()
            if err:
                return os.strerror(err)
        return None

    def stop_background(self) -> None:
        self.core.stop()
        self.background = False

    def run(self, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        if self.background:  # the native thread does the work; keep telemetry current
            while (left := end - time.monotonic()) > 0:
                if self.clock_segment:
                    self.core.set_clock(*self.clock_segment(time.time_ns()))
                time.sleep(min(left, self.slice_s))
                self.absorb()
            return
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            if self.clock_segment:
                self.core.set_clock(*self.clock_segment(time.time_ns()))
            self.core.run(int(min(left, self.slice_s) * 1e9))
            self.absorb()

    def take_records(self) -> list[ExchangeRecord]:
        """The exchanges completed since the last call (they also went into telemetry). Keeping
        them starts with the first call; at most `MAX_KEPT` wait, the oldest are dropped."""
        if self._collect is None:
            self._collect = []
        self.absorb()
        out, self._collect = self._collect, []
        return out

    def absorb(self) -> int:
        """Feed the exchanges completed in C into telemetry; returns how many."""
        data = self.core.take()
        for pid, path in self.paths.items():
            path.telemetry.sent = self.core.path_sent(pid)
        for path_id, rx_count, seq, t1, t2, t3, t4 in self.RECORD.iter_unpack(data):
            path = self.paths.get(path_id)
            if path is None:
                continue
            path.telemetry.on_reply(seq, t1, t2, t3, t4, rx_count)
            if self.on_exchange or self._collect is not None:
                rec = ExchangeRecord(path_id, path.spec.peer_id, seq, t1, t2, t3, t4)
                if self._collect is not None:
                    if len(self._collect) >= self.MAX_KEPT:
                        del self._collect[: len(self._collect) // 2]
                    self._collect.append(rec)
                if self.on_exchange:
                    self.on_exchange(rec)
        return len(data) // self.RECORD.size

    def track(self, on: bool = True) -> None:
        """Judging mode: the C loop matches replies to requests against each path's deadline
        (`set_rto`) and `poll()` returns events instead of one record per exchange."""
        self.core.track(on)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the C loop has a MISS or LATE waiting (True) or `timeout_s` passed."""
        fd = self.core.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
        if ready:
            try:
                os.read(fd, 8)
            except BlockingIOError:
                pass
        return bool(ready)

    def watch_lanes(self, fds: list[int], window_ns: int, silent_ns: int) -> None:
        """Have the loop read these lane reports every half window and wake wait() only when
        what the rate rule reads from them changed (lane_watch.h); an empty list stops it."""
        self.core.watch_lanes(fds, window_ns, silent_ns)

    def lanes_changed(self) -> bool:
        """Whether a look of the lane watch found a change since the last call."""
        return self.core.lanes_changed()

    def set_rto(self, path_id: int, rto_ns: int) -> None:
        self.core.set_rto(path_id, rto_ns)

    def set_size_probe(self, path_id: int, every: int, ip_size: int) -> None:
        """Make every `every`-th probe of a path an IP packet of `ip_size` bytes (0 = off): full-MTU
        probes find MTU black holes that small probes cross."""
        try:
            pad = wire.pad_for_ip_size(ip_size) if every else 0
        except ValueError as exc:
            raise ValueError(f"size probe of {ip_size} bytes: {exc}") from None
        self.core.set_size_probe(path_id, every, pad)

    def poll(self, all_answered: bool = True) -> tuple[list[ProbeEvent], int]:
        """Judging mode's events since the last call, in order, already fed into telemetry
        (core/probe_event.py says what each kind carries); and the evidence time: every reply
        that reached a socket before it has been judged. `all_answered=False` leaves on-time
        replies accumulating in C (cheap frequent polls that still see every miss at once).
        Times are on this agent's clock."""
        data, evidence = self.core.take_events(all_answered)
        events = list(map(from_record, self.EVENT.iter_unpack(data)))
        feed_events(events, self._telemetry)
        if all_answered and time.monotonic() >= self._sent_at + SENT_EVERY_S:
            self._sent_at = time.monotonic()  # read by the views only: every path, every batch, was a fixed cost
            for pid, path in self.paths.items():
                path.telemetry.sent = self.core.path_sent(pid)
        return events, evidence

    def set_keys(self, key: bytes, accept_key: bytes | None = None) -> None:
        """Sign with `key` from now on and accept `accept_key` too (None: only `key`): the steps
        of a fleet key rotation (docs/security.md), taken without stopping the probes."""
        self.core.set_keys(key, accept_key or b"")

    @property
    def stats(self) -> dict:
        c = self.core.counters()
        return {k: c[k] for k in self.STATS}

    @property
    def drops(self) -> dict:
        return self.core.counters()["drops"]

    def telemetry(self, path_id: int) -> PathTelemetry:
        return self.paths[path_id].telemetry

    def info(self) -> dict:
        """What the agent logs at start: the engine and its timestamps."""
        return {"engine": "sockets", "timestamps": "kernel receive stamps (SO_TIMESTAMPNS)", "nics": sorted(self.nics)}

    def close(self) -> None:
        if self.background:
            self.stop_background()
        for _, rx, tx in self.nics.values():
            rx.close()
            tx.close()
        self.nics.clear()

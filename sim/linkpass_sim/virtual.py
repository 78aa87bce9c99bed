"""A host agent on virtual time: the real decision code, fed by a simulated fabric and data path.

What is real here and what is simulated:

    simulated (this module)                         real (imported, not copied)
    ─────────────────────────────────────────       ───────────────────────────────────────────
    the fabric: per directed link, faults that      linkpass.core.failover.Failover
      drop probes (down, flap, loss, MTU)             ├─ linkpass.core.detector (every state change)
    the probe data path: one probe per path per     ├─ linkpass.core.decide (planes, ports)
      interval, round trips, and the C core's         ├─ linkpass.core.probe_event.ProbeEvent
      judging (ANSWERED batches, MISS at the          └─ linkpass.core.telemetry: feed_events,
      deadline, LATE), as _probecore.c does it            LossCounters (loss per direction)
    the agent loop's wake-ups: every 10 ms for on-time replies, at once on a miss (daemon.run)

`VirtualAgent.run_until` advances one agent; its `Failover` sees exactly the events the C core
would hand the daemon (the same `ProbeEvent`s, fed into the paths' loss counters by the engine's
own feed first), so its transitions, plane choices and entropy entries are the ones the agent
would make: the simulation reads them from the `Decisions` Failover returns, the same ones the
agent's data path carries out (agent/data_path.py). Probe outcomes are drawn with numpy per step; Python work per step is one ANSWERED
event per path unless a probe was lost.

Confirmation rounds are the C core's too: the miss that completes a path's streak pulls the next
probe of every path to that peer forward to its deadline (within each peer's budget), and an
on-time answer to such a probe wakes the loop. One liberty: the pulled probe is the path's next
probe already drawn (its loss fate and delays kept), or its next one drawn at that time, and
the probes after it keep their schedule (the C core restarts it half an interval later).

Two liberties with the daemon's timing, both to save simulation steps and neither able to change
a decision: a miss wakes the loop only for the paths to the peers concerned (the others' on-time
replies wait for the next 10 ms batch; a peer's plane and port choice reads only its own paths),
and a miss on a path already DOWN or DAMPED (which the detector only counts) waits for the next
batch instead of waking the loop.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from linkpass.core.decide import PathInfo
from linkpass.core.decisions import Decisions, RouteResult
from linkpass.core.failover import Failover
from linkpass.core.constants import BATCH_S, CONFIRM_BURST, CONFIRM_PER_PEER_PER_S, HOST_STALL_SPREAD_NS
from linkpass.core.detector import Detector, DetectorConfig, State, Transition
from linkpass.core.probe_event import EV_MISS, ProbeEvent
from linkpass.core.states import DARK
from linkpass.core.telemetry import LossCounters, feed_events

NEVER = np.iinfo(np.int64).max // 4
MS = 1_000_000
BATCH_NS = round(BATCH_S * 1e9)  # the daemon takes on-time replies this often
REFLECT_NS = 2_000  # reflector turnaround


@dataclass(frozen=True)
class Effect:
    """A fault's action on some directed links from `start_ns` to `end_ns`.

    kind: "down" (every packet lost), "flap" (down for `flap_ns`, up for `flap_ns`, repeating,
    starting down), "loss" (each packet lost with probability `loss`), "mtu" (full-size probes
    lost), "stall" (nothing lost: the reflecting host is kept waiting, so a probe reaching it in
    the window is answered only when the window ends, as a starved host's probe thread does)."""

    links: frozenset
    kind: str
    start_ns: int
    end_ns: int
    loss: float = 0.0
    flap_ns: int = 0

    def active(self, t: np.ndarray) -> np.ndarray:
        return (t >= self.start_ns) & (t < self.end_ns)

    def dropping(self, t: np.ndarray) -> np.ndarray:
        """Whether the effect is dropping everything (down or a flap's down phase) at times `t`."""
        if self.kind == "down":
            return self.active(t)
        if self.kind == "flap":
            return self.active(t) & (((t - self.start_ns) // self.flap_ns) % 2 == 0)
        return np.zeros(len(t), bool)

    def drops(self, t: np.ndarray, size: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Which of the packets sent at `t` (full-size where `size`) it drops."""
        if self.kind in ("down", "flap"):
            return self.dropping(t)
        if self.kind == "loss":
            return self.active(t) & (rng.random(len(t)) < self.loss)
        if self.kind == "mtu":
            return self.active(t) & size
        if self.kind == "stall":
            return np.zeros(len(t), bool)
        raise ValueError(f"Effect.kind {self.kind!r} is unknown; one of down, flap, loss, mtu, stall")

    def reflected_at(self, t3: np.ndarray) -> np.ndarray:
        """When a probe that reached the reflector at `t3` is answered (a stall holds it to the end)."""
        if self.kind != "stall":
            return t3
        # released in arrival order, as a thread draining its socket does (~16 µs per ms waited)
        return np.where(self.active(t3), self.end_ns + REFLECT_NS + (t3 - self.start_ns) // 64, t3)


def peer_addr(peer: str, plane: int) -> str:
    """What stands for a peer's NIC address on `plane` in a PathInfo (entropy entries are keyed by it)."""
    return f"{peer}#{plane}"


@dataclass(frozen=True)
class Rtt:
    """Round-trip model of a healthy path: base plus exponential jitter, split evenly per way."""

    base_ns: int = 8_000
    jitter_ns: int = 2_000


@dataclass
class VirtualPath:
    """One probed path: what it crosses, when it probes, which faults act on it."""

    info: PathInfo
    forward: tuple[str, ...]  # directed links of the probes
    reverse: tuple[str, ...]  # directed links of the replies
    interval_ns: int
    phase_ns: int  # when the path's first probe is sent
    size_every: int
    rtt: Rtt
    size_offset: int = 0  # which probe of every `size_every` is full-size (agents start anywhere)
    fwd_effects: list = field(default_factory=list)
    rev_effects: list = field(default_factory=list)
    loss: LossCounters = field(default_factory=LossCounters)


# path index, probe, sent, reply (NEVER: none), deadline, full-size, reflector's rx count, how
# long the reflector held it (a stall): t2 is stamped on arrival (the kernel's receive timestamp)
# and t3 on sending, so the hold is in neither one-way delay, as on the real reflector; whether
# a confirmation round sent it; whether the request reached the reflector (counted in rx)
_COLS = ("j", "seq", "t1", "arr", "dl", "size", "rx", "hold", "conf", "fa")


class VirtualAgent:
    """One host's agent: `Failover` over `VirtualPath`s, the C core's judging done here on
    arrays of every path's outstanding probes."""

    def __init__(self, name: str, config: DetectorConfig, rng: np.random.Generator, interval_ns: int = MS,
                 batch_phase_ns: int = 0):
        self.name = name
        self.rng = rng
        self.interval_ns = interval_ns
        self.paths: list[VirtualPath] = []  # path index j has path id j + 1
        self.entropy_log: list[tuple[int, str, int, tuple[int, ...], int]] = []
        self.plane_log: list[tuple[int, str, tuple[int, ...]]] = []  # (time, peer, planes) on change
        self._planes: dict[str, tuple[int, ...]] = {}
        self.transitions: list[Transition] = []
        self.now_ns = 0
        self._next_batch = batch_phase_ns
        self.failover = Failover(Detector(config), lambda pid: self.paths[pid - 1].loss, entropy=True)
        self._initial_rto = config.initial_timeout_ns
        self._ready = False
        self._pend = {c: np.zeros(0, np.int64) for c in _COLS}
        self._late: list[tuple[int, ...]] = []  # (arrival, j, seq, t1, rx, hold) of missed probes
        # confirmation rounds, as the C core's set_confirm(miss_threshold, ...) does them
        self._confirm_threshold = config.miss_threshold
        self._confirm_period = round(1e9 / CONFIRM_PER_PEER_PER_S)
        self.confirm = {"rounds": 0, "probes": 0, "refused": 0}

    # ---- what Failover decided ------------------------------------------------------------
    def _take(self, decided: Decisions, now_ns: int) -> None:
        """Read the decisions as the agent's data path would carry them out: the probe deadlines
        for the judging here, the entropy entries the transports would use, the planes (no
        kernel routes in the simulation). Log records are not kept: transitions and decisions are."""
        for pid, rto_ns in decided.rto:
            self._rto[pid - 1] = rto_ns
        self.failover.routes_done([RouteResult.not_routed(w) for w in decided.routes], now_ns)
        for e in decided.entropy:
            self.entropy_log.append((now_ns, e.peer, e.plane, tuple(e.path_ids), e.flags))

    # ---- set-up ---------------------------------------------------------------------------
    def add_path(self, path: VirtualPath) -> None:
        if self._ready:
            raise RuntimeError("add_path: paths are added before the agent first runs")
        if path.info.path_id != len(self.paths) + 1:
            raise ValueError(f"path ids are 1, 2, ... in order; got {path.info.path_id} after {len(self.paths)}")
        self.paths.append(path)
        self.failover.add_path(path.info)

    def _prepare(self) -> None:
        ps = self.paths
        n = len(ps)
        self._next_seq = np.zeros(n, np.int64)
        self._rx_total = np.zeros(n, np.int64)
        self._phase = np.array([p.phase_ns for p in ps], np.int64)
        self._interval = np.array([p.interval_ns for p in ps], np.int64)
        self._size_every = np.array([max(p.size_every, 0) for p in ps], np.int64)
        self._size_offset = np.array([p.size_offset for p in ps], np.int64)
        self._half_base = np.array([p.rtt.base_ns // 2 for p in ps], np.int64)
        self._half_jitter = np.array([p.rtt.jitter_ns / 2 for p in ps])
        self._rto = np.full(n, self._initial_rto, np.int64)
        effects: dict[int, tuple[Effect, np.ndarray, np.ndarray]] = {}
        for j, p in enumerate(ps):
            for e, col in [(e, 1) for e in p.fwd_effects] + [(e, 2) for e in p.rev_effects]:
                entry = effects.setdefault(id(e), (e, np.zeros(n, bool), np.zeros(n, bool)))
                entry[col][j] = True
        self._effects = list(effects.values())
        peer_index: dict[str, int] = {}
        self._peer_of = np.array([peer_index.setdefault(p.info.peer, len(peer_index)) for p in ps], np.int64)
        self._misses = np.zeros(n, np.int64)  # small probes missed since the last reply (the streak)
        self._confirm_tat = np.zeros(len(peer_index), np.int64)  # each peer's budget (GCRA)
        self._round_at = np.full((2, len(peer_index)), -1, np.int64)  # each peer's newest round of each kind
        self._streak_t1 = np.zeros(n, np.int64)  # send time of each streak's first miss
        self._loss = {p.info.path_id: p.loss for p in ps}  # what the events feed (feed_events)
        self._ready = True

    # ---- the simulated data path ------------------------------------------------------------
    def _send(self, until_ns: int) -> None:
        """Draw every path's probes sent before `until_ns`."""
        last = np.maximum(-(-(until_ns - self._phase) // self._interval), self._next_seq)
        counts = last - self._next_seq
        total = int(counts.sum())
        if not total:
            return
        j = np.repeat(np.arange(len(counts)), counts)
        starts = np.cumsum(counts) - counts
        seq = self._next_seq[j] + (np.arange(total) - starts[j])
        t1 = self._phase[j] + seq * self._interval[j]
        block = self._draw(j, seq, t1)
        arrived = block["fa"]
        cs = np.cumsum(arrived)
        before = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0)
        block["rx"] = self._rx_total[j] + cs - before[j]
        self._rx_total += np.bincount(j, weights=arrived, minlength=len(counts)).astype(np.int64)
        self._next_seq = last
        self._pend = {c: np.concatenate([self._pend[c], block[c]]) for c in _COLS}

    def _draw(self, j: np.ndarray, seq: np.ndarray, t1: np.ndarray) -> dict:
        """The fates of probes (path index, seq, send time): delays, the effects' losses and
        stalls; every column but `rx` (the peer's count, which the caller knows)."""
        total = len(j)
        every = self._size_every[j]
        size = (every > 0) & ((seq + self._size_offset[j]) % np.maximum(every, 1) == 0)
        owd_f = self._half_base[j] + (self.rng.exponential(1.0, total) * self._half_jitter[j]).astype(np.int64)
        owd_r = self._half_base[j] + (self.rng.exponential(1.0, total) * self._half_jitter[j]).astype(np.int64)
        t3 = t1 + owd_f + REFLECT_NS
        t3_free = t3.copy()
        # effects outside this block's time span act on none of it (a loss effect still draws its
        # random numbers, so that adding a stall elsewhere does not change a seeded run's losses)
        lo, hi = int(t1.min()), int(t3.max()) + 1
        effects = [x for x in self._effects if x[0].kind == "loss" or (x[0].start_ns < hi and x[0].end_ns > lo)]
        for e, fwd, rev in effects:
            sel = (fwd | rev)[j]
            if e.kind == "stall" and sel.any():
                t3[sel] = e.reflected_at(t3[sel])
        hi = int(t3.max()) + 1  # a stall moved some replies later
        effects = [x for x in self._effects if x[0].kind == "loss" or (x[0].start_ns < hi and x[0].end_ns > lo)]
        fwd_lost = np.zeros(total, bool)
        rev_lost = np.zeros(total, bool)
        for e, fwd, rev in effects:
            for lost, mask, t in ((fwd_lost, fwd, t1), (rev_lost, rev, t3)):
                sel = mask[j]
                if sel.any():
                    lost[sel] |= e.drops(t[sel], size[sel], self.rng)
        return {"j": j, "seq": seq, "t1": t1, "arr": np.where(fwd_lost | rev_lost, NEVER, t3 + owd_r),
                "dl": t1 + self._rto[j], "size": size.astype(np.int64), "rx": np.zeros(total, np.int64),
                "hold": t3 - t3_free, "conf": np.zeros(total, np.int64),
                "fa": (~fwd_lost).astype(np.int64)}

    def _next_notify(self, until_ns: int) -> int:
        """The first time before `until_ns` the C core would wake the loop: a miss or a late reply."""
        self._send(until_ns)
        first = until_ns
        arr, dl = self._pend["arr"], self._pend["dl"]
        missed = arr > dl
        if missed.any():
            # a miss on a path already DOWN or DAMPED decides nothing (the detector only counts
            # it): it waits for the next batch instead of waking the loop, so a dead path does
            # not cost the simulation a step per probe (the daemon would wake; see module doc)
            dark = np.array([self.failover.detector[j + 1].state in DARK for j in range(len(self.paths))])
            missed &= ~dark[self._pend["j"]]
        if missed.any():
            first = min(first, int(dl[missed].min()))
        if self._late:
            first = min(first, self._late[0][0])
        answers = (self._pend["conf"] == 1) & (arr <= dl)
        if answers.any():  # a round's on-time answer is handed over at once
            first = min(first, max(int(arr[answers].min()), self.now_ns + 1))
        return first

    def _judge(self, now_ns: int, all_paths: bool) -> list[ProbeEvent]:
        """The C core's events up to `now_ns`, in order (see _probecore.c). Not `all_paths`: a miss
        woke the loop, and only the paths to the peers concerned are taken (the daemon takes every
        path; the others' on-time replies wait for the next batch here, which changes nothing the
        decisions for those peers see, and saves the simulation most of its work)."""
        P = self._pend
        arr, dl = P["arr"], P["dl"]
        on_time = arr <= dl
        decided = np.where(on_time, arr, dl) <= now_ns
        if not all_paths and len(self.paths) > 1:
            woke = set(self._peer_of[P["j"][decided & (~on_time | (P["conf"] == 1))]].tolist())
            woke |= {int(self._peer_of[x[1]]) for x in self._late if x[0] <= now_ns}
            decided &= np.isin(self._peer_of[P["j"]], list(woke))
        events: list[ProbeEvent] = []
        if decided.any():
            D = {c: P[c][decided] for c in _COLS}
            ok = on_time[decided]
            self._pend = {c: P[c][~decided] for c in _COLS}
            missing = set(D["j"][~ok].tolist())
            fast = ~np.isin(D["j"], list(missing)) if missing else np.ones(len(ok), bool)
            if fast.any():
                events += self._answered_groups({c: D[c][fast] for c in _COLS})
            for jj in sorted(missing):
                rows = np.flatnonzero(D["j"] == jj)
                when = np.where(ok[rows], D["arr"][rows], D["dl"][rows])
                run: list[int] = []
                for i in rows[np.argsort(when, kind="stable")]:
                    if ok[i]:
                        run.append(i)
                        continue
                    if run:
                        events += self._answered_groups({c: D[c][run] for c in _COLS})
                        run = []
                    seq, t1, a, d, size, rx, hold = (int(D[c][i]) for c in
                                                     ("seq", "t1", "arr", "dl", "size", "rx", "hold"))
                    events.append(ProbeEvent.miss(jj + 1, seq, size, t1, d))
                    if a < NEVER:
                        heapq.heappush(self._late, (a, jj, seq, t1, rx, hold))
                if run:
                    events += self._answered_groups({c: D[c][run] for c in _COLS})
        while self._late and self._late[0][0] <= now_ns:
            a, jj, seq, t1, rx, hold = heapq.heappop(self._late)
            half = (a - t1 - REFLECT_NS - hold) // 2
            events.append(ProbeEvent.late(jj + 1, seq, rx, t1, t1 + half, t1 + half + REFLECT_NS + hold, a))
        self._confirm(events)
        feed_events(events, self._loss)  # as engine.poll does before the daemon sees the events
        return events

    def _confirm(self, events: list[ProbeEvent]) -> None:
        """The C core's confirmation rounds for these events: the streaks they extend or end, and
        a round at the deadline of each miss of a streak up to the one that completes it (that
        one no sooner than the host-stall spread after the streak's first miss was sent), its
        probes sent besides the schedule, as the C core sends them (_extra_probe)."""
        for e in sorted(events, key=lambda e: e.t4):
            j = e.path_id - 1
            if e.kind != EV_MISS:
                self._misses[j] = 0
            elif not e.size_probe:
                self._misses[j] += 1
                if self._misses[j] == 1:
                    self._streak_t1[j] = e.t1
                if self._misses[j] <= self._confirm_threshold:
                    last = int(self._misses[j] == self._confirm_threshold)
                    at = e.t4 + 1  # the C loop sends on its next turn, after the miss at t4 is judged
                    later = max(at, int(self._streak_t1[j]) + HOST_STALL_SPREAD_NS) if last else at
                    self._round(j, at, later, last)

    def _round(self, j: int, at: int, later: int, last: int) -> None:
        """A round for path j's peer: j's own probe at `at`, the other paths' at `later` (the
        DOWN-making miss's round waits a stall's spread for them, as the C core's does)."""
        peer = self._peer_of[j]
        if self._round_at[last, peer] == later:
            return  # the peer's round of this loop turn, asked for again: the same round
        self._round_at[last, peer] = later
        tat = max(int(self._confirm_tat[peer]), at)
        if tat - at > (CONFIRM_BURST - 1) * self._confirm_period:
            self.confirm["refused"] += 1
            return
        self._confirm_tat[peer] = tat + self._confirm_period
        self.confirm["rounds"] += 1
        for q in np.flatnonzero(self._peer_of == peer).tolist():
            self._extra_probe(q, at if q == j else later)
            self.confirm["probes"] += 1

    def _extra_probe(self, q: int, at: int) -> None:
        """A round's probe on path `q` at `at`, besides the schedule, as the C core sends it: it
        takes the next sequence number, so the path's later probes (drawn or not) move up one."""
        P = self._pend
        later = np.flatnonzero((P["j"] == q) & (P["t1"] > at))
        s = int(P["seq"][later].min()) if len(later) else int(self._next_seq[q])
        block = self._draw(np.array([q]), np.array([s]), np.array([at], np.int64))
        fa = int(block["fa"][0])
        if len(later):
            first = later[np.argmin(P["seq"][later])]
            rx = int(P["rx"][first]) - int(P["fa"][first])  # the peer's count before the first later probe
            P["seq"][later] += 1
            P["rx"][later] += fa
        else:
            rx = int(self._rx_total[q])
        block["rx"][0] = rx + fa
        block["conf"][0] = 1
        self._rx_total[q] += fa
        self._next_seq[q] += 1
        self._phase[q] -= self._interval[q]  # seq n + 1 is sent when n would have been
        self._pend = {c: np.concatenate([P[c], block[c]]) for c in _COLS}

    @staticmethod
    def _answered_groups(R: dict) -> list[ProbeEvent]:
        """One ANSWERED per path of the on-time rows `R`: count, newest exchange, worst RTT."""
        order = np.lexsort((R["seq"], R["j"]))
        j = R["j"][order]
        bounds = np.flatnonzero(np.diff(j)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(j)]]) - 1
        rtt = (R["arr"] - R["t1"])[order]
        worst = np.maximum.reduceat(rtt, starts)
        size = np.maximum.reduceat(R["size"][order], starts)
        out = []
        for k, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
            i = order[e]
            seq, t1, arr, rx, hold = (int(R[c][i]) for c in ("seq", "t1", "arr", "rx", "hold"))
            half = (arr - t1 - REFLECT_NS - hold) // 2
            out.append(ProbeEvent.answered(int(j[s]) + 1, seq, e - s + 1, rx, int(size[k]), int(worst[k]),
                                           t1, t1 + half, t1 + half + REFLECT_NS + hold, arr))
        return out

    # ---- the agent loop -------------------------------------------------------------------------
    def step_at(self, now_ns: int, all_paths: bool = True) -> list[Transition]:
        if not self._ready:
            self._prepare()
        events = self._judge(now_ns, all_paths)
        events.sort(key=lambda e: e.t4)  # the C loop learns them in time order
        decided = self.failover.step(events, now_ns, now_ns)
        self._take(decided, now_ns)
        out = decided.transitions
        self.now_ns = now_ns
        if out:
            self.transitions += out
        for peer, planes in self.failover.planes.items():
            if self._planes.get(peer) != planes:
                self._planes[peer] = planes
                self.plane_log.append((now_ns, peer, planes))
        return out

    def run_until(self, end_ns: int, batch_ns: int = BATCH_NS, stop=None) -> None:
        """Advance to `end_ns`: wake every `batch_ns` and at every miss or late reply (daemon.run).
        `stop()` true after a step ends the run early."""
        if not self._ready:
            self._prepare()
        while self.now_ns < end_ns:
            if self._next_batch <= self.now_ns:
                self._next_batch = self.now_ns + batch_ns
            target = min(end_ns, self._next_batch)
            decide_ns = self.failover.decision_wait_ns()  # a held DOWN: wake for fresh answers
            if decide_ns is not None:
                target = min(target, self.now_ns + max(decide_ns, self.interval_ns))
            t = self._next_notify(target)
            batch = t >= target
            if batch:
                t = target
                if t >= self._next_batch:
                    self._next_batch = t + batch_ns
            self.step_at(t, all_paths=batch)
            if stop is not None and stop():
                return

    # ---- questions the simulation asks afterwards ---------------------------------------------
    def state(self, pid: int) -> State:
        return self.failover.detector[pid].state

"""The agent's decision loop: probe events in, path states and decisions out.

    engine.poll() ──events (ANSWERED / MISS / LATE), evidence time──► Failover.step() ──► Decisions
        ├─ Detector (pure): on_answered / on_miss / on_reply / on_loss (every `loss_batch_ns`) / tick
        ├─ transitions ──► log records, counters, peers to re-decide
        └─ decide.usable_planes ──► RouteWant per peer      (routes: whole planes)
           decide.entropy_entry ──► entropy-table entries   (ports: single paths)

Failover acts on nothing: it returns `Decisions` (core/decisions.py), which the agent's data
path carries out (agent/data_path.py: routes, entropy table, the probe core's deadlines, the
log) and the simulator reads. What the route actuator did comes back through `routes_done`.

Time is the agent's clock (the one t1..t4 are stamped with). Per-probe bookkeeping is the C
core's (judging mode): it matches each reply to its request against the deadline the detector
sets (`Decisions.rto`, decided when the detector's timeout moves), and reports on-time replies in
batches, misses and late replies one by one, in order. A probe counts as missed only once every
reply that reached a socket before its deadline has been read (the *evidence time*), so a late
Python loop, or a probe thread the scheduler kept waiting, cannot turn a slow poll into a false
failure; and Python's cost is per batch, not per probe. Events are `ProbeEvent`s
(core/probe_event.py), whichever data path made them: the C core, or the simulator's model of it.

No clock is read here: every entry point takes the time from its caller, the evidence time
(agent clock) that judges probes and `mono_ns` (CLOCK_MONOTONIC, the clock the testbed's fault
records use) stamped on log lines; the daemon reads its clocks, the simulator passes its virtual clock.

One-way delays (for the latency detector) need the peer's clock offset: a `PairEstimator` per
peer, fed from all of its paths (one sample per path and batch), supplies it once converged
(~3 s); until then latency is not judged. Decisions a rate limit deferred are retried on the next step; when no plane to a peer is
usable the route is kept as it is (fail static), logged once and counted.

Host lateness. When replies on every answering path to a peer turn late together (within
`lateness_window_ns`), the cause is a host: the peer's probe thread or this one kept waiting by
the scheduler, or the software fabric starved of CPU; not a link. Such bursts make DOWNs that
the late replies then undo (the detector's spurious-DOWN rule), but a route moved in between is
two needless route changes and a flow re-hashed twice. So each burst sets the peer's *lateness
allowance*: `lateness_factor` × the burst's lateness beyond the timeout, capped at
`lateness_cap_ns`, halving every `lateness_half_life_ns`. A DOWN is acted on once it has stood
for the allowance with no late reply undoing it, or sooner, once the stall is ruled out: the
path missed a probe sent after the DOWN while another path of the peer answered one on time, and
every other path of the peer that is not dark itself answered on time every probe sent since the
path's silence began, or since `stall_end_margin_ns` before that missed probe (a stall then
would explain the silence; one that ended before cannot). The probe core sends those probes at
the DOWN (its confirmation round), so a real cut on a host with a standing allowance is routed
around about one timeout after the DOWN, or a margin after another path's last late answer.
On a calm host the allowance is zero and detection is as fast as the detector
(bench/failover.py, rows healthy-saturated and cut-saturated).

A stall does not reach all of a peer's paths at the same instant (threads and softirqs are kept
waiting one after another): an on-time answer on another path confirms a DOWN only for a probe
sent at least `stall_spread_ns` after the DOWN path's silence began (decide.silence_confirmed),
and the probe core's round for the DOWN goes out no sooner.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .constants import HOST_STALL_END_MARGIN_NS, HOST_STALL_SPREAD_NS
from .clock import Exchange, PairEstimator
from .detector import Detector, Reason, State, Transition
from .entropy_table import Entry
from .probe_event import EV_ANSWERED, EV_MISS, ProbeEvent
from .telemetry import LossCounters
from .decide import PathInfo, entropy_entry, silence_confirmed, usable_planes
from .decisions import Decisions, LogRecord, RouteResult, RouteWant


@dataclass
class _LossMark:
    hi: int
    lost_fwd: int
    lost_rev: int


LATENESS_LOG_EVERY_NS = 10_000_000_000


@dataclass
class _Lateness:
    """One peer's recent late replies and the allowance they earned (see the module doc)."""

    late: dict[int, tuple[int, int]] = field(default_factory=dict)  # path -> (arrival, ns beyond timeout)
    allowance_ns: float = 0.0
    at_ns: int = 0
    logged_ns: int | None = None  # when the last host_lateness line for this peer was written

    def allowance_at(self, now_ns: int, half_life_ns: int) -> float:
        if self.allowance_ns <= 0:
            return 0.0
        return self.allowance_ns * 2.0 ** (-max(0, now_ns - self.at_ns) / half_life_ns)


def reported_state(row: dict) -> str:
    """A path row's state as the coordinator is told it: a DOWN the data path has not acted on is
    reported as suspect, since the host's own lateness or an unconfirmed silence is no evidence
    against the links the path crosses (the coordinator localizes faults from DOWNs)."""
    return State.SUSPECT.value if row["held"] and row["state"] == State.DOWN.value else row["state"]


class Failover:
    def __init__(self, detector: Detector, loss_of: Callable[[int], LossCounters], *,
                 entropy: bool = False, loss_batch_ns: int = 10_000_000, lateness_window_ns: int = 50_000_000,
                 lateness_factor: float = 1.5, lateness_cap_ns: int = 100_000_000,
                 lateness_half_life_ns: int = 60_000_000_000, confirm_window_ns: int = 100_000_000,
                 unanswered_grace_ns: int = 5_000_000_000, stall_spread_ns: int = HOST_STALL_SPREAD_NS,
                 stall_end_margin_ns: int = HOST_STALL_END_MARGIN_NS):
        self.detector = detector
        self.loss_of = loss_of
        self.entropy = entropy  # whether this host has an entropy table: decide its entries
        self.loss_batch_ns = loss_batch_ns
        # path -> send time of its newest answered probe. A path never answered is judged only from
        # `unanswered_grace_ns` after its first miss (peers start at their own pace); after that it
        # goes DOWN like any other, so a path that never worked does not pass for healthy
        self._last_answered: dict[int, int] = {}
        self.unanswered_grace_ns = unanswered_grace_ns
        self._judge_unanswered_from: dict[int, int] = {}
        self._last_on_time: dict[int, int] = {}  # path -> send time of its newest on-time answer
        self._last_missed: dict[int, int] = {}  # path -> send time of its newest missed probe
        self._silent_from: dict[int, int] = {}  # path -> send time of the first miss of its current streak
        self._last_late: dict[int, int] = {}  # path -> send time of its newest late-answered probe
        self.stall_spread_ns = stall_spread_ns
        self.stall_end_margin_ns = stall_end_margin_ns
        self.peer_silent: set[str] = set()
        self._rto_pushed: dict[int, int] = {}
        self.paths: dict[int, PathInfo] = {}
        self.by_peer: dict[str, dict[int, list[int]]] = {}
        self._loss: dict[int, _LossMark] = {}
        self._loss_dirty: set[int] = set()  # paths with events since the last loss batch (only theirs can have moved)
        self._next_loss_ns = 0
        # peer -> its clock estimator, fed by every path to it: the lower delay envelope over all
        # paths stays true while one path is queued one way (which alone would bias the offset)
        self._clocks: dict[str, PairEstimator] = {}
        self._pending: set[str] = set()
        self._entries: dict[tuple[str, int], Entry] = {}
        self._wanted: dict[str, RouteWant] = {}  # the newest route decision per peer
        self.fail_static: set[str] = set()
        self.planes: dict[str, tuple[int, ...]] = {}
        self.counters: Counter = Counter()
        self.last_transition: dict[int, Transition] = {}
        self.drained: frozenset[int] = frozenset()  # paths an operator's drain steers away from
        self.lateness_window_ns = lateness_window_ns
        self.lateness_factor = lateness_factor
        self.lateness_cap_ns = lateness_cap_ns
        self.lateness_half_life_ns = lateness_half_life_ns
        self._lateness: dict[str, _Lateness] = {}
        self._down_at: dict[int, int] = {}  # path -> when its current DOWN was declared
        self._held: set[int] = set()  # DOWN paths the lateness allowance holds (counted once each)
        # paths whose DOWN the data path never acted on (held or unconfirmed throughout): if they
        # answer again, their RECOVERING counts as UP (traffic never left them, so there is no
        # flapping link to keep traffic off while the hold-down runs)
        self._unacted: set[int] = set()
        self._now_ns = 0  # the newest evidence time: what the allowance is measured against
        self.confirm_window_ns = confirm_window_ns
        self._decision_at: int | None = None  # when a DOWN held back from the data path may be decided

    def set_drained(self, path_ids, mono_ns: int) -> Decisions:
        """Paths crossing a drained link: unusable for the data path (still probed and judged,
        so `linkpass paths` shows the link's health while drained). Re-decides their peers."""
        new = frozenset(path_ids)
        for pid in new ^ self.drained:
            info = self.paths.get(pid)
            if info is not None:
                self._pending.add(info.peer)
        self.drained = new
        return self.decide(mono_ns)

    # ---- paths ---------------------------------------------------------------------------
    def add_path(self, info: PathInfo) -> None:
        self.paths[info.path_id] = info
        self.detector.add_path(info.path_id)
        self.by_peer.setdefault(info.peer, {}).setdefault(info.plane, []).append(info.path_id)
        self._clocks.setdefault(info.peer, PairEstimator(compare_ntp=False))
        self._pending.add(info.peer)

    def remove_peer(self, peer: str) -> Decisions:
        """Forget the peer's paths; the decisions drop its entropy-table entries."""
        out = Decisions()
        for ids in self.by_peer.pop(peer, {}).values():
            for pid in ids:
                self.paths.pop(pid, None)
                self.detector.remove_path(pid)
                self._loss.pop(pid, None)
                self.last_transition.pop(pid, None)
                self._last_answered.pop(pid, None)
                self._last_on_time.pop(pid, None)
                self._last_missed.pop(pid, None)
                self._silent_from.pop(pid, None)
                self._last_late.pop(pid, None)
                self._judge_unanswered_from.pop(pid, None)
                self._down_at.pop(pid, None)
                self._held.discard(pid)
                self._unacted.discard(pid)
                self._rto_pushed.pop(pid, None)
        self._clocks.pop(peer, None)
        self._lateness.pop(peer, None)
        self._pending.discard(peer)
        self.fail_static.discard(peer)
        self.peer_silent.discard(peer)
        self._wanted.pop(peer, None)
        for key in [k for k in self._entries if k[0] == peer]:
            entry = self._entries.pop(key)
            out.removed.append((entry.peer, entry.plane))
        return out

    def offset_ns(self, peer: str, t_ns: int) -> float | None:
        """The peer's clock minus ours at `t_ns` (our clock), once the estimator has converged."""
        est = self._clocks.get(peer)
        if est is None or not est.converged:
            return None
        return est.offset_at(t_ns)

    # ---- the step ------------------------------------------------------------------------
    def step(self, events: Iterable[ProbeEvent], evidence_ns: int, mono_ns: int) -> Decisions:
        """Feed one poll's events (engine.poll(), in order, already in telemetry) judged up to
        `evidence_ns`; returns the transitions they caused and what to do about them. `mono_ns`:
        now, for the log lines."""
        decided = Decisions()
        det = self.detector
        # while a failure is being decided the clock estimate takes no exchanges: one that closes a
        # window costs its fit (0.8 ms of CPU at 500 exchanges a window, once a second per peer)
        busy = self.in_flight()
        answered, on_time = self._last_answered, self._last_on_time
        if evidence_ns > self._now_ns:
            self._now_ns = evidence_ns
        out: list[Transition] = []
        touched = set()
        dirty = self._loss_dirty
        for ev in events:
            pid = ev.path_id
            info = self.paths.get(pid)
            if info is None:
                continue
            dirty.add(pid)
            kind, t1, t4 = ev.kind, ev.t1, ev.t4
            if kind == EV_MISS:
                if t1 > self._last_missed.get(pid, 0):
                    self._last_missed[pid] = t1
                if not ev.size_probe:  # the detector's streak: full-size probes are the MTU check's
                    self._silent_from.setdefault(pid, t1)
                if pid in answered or t4 >= self._judge_unanswered_from.setdefault(pid, t4 + self.unanswered_grace_ns):
                    out += det.on_miss(pid, ev.seq, t4, bool(ev.size_probe))  # t4: the deadline
                continue
            t2, t3 = ev.t2, ev.t3
            self._silent_from.pop(pid, None)  # any reply, a late one too, ends the streak
            if kind != EV_ANSWERED and t1 > self._last_late.get(pid, 0):
                self._last_late[pid] = t1
            first_answer = pid not in answered
            if t1 > answered.get(pid, 0):
                answered[pid] = t1
            if kind == EV_ANSWERED and t1 > on_time.get(pid, 0):
                on_time[pid] = t1
            est = self._clocks[info.peer]
            owd_fwd = owd_rev = None
            if est.converged:
                off = est.offset_at(t1)
                owd_fwd, owd_rev = int(t2 - t1 - off), int(t4 - t3 + off)
            if t1 <= t4 and t2 <= t3 and not busy:
                est.add(Exchange(t1, t2, t3, t4))
            if first_answer:
                continue
            touched.add(pid)
            if kind == EV_ANSWERED:
                out += det.on_answered(pid, ev.count, ev.seq, t4, t4 - t1, owd_fwd, owd_rev, bool(ev.size_probe),
                                       ev.worst_rtt_ns)
            else:  # EV_LATE
                self._late_reply(decided, info, t4, t4 - t1 - det[pid].rto_ns, mono_ns)
                out += det.on_reply(pid, ev.seq, t4, t4 - t1, owd_fwd, owd_rev)
        # a little slack: the daemon wakes every 10 ms by its own clock and the evidence time it
        # reads trails the wake by up to a probe-thread loop, so an exact comparison lets every
        # other batch slip to the next wake (measured on the testbed: a batch every 13.9 ms on
        # average, p90 20 ms, and gray loss judged ~30 % late)
        if evidence_ns >= self._next_loss_ns - self.loss_batch_ns // 4:
            self._next_loss_ns = evidence_ns + self.loss_batch_ns
            out += self._loss_batches(evidence_ns)
        if evidence_ns:
            out += det.tick(evidence_ns)  # hold-downs and flap reuse (deadlines are judged in C)
        for pid in touched:
            self._push_rto(decided, pid)
        decided.transitions = out
        decided.path_logs = [LogRecord("path_state", fields) for t in out
                             if (fields := self._on_transition(t, mono_ns)) is not None]
        return self.decide(mono_ns, decided)

    def _late_reply(self, decided: Decisions, info: PathInfo, arrival_ns: int, beyond_ns: int, mono_ns: int) -> None:
        """Note a late reply; when every answering path to its peer has one within the window, the
        burst is the host's: raise the peer's lateness allowance."""
        lat = self._lateness.setdefault(info.peer, _Lateness())
        lat.late[info.path_id] = (arrival_ns, max(0, beyond_ns))
        since = arrival_ns - self.lateness_window_ns
        worst = 0
        for ids in self.by_peer.get(info.peer, {}).values():
            for pid in ids:
                seen = lat.late.get(pid)
                if seen is not None and seen[0] >= since:
                    worst = max(worst, seen[1])
                elif pid in self._last_answered and self.detector[pid].state not in (State.DOWN, State.DAMPED):
                    return  # a path that answers on time: not host-wide
        now_allow = lat.allowance_at(arrival_ns, self.lateness_half_life_ns)
        new = min(float(self.lateness_cap_ns), self.lateness_factor * worst)
        if new > now_allow:
            self.counters["host_lateness_raised"] += 1
            # a line when the allowance rises from nothing, else at most one per LATENESS_LOG_EVERY_NS:
            # on a host starved for minutes every burst raises it, and the log must not flood
            if now_allow < 1e6 or lat.logged_ns is None or arrival_ns - lat.logged_ns >= LATENESS_LOG_EVERY_NS:
                lat.logged_ns = arrival_ns
                decided.log("host_lateness", peer=info.peer, late_ms=round(worst / 1e6, 3),
                         allowance_ms=round(new / 1e6, 3), mono_ns=mono_ns,
                         note="replies on every path to this peer came late together: a host kept waiting, "
                              "not a link; DOWNs are acted on only after the allowance")
            lat.allowance_ns, lat.at_ns = new, arrival_ns

    def held_back(self, pid: int) -> bool:
        """Whether the path is DOWN (or recovering from one) that the data path has not acted on:
        held for the host's lateness, or not confirmed by another path of its peer."""
        return pid in self._unacted

    def allowance_ns(self, peer: str) -> int:
        """The peer's lateness allowance now (0 on a calm host)."""
        lat = self._lateness.get(peer)
        return int(lat.allowance_at(self._now_ns, self.lateness_half_life_ns)) if lat else 0

    def _push_rto(self, decided: Decisions, pid: int) -> None:
        """Tell the data path the detector's current timeout when it moved by more than 5 %."""
        rto = self.detector[pid].rto_ns
        old = self._rto_pushed.get(pid)
        if old is None or abs(rto - old) * 20 > old:
            self._rto_pushed[pid] = rto
            decided.rto.append((pid, rto))

    def _loss_batches(self, now_ns: int) -> list[Transition]:
        out: list[Transition] = []
        dirty, self._loss_dirty = self._loss_dirty, set()
        for pid in sorted(dirty):  # a path without events since the last batch has no new trials
            if pid not in self.paths:
                continue
            lc = self.loss_of(pid)
            if lc.start_seq is None:
                continue
            mark = self._loss.get(pid)
            if mark is None:
                self._loss[pid] = _LossMark(lc.hi, lc.lost_fwd, lc.lost_rev)
                continue
            if lc.hi <= mark.hi:
                continue
            trials = lc.hi - mark.hi
            fwd = min(trials, max(0, lc.lost_fwd - mark.lost_fwd))
            rev = min(trials - fwd, max(0, lc.lost_rev - mark.lost_rev))
            out += self.detector.on_loss(pid, mark.hi + 1, lc.hi, fwd, rev, now_ns)
            self._loss[pid] = _LossMark(lc.hi, lc.lost_fwd, lc.lost_rev)
        return out

    def _on_transition(self, t: Transition, mono_ns: int) -> dict | None:
        """Count the transition and mark its peer for a decision; returns its log fields, if it
        is worth a log line."""
        info = self.paths.get(t.path)
        if info is None:
            return None
        self.counters[f"transition_{t.new.value}"] += 1
        self.last_transition[t.path] = t
        # an unacted DOWN (and the RECOVERING after it) counts as usable for the data path, so
        # whatever it turns into next may change the decision even when the detector's own
        # usability does not (RECOVERING -> DEGRADED: both unusable to the detector)
        was_unacted = t.path in self._unacted
        if t.reason is Reason.SPURIOUS_DOWN and was_unacted:
            self.counters["lateness_absorbed"] += 1  # a DOWN undone before the data path moved for it
        if t.new is State.DOWN:
            self._down_at[t.path] = t.at_ns
            if t.old in (State.UP, State.SUSPECT) or t.path in self._unacted:
                self._unacted.add(t.path)
        elif t.new is not State.RECOVERING:
            self._unacted.discard(t.path)
        if t.old is State.DOWN and t.new is not State.DOWN:
            self._down_at.pop(t.path, None)
            self._held.discard(t.path)
        if t.old.usable != t.new.usable or was_unacted:
            self._pending.add(info.peer)
        if {t.old, t.new} == {State.UP, State.SUSPECT}:
            return None  # a single late probe: counted, not worth a log line each
        return dict(peer=info.peer, plane=info.plane, sport=info.sport, path=t.path, old=t.old.value,
                    new=t.new.value, reason=t.reason.value, detail=t.detail, at_ns=t.at_ns, mono_ns=mono_ns)

    # ---- deciding ----------------------------------------------------------------------------
    def decide(self, mono_ns: int, decided: Decisions | None = None) -> Decisions:
        """Re-decide every peer whose paths changed usability (and retry deferred ones), into
        `decided` (a new Decisions if None). `mono_ns`: now, for the log records."""
        decided = Decisions() if decided is None else decided
        self._decision_at = None
        for peer in sorted(self._pending):
            planes = self.by_peer.get(peer, {})
            eff, unconfirmed, held = self._effective_states(peer, planes)
            self._note_decision_time(peer, unconfirmed, held)
            choice = usable_planes({plane: [eff[pid] for pid in ids] for plane, ids in planes.items()})
            if unconfirmed and peer not in self.peer_silent:
                self.peer_silent.add(peer)
                self.counters["peer_silent"] += 1
                decided.log("peer_silent", peer=peer, paths=sorted(unconfirmed),
                            note="paths went dark with no other path to this peer answering since: "
                                 "the peer itself is the likelier cause; routes stay until it is heard again")
            elif not unconfirmed:
                self.peer_silent.discard(peer)
            want = RouteWant(peer, tuple(sorted(choice.planes)), choice.quality)
            self._wanted[peer] = want
            decided.routes.append(want)
            if self.entropy:
                for plane, ids in planes.items():
                    entry = entropy_entry([(self.paths[i], eff[i]) for i in ids])
                    if self._entries.get((peer, plane)) != entry:
                        decided.entropy.append(entry)
                        self._entries[(peer, plane)] = entry
                        self.counters["entropy_updates"] += 1
            if not unconfirmed and not held:  # else re-decide on every step until the silence is explained
                self._pending.discard(peer)
        return decided

    def routes_done(self, results: Iterable[RouteResult], mono_ns: int) -> list[LogRecord]:
        """What the data path did with `Decisions.routes`, one result per RouteWant (a peer
        without a route to rewrite: `RouteResult.not_routed`). A deferred change keeps its peer
        pending; returns the log records of route changes and fail-static peers."""
        logs: list[LogRecord] = []
        for r in results:
            peer = r.peer
            want = self._wanted.get(peer)
            if want is None:
                continue  # the peer left between the decision and its result
            if r.deferred:
                self._pending.add(peer)
                self.counters["route_deferred"] += 1
            elif r.changed:
                self.counters["route_changes"] += 1
                logs.append(LogRecord.of("route_change", peer=peer, planes=list(r.planes), quality=want.quality,
                                         dry_run=r.dry_run, mono_ns=mono_ns if r.mono_ns is None else r.mono_ns))
            self.planes[peer] = tuple(r.planes)
            if want.quality == "none":
                if peer not in self.fail_static:
                    self.fail_static.add(peer)
                    self.counters["fail_static"] += 1
                    logs.append(LogRecord.of(
                        "fail_static", peer=peer, planes=list(self.planes.get(peer, ())),
                        note="no usable path to this peer: keeping the current route rather than none"))
            elif peer in self.fail_static:
                self.fail_static.discard(peer)
                logs.append(LogRecord.of("fail_static_cleared", peer=peer))
        return logs

    def _note_decision_time(self, peer: str, unconfirmed: list[int], held: list[int]) -> None:
        """A held DOWN is decided when its allowance ends (or sooner, by its re-probe's miss, an
        event that wakes the caller anyway); an unconfirmed one by the next on-time answers of the
        peer's other paths (wanted at once, while the DOWN is young: a real cut's
        route should not wait for the next batch of answers)."""
        allowance = self.allowance_ns(peer)
        times = [self._down_at.get(pid, 0) + allowance for pid in held]
        if any(self._now_ns - self._down_at.get(pid, 0) < self.confirm_window_ns for pid in unconfirmed):
            times.append(self._now_ns)
        if times:
            t = min(times)
            self._decision_at = t if self._decision_at is None else min(self._decision_at, t)

    def in_flight(self) -> bool:
        """Whether a failure is being decided: a path that still counts as up is in a streak of
        misses, or a DOWN is held back from the data path until answers confirm it or its
        allowance ends. Each lasts a few timeouts, at most `confirm_window_ns` or the lateness cap;
        a path already DOWN that keeps missing is not in flight. The agent runs its loop at
        real-time priority meanwhile (agent/loop_priority.py), so the answers that settle it are
        read when they come, not when the scheduler gets round to the loop."""
        if self._decision_at is not None:
            return True
        det = self.detector
        return any(det[pid].state in (State.UP, State.SUSPECT) for pid in self._silent_from)

    def decision_wait_ns(self) -> int | None:
        """How long after the newest evidence time a DOWN held back from the data path may be
        decided (0: as soon as fresh answers are in), or None: nothing waits. The caller wakes
        then (no earlier than its next probe could be answered) and steps with every path's answers."""
        if self._decision_at is None:
            return None
        return max(0, self._decision_at - self._now_ns)

    def _effective_states(self, peer: str, planes: dict[int, list[int]]
                          ) -> tuple[dict[int, State], list[int], list[int]]:
        """Path states as the data path should see them: a DOWN path whose silence no other path
        of the same peer confirms, or that has stood for less than the peer's lateness allowance,
        counts as UP until then (unless a stall is ruled out sooner: see the module doc); returns
        the states, the unconfirmed paths and the held ones."""
        on_time = {pid: self._last_on_time.get(pid, 0) for ids in planes.values() for pid in ids}
        allowance = self.allowance_ns(peer)
        eff: dict[int, State] = {}
        unconfirmed, held = [], []
        for pid in on_time:
            st = self.detector[pid].state
            down_at = self._down_at.get(pid, 0)
            silent_from = self._silent_from.get(pid)
            if st is State.DOWN and not silence_confirmed(
                    down_at, (t for q, t in on_time.items() if q != pid), silent_from, self.stall_spread_ns):
                unconfirmed.append(pid)
                st = State.UP
            elif (st is State.DOWN and self._now_ns < down_at + allowance
                  and not self._stall_ruled_out(pid, on_time, down_at, silent_from)):
                if pid not in self._held:
                    self._held.add(pid)
                    self.counters["down_held_for_lateness"] += 1
                held.append(pid)
                st = State.UP
            elif st is State.DOWN:
                self._unacted.discard(pid)  # acted on from here
            elif st is State.RECOVERING and pid in self._unacted:
                st = State.UP
            if pid in self.drained:
                st = State.DOWN
            eff[pid] = st
        return eff, unconfirmed, held

    def _stall_ruled_out(self, pid: int, peer_paths: Iterable[int], down_at: int, silent_from: int | None) -> bool:
        """Whether a confirmed DOWN is a path's, not a stall's, before the lateness allowance has
        run out: the path missed a probe sent after the DOWN, and every other path of the peer
        that is not dark itself answered on time every probe sent since the path's silence began
        (a miss there may be a late reply still on its way), or at least since
        `stall_end_margin_ns` before that missed probe was sent, one of them answering on time a
        probe sent since: a stall that ended before then cannot explain the miss, and one still
        going would show on them too."""
        missed = self._last_missed.get(pid, 0)
        if missed <= down_at:
            return False
        since = max(down_at if silent_from is None else silent_from, missed - self.stall_end_margin_ns)
        det = self.detector
        others = [q for q in peer_paths if q != pid and det[q].state not in (State.DOWN, State.DAMPED)]
        return (any(self._last_on_time.get(q, 0) >= since for q in others)
                and all(max(self._last_late.get(q, 0), self._last_missed.get(q, 0)) < since for q in others))

    def waiting_for(self, pid: int) -> list[str]:
        """What still keeps a RECOVERING path out of use, in words (the detector's, as of the newest
        evidence); empty in any other state."""
        d = self.detector.paths.get(pid)
        return d.waiting_for(self._now_ns) if d is not None else []

    def path_rows(self) -> list[dict]:
        """Per path: peer, plane, port, state, the last reason and, while RECOVERING, what it waits
        for (for the API and metrics)."""
        rows = []
        for pid, info in sorted(list(self.paths.items())):
            d = self.detector[pid]
            last = self.last_transition.get(pid)
            rows.append({"path": pid, "peer": info.peer, "plane": info.plane, "sport": info.sport,
                         "state": d.state.value, "usable": d.state.usable and pid not in self.drained,
                         "drained": pid in self.drained, "rto_ns": d.rto_ns, "held": self.held_back(pid),
                         "reason": last.reason.value if last else None,
                         "waiting_for": self.waiting_for(pid)})
        return rows

"""Per-path failure detection: hard failures, gray loss, latency, MTU black holes, flapping.

Pure: no I/O, no clock reads, no randomness. Time comes in as integer nanoseconds on the
sender's clock; decisions go out as `Transition` records that the caller logs and acts on
(route and entropy actuators). The simulator and the agent run this same code.

One `PathDetector` per probed path is a state machine with explicit `State`s. Inputs are turned
into `Event`s; `TRANSITIONS` (data) says which (state, event) pairs are allowed and where they
lead. An event that the table does not allow in the current state is ignored (it is normal:
a gray-loss verdict on a path that is already DOWN means nothing), never an error. Each allowed
entry names one transition function that owns all of its side effects (timestamps, counters,
penalties, resets) and returns the `Transition` as data.

    UP ──miss──► SUSPECT ──N misses──► DOWN ──reply──► RECOVERING ──hold-down + N good──► UP
    UP/SUSPECT/RECOVERING ──gray loss | latency | MTU──► DEGRADED ──evidence clears──► RECOVERING
    DEGRADED/RECOVERING ──N misses──► DOWN ──penalty ≥ suppress──► DAMPED ──penalty ≤ reuse──►
        RECOVERING (path answering) | DOWN (path dark)
    DOWN | DAMPED | RECOVERING ──a probe of the streak that declared the DOWN is answered after
        all──► UP, or RECOVERING when the streak found the path RECOVERING or DEGRADED (spurious)

Mechanisms, and why these numbers (defaults in `DetectorConfig`, tuned for 1 ms probes):

Hard failure. Every sent probe gets a deadline `sent + rto`, where rto is RFC 6298 in ns:
srtt/rttvar smoothed with 1/8 and 1/4 from every reply, rto = clamp(srtt + k·rttvar,
timeout_floor_ns, timeout_ceiling_ns). A probe unanswered at its deadline is a *miss*; any reply
(even a late one) proves the path alive and resets the streak. `miss_threshold` consecutive
misses declare DOWN. With probes every I = 1 ms, N = 3 and a 250 µs floor (veth/ToR RTTs are
tens of µs, so the floor dominates): the first lost probe is sent at most I after the fault and
DOWN is declared at its deadline + (N-1)·I, i.e. 2.25 ms after the first lost probe and
≤ 3.25 ms after the fault. A healthy path needs N consecutive replies later than rto to trip:
with exponential jitter of mean m around a base, rto ≥ base + ~4 m, so p(one late) ≈ e⁻⁴ or
less and p(three in a row) ≈ 1e-5 or less before the floor helps; with the floor it is far lower.

Spurious DOWN. On a busy host (and on this software fabric) a reply can be late by more than
the timeout without being lost. If a probe counted in the streak that declared DOWN is answered
after all, the DOWN was spurious (as TCP's Eifel detection undoes a spurious retransmit timeout):
the path returns to UP at once and the flap penalty of that DOWN is taken back. The timeout is
not raised for it: measured on the testbed, such lateness comes in host-wide bursts (every path
late by 3-30 ms at once), which say nothing about the path, and raising the floor after each made
later real failures take tens of ms to detect. RFC 6298 smoothing (fed each batch's worst RTT)
is what adapts the timeout to a path that really is slower. Whatever state the streak found
the path in, its flap penalty is taken back; a path found UP or SUSPECT returns to UP, one found
RECOVERING (its hold-down running on from where it was) or DEGRADED returns to RECOVERING, one
found DAMPED stays so. The undo also applies once the path has gone on to RECOVERING or DAMPED:
the first reply after the streak may be an older probe's (a full-size one, which does not count
in the streak), and the streak's own late replies follow it. Without all this, each burst would
cost a flap penalty, and a host starved for minutes would end up DAMPED on every path.

Gray loss, per direction. The telemetry tells forward loss (request never reached the
reflector) from reverse loss (reply lost) exactly, via the reflector's rx_count; the caller
passes per-batch counts to `on_loss`. Each direction runs two Wald SPRTs of H0: p = p0 against
H1: p = p1, a fast one (p1 = 5 %) for heavy loss and a sensitive one (p1 = 0.5 %) for light
loss, with α = 1e-6, β = 0.01:

    A = ln((1-β)/α) = 13.81   (accept H1: degraded)     B = ln(β/(1-α)) = -4.61   (accept H0)
    per probe:  lost  +ln(p1/p0)             ok  +ln((1-p1)/(1-p0))

    fast, p0 = 0.1 %, p1 = 5 %:   lost +3.912, ok -0.0503
        at 10 % loss the drift is 0.1·3.912 - 0.9·0.0503 = +0.346 per probe: from a fresh
        start 13.81/0.346 = 40 probes (40 ms); worst case, starting at B, 18.4/0.346 = 53 ms.
    slow, p0 = 0.1 %, p1 = 0.5 %: lost +1.609, ok -0.0040
        at 1 % loss the drift is 0.01·1.609 - 0.99·0.0040 = +0.0121 per probe: 13.81/0.0121 =
        1140 probes (1.14 s) from a fresh start, 1.52 s worst case. Both ≤ 2 s at 1 kHz.
        (The fast test alone cannot see 1 %: its drift there is -0.011, which is why two.)
    healthy (0.01 % loss): drift fast -0.050, slow -0.0038, so each test accepts H0 and
        restarts every ~92 resp. ~1200 probes; a restart ends in a false H1 with probability
        well below α = 1e-6 (α holds at p0 = 0.1 %, ten times the healthy rate), i.e. < 1e-3
        expected false verdicts per direction per minute.

A test restarts from 0 after each decision ("reset on decision"). While DEGRADED for a
direction, that direction's sums are held at or below 0 (the verdict is in; only the way back
matters) and the direction clears when its sensitive test accepts H0: loss back below ~0.25 %,
after ≥ 4.61/0.004 ≈ 1150 clean probes.

Latency, per direction. One-sided CUSUM on one-way delay against a baseline learned from the
first `latency_learn_samples` replies: median and MAD (robust: queueing spikes do not move
them). z = (owd - median) / max(MAD, floor), clipped to ±latency_clip_mad so a single outlier
cannot fire it; S = max(0, S + z - latency_k_mad); alarm at S ≥ latency_h_mad. With exponential
jitter a healthy z has median 0 and mean ~0.64, so k = 3 leaves a strong negative drift; a shift
of +D costs about h / (min(D/MAD, clip) - k) samples: +200 µs over a 5 µs MAD is 40/7 ≈ 6 ms.
A latency fault clears when the median z of the last `latency_clear_window` samples is ≤ k/2.
One-way delays must be clock-corrected (`clock.py`): raw t2 - t1 drifts with the clocks.

MTU black hole. Full-size probes (`size_probe=True`) that miss while small probes are being
answered (no small miss streak running) count; `mtu_misses` of them in a row, with no full-size
reply in between, is MTU_BLACKHOLE. Their losses are taken out of the gray-loss batches (the
detector remembers which sequences were full-size), so a black hole does not also read as 1 %
gray loss.

Flapping. Route-flap damping: every declaration of DOWN adds `flap_penalty` (1000); the
penalty halves every `flap_half_life_ns` (10 s). At ≥ `flap_suppress` (2000: three failures
within a few seconds) the path is DAMPED and stays out, whatever it does, until the penalty
decays to ≤ `flap_reuse` (750). Failures while damped keep adding (capped at
`flap_max_penalty`).

Recovery. A path leaving DOWN, DAMPED or DEGRADED goes to RECOVERING, and returns to UP only
after `hold_down_ns` (500 ms) in RECOVERING with ≥ `recovery_good_probes` replies in a row (a
probe answered after its deadline neither counts nor breaks the run; one never answered breaks
it) and no gray evidence (both sensitive SPRTs below the weight of one lost probe, both
CUSUMs below h/2, no MTU misses pending). Any new evidence sends it back to DEGRADED or DOWN.
One loss is tolerated because the sensitive test restarts from 0 on every decision: a single
loss puts it at +1.6, which takes 400 clean probes to undo, so "at or below 0" kept paths with
0.2-0.3 % background loss (which an UP path is never degraded for) RECOVERING for minutes at
100 probes/s. At 1 % loss or more the test still climbs past that weight before the hold-down
ends in most runs, and at worst the path returns to UP and is degraded a second later.
"""
from __future__ import annotations

import enum
import heapq
import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, fields

from .states import DARK, Direction, State

NS_PER_MS = 1_000_000


# ---- events, reasons (the states and what they mean to everyone else: states.py) -------------

class Event(enum.Enum):
    MISS = "miss"  # first miss of a streak
    MISSES = "misses"  # the streak reached miss_threshold
    REPLY = "reply"  # a reply arrived
    GRAY = "gray"  # an SPRT accepted H1 (degraded loss)
    LATENCY = "latency"  # a CUSUM alarm
    MTU = "mtu"  # full-size probes black-holed
    CLEAN = "clean"  # every fault of a DEGRADED path has cleared
    HOLD_OK = "hold_ok"  # hold-down passed with enough good probes and no evidence
    SUPPRESS = "suppress"  # flap penalty reached the suppress threshold
    REUSE_LIVE = "reuse_live"  # penalty decayed to reuse; path answering
    REUSE_DARK = "reuse_dark"  # penalty decayed to reuse; path still dark
    LATE = "late"  # a probe counted in the streak that declared DOWN was answered after all
    LATE_WATCH = "late_watch"  # the same, for a streak that found the path RECOVERING or DEGRADED


class Reason(enum.Enum):
    MISSED_PROBE = "missed_probe"
    HARD_FAILURE = "hard_failure"
    GRAY_LOSS_FWD = "gray_loss_fwd"
    GRAY_LOSS_REV = "gray_loss_rev"
    LATENCY_FWD = "latency_fwd"
    LATENCY_REV = "latency_rev"
    MTU_BLACKHOLE = "mtu_blackhole"
    FLAPPING = "flapping"
    REPLY_SEEN = "reply_seen"  # a probe answered again (SUSPECT -> UP, DOWN -> RECOVERING)
    EVIDENCE_CLEARED = "evidence_cleared"
    REUSED = "reused"
    RECOVERED = "recovered"
    SPURIOUS_DOWN = "spurious_down"  # late, not lost: the DOWN is undone (the timeout stays as it was)


_GRAY_REASON = {Direction.FWD: Reason.GRAY_LOSS_FWD, Direction.REV: Reason.GRAY_LOSS_REV}
_LATENCY_REASON = {Direction.FWD: Reason.LATENCY_FWD, Direction.REV: Reason.LATENCY_REV}
# the reasons that name the direction they were judged in (the others cannot tell)
DIRECTION_OF_REASON = {r: d for table in (_GRAY_REASON, _LATENCY_REASON) for d, r in table.items()}


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change, for the caller to log and act on (routes, entropy table, metrics)."""

    path: Hashable
    old: State
    new: State
    event: Event
    reason: Reason
    at_ns: int
    detail: str = ""


# (state, event) -> (new state, name of the PathDetector method that performs it). Anything not
# here is ignored in that state. Several entries may share a function when the side effects are
# the same (entering DEGRADED is the same act from UP, SUSPECT or RECOVERING).
TRANSITIONS: dict[tuple[State, Event], tuple[State, str]] = {
    (State.UP, Event.MISS): (State.SUSPECT, "_t_suspect"),
    (State.SUSPECT, Event.REPLY): (State.UP, "_t_unsuspect"),
    (State.SUSPECT, Event.MISSES): (State.DOWN, "_t_down"),
    (State.DEGRADED, Event.MISSES): (State.DOWN, "_t_down"),
    (State.RECOVERING, Event.MISSES): (State.DOWN, "_t_down"),
    (State.UP, Event.MISSES): (State.DOWN, "_t_down"),  # miss_threshold = 1
    (State.UP, Event.GRAY): (State.DEGRADED, "_t_degrade"),
    (State.SUSPECT, Event.GRAY): (State.DEGRADED, "_t_degrade"),
    (State.RECOVERING, Event.GRAY): (State.DEGRADED, "_t_degrade"),
    (State.UP, Event.LATENCY): (State.DEGRADED, "_t_degrade"),
    (State.SUSPECT, Event.LATENCY): (State.DEGRADED, "_t_degrade"),
    (State.RECOVERING, Event.LATENCY): (State.DEGRADED, "_t_degrade"),
    (State.UP, Event.MTU): (State.DEGRADED, "_t_degrade"),
    (State.SUSPECT, Event.MTU): (State.DEGRADED, "_t_degrade"),
    (State.RECOVERING, Event.MTU): (State.DEGRADED, "_t_degrade"),
    (State.DEGRADED, Event.CLEAN): (State.RECOVERING, "_t_watch"),
    (State.DOWN, Event.REPLY): (State.RECOVERING, "_t_watch"),
    (State.RECOVERING, Event.HOLD_OK): (State.UP, "_t_recovered"),
    (State.DOWN, Event.SUPPRESS): (State.DAMPED, "_t_damp"),
    (State.DAMPED, Event.REUSE_LIVE): (State.RECOVERING, "_t_reuse"),
    (State.DAMPED, Event.REUSE_DARK): (State.DOWN, "_t_reuse"),
    (State.DOWN, Event.LATE): (State.UP, "_t_undo"),
    (State.RECOVERING, Event.LATE): (State.UP, "_t_undo"),  # after an older probe's late reply
    (State.DAMPED, Event.LATE): (State.UP, "_t_undo"),  # the spurious DOWN's penalty had damped it
    (State.DOWN, Event.LATE_WATCH): (State.RECOVERING, "_t_undo"),
    (State.DAMPED, Event.LATE_WATCH): (State.RECOVERING, "_t_undo"),
}


# ---- configuration ----------------------------------------------------------------------------

def _fail(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"DetectorConfig.{name}: {value!r} is not allowed; expected {allowed}")


@dataclass(frozen=True)
class DetectorConfig:
    """Detector parameters; defaults are for 1 ms probes on a datacenter fabric (see module doc)."""

    miss_threshold: int = 3
    timeout_floor_ns: int = 250_000
    timeout_ceiling_ns: int = 50_000_000
    initial_timeout_ns: int = 5_000_000  # before the first RTT sample
    rtt_k: float = 4.0
    gray_p0: float = 0.001
    gray_p1_fast: float = 0.05
    gray_p1_slow: float = 0.005
    gray_alpha: float = 1e-6
    gray_beta: float = 0.01
    latency_learn_samples: int = 256
    latency_k_mad: float = 3.0
    latency_h_mad: float = 40.0
    latency_clip_mad: float = 10.0
    latency_mad_floor_ns: int = 2_000
    latency_clear_window: int = 64
    mtu_misses: int = 3
    flap_penalty: float = 1000.0
    flap_half_life_ns: int = 10_000_000_000
    flap_suppress: float = 2000.0
    flap_reuse: float = 750.0
    flap_max_penalty: float = 16000.0
    hold_down_ns: int = 500_000_000
    recovery_good_probes: int = 100
    max_outstanding: int = 65_536  # probes awaiting a reply; older ones are forgotten

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise _fail(f.name, value, "an integer")
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise _fail(f.name, value, "a finite number")
        for name in ("miss_threshold", "mtu_misses", "recovery_good_probes", "latency_clear_window",
                     "timeout_floor_ns", "flap_half_life_ns", "latency_mad_floor_ns"):
            if getattr(self, name) < 1:
                raise _fail(name, getattr(self, name), "≥ 1")
        if self.latency_learn_samples < 8:
            raise _fail("latency_learn_samples", self.latency_learn_samples, "≥ 8 (a median needs samples)")
        if self.max_outstanding < 16:
            raise _fail("max_outstanding", self.max_outstanding, "≥ 16")
        if self.hold_down_ns < 0:
            raise _fail("hold_down_ns", self.hold_down_ns, "≥ 0")
        if self.timeout_ceiling_ns < self.timeout_floor_ns:
            raise _fail("timeout_ceiling_ns", self.timeout_ceiling_ns,
                        f"≥ timeout_floor_ns ({self.timeout_floor_ns})")
        if not self.timeout_floor_ns <= self.initial_timeout_ns <= self.timeout_ceiling_ns:
            raise _fail("initial_timeout_ns", self.initial_timeout_ns,
                        f"between timeout_floor_ns ({self.timeout_floor_ns}) and timeout_ceiling_ns "
                        f"({self.timeout_ceiling_ns})")
        if self.rtt_k <= 0:
            raise _fail("rtt_k", self.rtt_k, "> 0")
        if not 0 < self.gray_p0 < 1:
            raise _fail("gray_p0", self.gray_p0, "a probability in (0, 1)")
        for name in ("gray_p1_fast", "gray_p1_slow"):
            if not self.gray_p0 < getattr(self, name) < 1:
                raise _fail(name, getattr(self, name), f"a probability in (gray_p0={self.gray_p0}, 1)")
        for name in ("gray_alpha", "gray_beta"):
            if not 0 < getattr(self, name) < 0.5:
                raise _fail(name, getattr(self, name), "an error rate in (0, 0.5)")
        if self.latency_k_mad < 0:
            raise _fail("latency_k_mad", self.latency_k_mad, "≥ 0")
        if self.latency_clip_mad <= self.latency_k_mad:
            raise _fail("latency_clip_mad", self.latency_clip_mad,
                        f"> latency_k_mad ({self.latency_k_mad}), or a shift could never accumulate")
        if self.latency_h_mad <= 0:
            raise _fail("latency_h_mad", self.latency_h_mad, "> 0")
        if self.flap_penalty <= 0:
            raise _fail("flap_penalty", self.flap_penalty, "> 0")
        if not 0 < self.flap_reuse < self.flap_suppress:
            raise _fail("flap_reuse", self.flap_reuse, f"in (0, flap_suppress={self.flap_suppress})")
        if self.flap_max_penalty < self.flap_suppress:
            raise _fail("flap_max_penalty", self.flap_max_penalty, f"≥ flap_suppress ({self.flap_suppress})")


# ---- statistics -------------------------------------------------------------------------------

class Sprt:
    """Wald's sequential probability ratio test of Bernoulli loss p0 against p1; restarts on decision."""

    def __init__(self, p0: float, p1: float, alpha: float, beta: float) -> None:
        self.inc_lost = math.log(p1 / p0)
        self.inc_ok = math.log((1 - p1) / (1 - p0))
        self.upper = math.log((1 - beta) / alpha)
        self.lower = math.log(beta / (1 - alpha))
        self.llr = 0.0

    def update(self, trials: int, lost: int) -> bool | None:
        """Add a batch; True = degraded (H1), False = healthy (H0), None = undecided."""
        self.llr += lost * self.inc_lost + (trials - lost) * self.inc_ok
        if self.llr >= self.upper:
            self.llr = 0.0
            return True
        if self.llr <= self.lower:
            self.llr = 0.0
            return False
        return None

    def reset(self) -> None:
        self.llr = 0.0


class Cusum:
    """One-sided CUSUM of one-way delay in units of a learned MAD (see module doc)."""

    def __init__(self, cfg: DetectorConfig) -> None:
        self.cfg = cfg
        self.learning: list[int] = []
        self.median: float | None = None
        self.mad: float = 0.0
        self.s = 0.0
        self.recent: deque[float] = deque(maxlen=cfg.latency_clear_window)

    def update(self, owd_ns: int) -> bool:
        """Feed one delay; True when the alarm fires (the sum restarts from 0)."""
        cfg = self.cfg
        if self.median is None:
            self.learning.append(owd_ns)
            if len(self.learning) >= cfg.latency_learn_samples:
                self.median = statistics.median(self.learning)
                self.mad = statistics.median(abs(x - self.median) for x in self.learning)
                self.learning = []
            return False
        z = (owd_ns - self.median) / max(self.mad, cfg.latency_mad_floor_ns)
        z = max(-cfg.latency_clip_mad, min(cfg.latency_clip_mad, z))
        self.recent.append(z)
        self.s = max(0.0, self.s + z - cfg.latency_k_mad)
        if self.s >= cfg.latency_h_mad:
            self.s = 0.0
            self.recent.clear()  # calm() must judge delays after the alarm, not before it
            return True
        return False

    def calm(self) -> bool:
        """The recent delays are back near the baseline (median z ≤ k/2 over a full window)."""
        return (len(self.recent) == self.recent.maxlen
                and statistics.median(self.recent) <= self.cfg.latency_k_mad / 2)


# ---- one path ---------------------------------------------------------------------------------

@dataclass(slots=True)
class _Sent:
    sent_ns: int
    size_probe: bool


@dataclass
class _Undo:
    """What a streak of `miss_threshold` misses did, to take back if it turns out late, not lost."""

    streak: frozenset[int]
    penalty: float  # the flap penalty before it
    penalty_at: int
    state: State  # the state it found the path in
    since_ns: int  # ... and since when


class PathDetector:
    """The state machine of one path. Feed it sends, replies, loss batches and ticks; it returns
    the transitions each input caused (usually none)."""

    def __init__(self, path: Hashable, config: DetectorConfig | None = None) -> None:
        self.path = path
        self.cfg = cfg = config or DetectorConfig()
        self.ticking: dict[Hashable, None] | None = None  # its Detector's: paths that tick() has work for
        self.state = State.UP
        self.since_ns = 0
        # hard failure
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._outstanding: dict[int, _Sent] = {}
        self._deadlines: list[tuple[int, int]] = []  # heap of (deadline, seq)
        self.consecutive_misses = 0
        self._streak: list[int] = []  # seqs of the current miss streak
        self._undo: _Undo | None = None  # what the last streak of misses changed
        self._dark = False
        # gray loss: (fast, slow) per direction
        self._sprt = {d: (Sprt(cfg.gray_p0, cfg.gray_p1_fast, cfg.gray_alpha, cfg.gray_beta),
                          Sprt(cfg.gray_p0, cfg.gray_p1_slow, cfg.gray_alpha, cfg.gray_beta)) for d in Direction}
        self._loss_from_seq = -1  # loss batches starting at or before this are ignored
        self._size_seqs: dict[int, bool] = {}  # full-size probe seq -> answered
        # latency
        self._cusum = {d: Cusum(cfg) for d in Direction}
        # MTU
        self.size_misses = 0
        # DEGRADED bookkeeping: the reasons still active
        self.faults: set[Reason] = set()
        # flapping
        self._penalty = 0.0
        self._penalty_at = 0
        # recovery
        self.good_run = 0
        self._run_at_miss = 0
        self._hold_checked_ns = -1
        self.counters: dict[str, int] = {"sent": 0, "replies": 0, "late_replies": 0, "misses": 0,
                                         "size_misses": 0, "transitions": 0}
        self.last_reason: Reason | None = None

    # ---- derived values ----

    @property
    def rto_ns(self) -> int:
        cfg = self.cfg
        if self.srtt is None:
            return cfg.initial_timeout_ns
        return int(min(cfg.timeout_ceiling_ns, max(cfg.timeout_floor_ns, self.srtt + cfg.rtt_k * self.rttvar)))

    def penalty(self, now_ns: int) -> float:
        """The flap penalty decayed to `now_ns`."""
        dt = max(0, now_ns - self._penalty_at)
        return self._penalty * 2.0 ** (-dt / self.cfg.flap_half_life_ns)

    def _reuse_at_ns(self) -> int:
        if self._penalty <= self.cfg.flap_reuse:
            return self._penalty_at
        return self._penalty_at + math.ceil(self.cfg.flap_half_life_ns * math.log2(self._penalty / self.cfg.flap_reuse))

    def waiting_for(self, now_ns: int) -> list[str]:
        """What still holds a RECOVERING path out of use, in words (empty in any other state):
        for the on-call engineer asking why a repaired link is not carrying traffic yet."""
        if self.state is not State.RECOVERING:
            return []
        cfg, out = self.cfg, []
        left_ms = (self.since_ns + cfg.hold_down_ns - now_ns) / NS_PER_MS
        if left_ms > 0:
            out.append(f"hold-down {left_ms:.0f} ms more")
        if self.good_run < cfg.recovery_good_probes:
            out.append(f"{self.good_run}/{cfg.recovery_good_probes} good probes in a row")
        for d in Direction:
            if self._loss_pending(d):
                slow = self._sprt[d][1]
                out.append(f"{d.short} loss: recent losses still weigh {slow.llr:.1f} (below {slow.inc_lost:.1f} needed)")
            if self._delay_pending(d):
                out.append(f"{d.short} delay above baseline (CUSUM {self._cusum[d].s:.0f}, below "
                           f"{cfg.latency_h_mad / 2:.0f} needed)")
        if self.size_misses:
            out.append(f"{self.size_misses} full-size probe(s) unanswered")
        return out

    def next_deadline_ns(self) -> int | None:
        """When `tick` next has something to do (a probe deadline, reuse, hold-down), or None."""
        while self._deadlines and self._deadlines[0][1] not in self._outstanding:
            heapq.heappop(self._deadlines)  # answered already
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self.state is State.DAMPED:
            times.append(self._reuse_at_ns())
        elif self.state is State.RECOVERING and self.good_run >= self.cfg.recovery_good_probes:
            hold_at = self.since_ns + self.cfg.hold_down_ns
            if hold_at > self._hold_checked_ns:  # once past it, only new evidence can complete it
                times.append(hold_at)
        return min(times) if times else None

    # ---- inputs ----

    def on_sent(self, seq: int, now_ns: int, size_probe: bool = False) -> list[Transition]:
        """A probe left. `size_probe`: a full-MTU probe (MTU black-hole check)."""
        self.counters["sent"] += 1
        self._outstanding[seq] = _Sent(now_ns, size_probe)
        heapq.heappush(self._deadlines, (now_ns + self.rto_ns, seq))
        if self.ticking is not None:
            self.ticking[self.path] = None
        if size_probe:
            self._size_seqs[seq] = False
            if len(self._size_seqs) > 4096:
                del self._size_seqs[next(iter(self._size_seqs))]
        if len(self._outstanding) > self.cfg.max_outstanding:
            # a caller that never ticks: forget the oldest rather than grow without bound
            del self._outstanding[next(iter(self._outstanding))]
        return []

    def on_reply(self, seq: int, now_ns: int, rtt_ns: int, owd_fwd_ns: int | None = None,
                 owd_rev_ns: int | None = None) -> list[Transition]:
        """A reply for `seq` arrived at `now_ns` with round trip `rtt_ns` and (if the clocks are
        synced) clock-corrected one-way delays. Late and unknown replies still prove liveness."""
        out: list[Transition] = []
        self.counters["replies"] += 1
        entry = self._outstanding.pop(seq, None)
        if entry is None:
            self.counters["late_replies"] += 1  # past its deadline (or never sent by us)
        if rtt_ns >= 0:
            self._rtt_sample(rtt_ns)
        size = (entry.size_probe if entry is not None else seq in self._size_seqs)
        if size:
            self._size_seqs[seq] = True
            self.size_misses = 0
            self.faults.discard(Reason.MTU_BLACKHOLE)
        u = self._undo
        if u is not None and seq in u.streak and self.state in (State.DOWN, State.DAMPED, State.RECOVERING):
            out += self._spurious(u, seq, rtt_ns, now_ns)  # Eifel-style: a probe counted lost was only late
        if entry is not None:
            self.good_run += 1
        elif seq in self._streak:
            # answered late: the path delivered, the host (or the queue) was slow; such a probe
            # neither counts nor breaks the run, or a loaded host would never finish a recovery
            self.good_run = self._run_at_miss
        self.consecutive_misses = 0
        self._streak.clear()
        self._dark = False

        if self.state is State.DOWN:
            out += self._fire(Event.REPLY, Reason.REPLY_SEEN, now_ns, f"seq {seq} answered")
            self._loss_from_seq = seq
            self.good_run = 1 if entry is not None else 0
        elif self.state is State.SUSPECT:
            out += self._fire(Event.REPLY, Reason.REPLY_SEEN, now_ns, f"seq {seq} answered")

        if self.state not in DARK:
            for d, owd in ((Direction.FWD, owd_fwd_ns), (Direction.REV, owd_rev_ns)):
                if owd is None:
                    continue
                if self._cusum[d].update(owd):
                    cus = self._cusum[d]
                    out += self._evidence(Event.LATENCY, _LATENCY_REASON[d], now_ns,
                                          f"{d.value} one-way delay {owd} ns vs baseline median "
                                          f"{cus.median:.0f} ns, MAD {cus.mad:.0f} ns")
        out += self._check_clean(now_ns)
        out += self._check_hold(now_ns)
        return out

    # Judging mode: a data path that matches replies to requests itself (the C probe core) reports
    # outcomes instead of sends and replies; the effect on streaks, runs and states is the same.

    def on_miss(self, seq: int, now_ns: int, size_probe: bool = False) -> list[Transition]:
        """Probe `seq` went unanswered past its deadline `now_ns`, judged against this path's
        `rto_ns` (instead of on_sent + tick)."""
        self.counters["sent"] += 1
        return self._miss(seq, _Sent(now_ns - self.rto_ns, size_probe), now_ns)

    def on_answered(self, count: int, seq: int, now_ns: int, rtt_ns: int, owd_fwd_ns: int | None = None,
                    owd_rev_ns: int | None = None, size_probe: bool = False,
                    worst_rtt_ns: int = 0) -> list[Transition]:
        """`count` ≥ 1 probes answered on time, reported at once (instead of on_sent + on_reply
        each); `seq`, `now_ns`, the delays are the newest one's; `size_probe`: one of them was
        full-size; `worst_rtt_ns`: the largest round trip among them (an RTT sample too, so the
        timeout keeps covering the batch's tail)."""
        if count < 1:
            raise ValueError(f"on_answered: count must be ≥ 1, got {count}")
        if worst_rtt_ns > rtt_ns:
            self._rtt_sample(worst_rtt_ns)
        self.counters["sent"] += count
        self.counters["replies"] += count - 1
        self.good_run += count - 1
        self._outstanding[seq] = _Sent(now_ns - rtt_ns, size_probe)  # so on_reply finds it on time
        return self.on_reply(seq, now_ns, rtt_ns, owd_fwd_ns, owd_rev_ns)

    def on_loss(self, first_seq: int, last_seq: int, lost_fwd: int, lost_rev: int,
                now_ns: int) -> list[Transition]:
        """Requests first_seq..last_seq are now accounted for (telemetry's rx_count): `lost_fwd`
        never reached the reflector, `lost_rev` did but their replies were lost.

        Batches that start at or before the reply that ended an outage are ignored (they hold
        the outage itself, which is not gray loss). Full-size probes are taken out: their loss
        is the MTU detector's business (removed from forward first, then reverse).
        """
        if last_seq < first_seq or lost_fwd < 0 or lost_rev < 0:
            raise ValueError(f"on_loss: need first_seq ≤ last_seq and counts ≥ 0, got {first_seq}..{last_seq}, "
                             f"lost_fwd={lost_fwd}, lost_rev={lost_rev}; pass the deltas of LossCounters")
        trials = last_seq - first_seq + 1
        if lost_fwd + lost_rev > trials:
            raise ValueError(f"on_loss: lost_fwd + lost_rev = {lost_fwd + lost_rev} exceeds the {trials} "
                             f"requests in {first_seq}..{last_seq}")
        size_sent = size_lost = 0
        for s in [s for s in self._size_seqs if s <= last_seq]:  # accounted now: forget them
            answered = self._size_seqs.pop(s)
            if s >= first_seq:
                size_sent += 1
                size_lost += not answered
        if self.state in DARK or first_seq <= self._loss_from_seq:
            return []
        drop_fwd = min(size_lost, lost_fwd)
        drop_rev = min(size_lost - drop_fwd, lost_rev)
        fwd_trials = trials - size_sent
        fwd_lost = lost_fwd - drop_fwd
        rev_trials = fwd_trials - fwd_lost
        rev_lost = lost_rev - drop_rev
        out: list[Transition] = []
        for d, n, x in ((Direction.FWD, fwd_trials, fwd_lost), (Direction.REV, rev_trials, rev_lost)):
            if n <= 0:
                continue
            fast, slow = self._sprt[d]
            verdicts = (fast.update(n, x), slow.update(n, x))
            if True in verdicts:
                which = "fast" if verdicts[0] else "sensitive"
                out += self._evidence(Event.GRAY, _GRAY_REASON[d], now_ns,
                                      f"{d.short} loss SPRT ({which}) accepted degraded; batch {x}/{n} lost")
            elif verdicts[1] is False and self.state is State.DEGRADED:
                self.faults.discard(_GRAY_REASON[d])
            if self.state is State.DEGRADED and _GRAY_REASON[d] in self.faults:
                # already judged degraded: only the way back matters, so do not let the sum climb
                # (from +13 it would take 4.6 s of clean probes to reach B instead of 1.2 s)
                fast.llr, slow.llr = min(fast.llr, 0.0), min(slow.llr, 0.0)
        out += self._check_clean(now_ns)
        out += self._check_hold(now_ns)
        return out

    def tick(self, now_ns: int) -> list[Transition]:
        """Process everything due at or before `now_ns`: probe deadlines, reuse, hold-down."""
        out: list[Transition] = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            _, seq = heapq.heappop(self._deadlines)
            entry = self._outstanding.pop(seq, None)
            if entry is not None:
                out += self._miss(seq, entry, now_ns)
        if self.state is State.DAMPED and now_ns >= self._reuse_at_ns():
            self._penalty = self.penalty(now_ns)
            self._penalty_at = now_ns
            event = Event.REUSE_DARK if self._dark else Event.REUSE_LIVE
            out += self._fire(event, Reason.REUSED, now_ns, f"penalty decayed to {self._penalty:.0f}")
        out += self._check_hold(now_ns)
        return out

    # ---- internal evidence handling ----

    def _rtt_sample(self, rtt: int) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = float(rtt), rtt / 2
        else:
            self.rttvar += (abs(self.srtt - rtt) - self.rttvar) / 4
            self.srtt += (rtt - self.srtt) / 8

    def _miss(self, seq: int, entry: _Sent, now_ns: int) -> list[Transition]:
        if self.consecutive_misses == 0 and not entry.size_probe:
            self._run_at_miss = self.good_run  # restored if this streak's probes are answered late
        self.good_run = 0
        if entry.size_probe:
            self.counters["size_misses"] += 1
            # only meaningful while small probes get through
            if self.consecutive_misses == 0 and self.state not in DARK:
                self.size_misses += 1
                if self.size_misses >= self.cfg.mtu_misses:
                    self.size_misses = 0
                    return self._evidence(Event.MTU, Reason.MTU_BLACKHOLE, now_ns,
                                          f"{self.cfg.mtu_misses} full-size probes lost while small ones answer")
            return []
        self.counters["misses"] += 1
        self.consecutive_misses += 1
        self._streak = (self._streak + [seq])[-self.cfg.miss_threshold:]
        n = self.consecutive_misses
        out: list[Transition] = []
        if n == 1 and n < self.cfg.miss_threshold:
            out += self._fire(Event.MISS, Reason.MISSED_PROBE, now_ns, f"seq {seq} unanswered after {self.rto_ns} ns")
        if n == self.cfg.miss_threshold:
            detail = f"{n} consecutive probes unanswered (last seq {seq}, rto {self.rto_ns} ns)"
            self._undo = _Undo(frozenset(self._streak), self._penalty, self._penalty_at, self.state, self.since_ns)
            if self.state is State.DAMPED:
                if not self._dark:
                    self._add_penalty(now_ns)  # it failed again while damped: stays out longer
            else:
                out += self._fire(Event.MISSES, Reason.HARD_FAILURE, now_ns, detail)
                if self.state is State.DOWN and self.penalty(now_ns) >= self.cfg.flap_suppress:
                    out += self._fire(Event.SUPPRESS, Reason.FLAPPING, now_ns,
                                      f"flap penalty {self.penalty(now_ns):.0f} ≥ {self.cfg.flap_suppress:.0f}")
            self._dark = True
        return out

    def _spurious(self, u: "_Undo", seq: int, rtt_ns: int, now_ns: int) -> list[Transition]:
        """A probe of the streak `u` was answered after all: take back what the streak did."""
        detail = f"seq {seq}, counted missed, answered after {rtt_ns} ns: late, not lost"
        if u.state in (State.UP, State.SUSPECT):
            return self._fire(Event.LATE, Reason.SPURIOUS_DOWN, now_ns, detail)
        out: list[Transition] = []
        if u.state in (State.RECOVERING, State.DEGRADED) and self.state is not State.RECOVERING:
            out = self._fire(Event.LATE_WATCH, Reason.SPURIOUS_DOWN, now_ns, detail)
        else:  # found DAMPED (the penalty was all it added), or already RECOVERING by an older reply
            self._take_back()
        if u.state is State.RECOVERING and self.state is State.RECOVERING:
            self.since_ns = u.since_ns  # the hold-down runs on from where the streak found it
        return out

    def _evidence(self, event: Event, reason: Reason, now_ns: int, detail: str) -> list[Transition]:
        """Gray evidence: degrade the path, or add the reason to an already degraded one."""
        if self.state is State.DEGRADED:
            self.faults.add(reason)
            return []
        return self._fire(event, reason, now_ns, detail)

    def _check_clean(self, now_ns: int) -> list[Transition]:
        if self.state is not State.DEGRADED:
            return []
        for d in Direction:
            if _LATENCY_REASON[d] in self.faults and self._cusum[d].calm():
                self.faults.discard(_LATENCY_REASON[d])
        if self.faults:
            return []
        return self._fire(Event.CLEAN, Reason.EVIDENCE_CLEARED, now_ns, "loss, delay and MTU back to baseline")

    def _loss_pending(self, d: Direction) -> bool:
        """The sensitive SPRT holds at least one lost probe's worth of evidence."""
        slow = self._sprt[d][1]
        return slow.llr >= slow.inc_lost

    def _delay_pending(self, d: Direction) -> bool:
        return self._cusum[d].s >= self.cfg.latency_h_mad / 2

    def _quiet(self) -> bool:
        """No gray evidence pending (what `waiting_for` words): no loss or delay evidence in either
        direction, no MTU misses."""
        return (not any(self._loss_pending(d) or self._delay_pending(d) for d in Direction)
                and self.size_misses == 0)

    def _check_hold(self, now_ns: int) -> list[Transition]:
        self._hold_checked_ns = max(self._hold_checked_ns, now_ns)
        if (self.state is State.RECOVERING and now_ns - self.since_ns >= self.cfg.hold_down_ns
                and self.good_run >= self.cfg.recovery_good_probes and self._quiet()):
            held_ms = (now_ns - self.since_ns) / NS_PER_MS
            return self._fire(Event.HOLD_OK, Reason.RECOVERED, now_ns,
                              f"{self.good_run} good probes over {held_ms:.0f} ms hold-down")
        return []

    def _add_penalty(self, now_ns: int) -> None:
        self._penalty = min(self.cfg.flap_max_penalty, self.penalty(now_ns) + self.cfg.flap_penalty)
        self._penalty_at = now_ns

    # ---- the state machine ----

    def _fire(self, event: Event, reason: Reason, now_ns: int, detail: str = "") -> list[Transition]:
        """Apply `event` if the table allows it in the current state; otherwise ignore it."""
        entry = TRANSITIONS.get((self.state, event))
        if entry is None:
            return []
        new, fn = entry
        old = self.state
        getattr(self, fn)(reason, now_ns)
        self.state = new
        if new in _TICKED_STATES and self.ticking is not None:
            self.ticking[self.path] = None
        self.since_ns = now_ns
        self.last_reason = reason
        self.counters["transitions"] += 1
        return [Transition(self.path, old, new, event, reason, now_ns, detail)]

    # One function per transition kind; each owns its side effects. They run before the state
    # changes, so `self.state` is still the old state inside them.

    def _t_suspect(self, reason: Reason, now_ns: int) -> None:
        """UP -> SUSPECT: nothing to undo; traffic stays while the streak is short."""

    def _t_unsuspect(self, reason: Reason, now_ns: int) -> None:
        """SUSPECT -> UP: the miss was a lone loss."""

    def _t_down(self, reason: Reason, now_ns: int) -> None:
        """-> DOWN: count a flap; forget gray evidence (an outage is not a loss rate). What to undo
        should the streak turn out late rather than lost is in `_undo` (set by `_miss`)."""
        self._add_penalty(now_ns)
        # the delay sums stay: an outage brings no delay samples, and a DOWN that turns out
        # spurious (a queue making replies late) must not wipe the latency evidence building up
        self._reset_evidence(keep_latency=True)

    def _t_degrade(self, reason: Reason, now_ns: int) -> None:
        """-> DEGRADED: remember why; each reason clears on its own. A DOWN before it is no longer
        undone: the path has shown more than lateness since."""
        self.faults = {reason}
        self._undo = None

    def _t_watch(self, reason: Reason, now_ns: int) -> None:
        """DOWN | DEGRADED -> RECOVERING: the hold-down and the good-probe count start now."""
        self.good_run = 0
        self.faults.clear()

    def _t_recovered(self, reason: Reason, now_ns: int) -> None:
        """RECOVERING -> UP: the DOWN before it, spurious or not, is history."""
        self.faults.clear()
        self._undo = None

    def _t_undo(self, reason: Reason, now_ns: int) -> None:
        """DOWN | DAMPED | RECOVERING -> where the streak found the path: the DOWN was spurious and
        costs no flap penalty (UP needs no hold-down; RECOVERING's runs on, see `_spurious`, and
        so does the run of good probes: `on_reply` restores it, the late probes not counted)."""
        self._take_back()

    def _take_back(self) -> None:
        """The flap penalty as it was before the streak in `_undo`, which is then spent."""
        if self._undo is not None:
            self._penalty, self._penalty_at = self._undo.penalty, self._undo.penalty_at
        self._undo = None

    def _t_damp(self, reason: Reason, now_ns: int) -> None:
        """DOWN -> DAMPED: out until the penalty decays, whatever the path does meanwhile (unless
        the DOWN that damped it turns out spurious)."""

    def _t_reuse(self, reason: Reason, now_ns: int) -> None:
        """DAMPED -> RECOVERING (answering) | DOWN (dark): the penalty no longer holds it."""
        self.good_run = 0
        self._undo = None
        self._reset_evidence()

    def _reset_evidence(self, keep_latency: bool = False) -> None:
        for fast, slow in self._sprt.values():
            fast.reset()
            slow.reset()
        for c in ([] if keep_latency else self._cusum.values()):
            c.s = 0.0
            c.recent.clear()
        self.size_misses = 0
        self.faults.clear()


_TICKED_STATES = (State.DAMPED, State.RECOVERING)


# ---- many paths -------------------------------------------------------------------------------

class Detector:
    """All paths of one agent, keyed by any hashable id (e.g. (peer, plane, path))."""

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self.paths: dict[Hashable, PathDetector] = {}
        # the paths with deadlines or in a ticked state (an ordered set): the agent ticks on every
        # wake-up, up to 500 a second, and walking every path each time was a fixed cost per path
        self._ticking: dict[Hashable, None] = {}

    def add_path(self, path: Hashable) -> PathDetector:
        if path not in self.paths:
            self.paths[path] = p = PathDetector(path, self.config)
            p.ticking = self._ticking
        return self.paths[path]

    def remove_path(self, path: Hashable) -> None:
        self.paths.pop(path, None)
        self._ticking.pop(path, None)

    def __getitem__(self, path: Hashable) -> PathDetector:
        try:
            return self.paths[path]
        except KeyError:
            raise KeyError(f"path {path!r} is not tracked; call add_path first") from None

    def __iter__(self) -> Iterator[PathDetector]:
        return iter(self.paths.values())

    def on_sent(self, path: Hashable, seq: int, now_ns: int, size_probe: bool = False) -> list[Transition]:
        return self[path].on_sent(seq, now_ns, size_probe)

    def on_reply(self, path: Hashable, seq: int, now_ns: int, rtt_ns: int, owd_fwd_ns: int | None = None,
                 owd_rev_ns: int | None = None) -> list[Transition]:
        return self[path].on_reply(seq, now_ns, rtt_ns, owd_fwd_ns, owd_rev_ns)

    def on_loss(self, path: Hashable, first_seq: int, last_seq: int, lost_fwd: int, lost_rev: int,
                now_ns: int) -> list[Transition]:
        return self[path].on_loss(first_seq, last_seq, lost_fwd, lost_rev, now_ns)

    def on_miss(self, path: Hashable, seq: int, now_ns: int, size_probe: bool = False) -> list[Transition]:
        return self[path].on_miss(seq, now_ns, size_probe)

    def on_answered(self, path: Hashable, count: int, seq: int, now_ns: int, rtt_ns: int,
                    owd_fwd_ns: int | None = None, owd_rev_ns: int | None = None,
                    size_probe: bool = False, worst_rtt_ns: int = 0) -> list[Transition]:
        return self[path].on_answered(count, seq, now_ns, rtt_ns, owd_fwd_ns, owd_rev_ns, size_probe, worst_rtt_ns)

    def tick(self, now_ns: int) -> list[Transition]:
        out: list[Transition] = []
        # only deadlines (non-judging callers), reuse and hold-down are due in tick
        for key in list(self._ticking):
            p = self.paths.get(key)
            if p is None or not (p._deadlines or p.state in _TICKED_STATES):
                del self._ticking[key]  # nothing due any more: back when it sends or enters such a state
                continue
            out += p.tick(now_ns)
        return out

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline over all paths (O(paths); fine for hundreds of paths)."""
        ds = [d for d in (p.next_deadline_ns() for p in self.paths.values()) if d is not None]
        return min(ds) if ds else None

    def states(self) -> dict[Hashable, State]:
        return {k: p.state for k, p in self.paths.items()}

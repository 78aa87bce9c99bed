"""Clock synchronisation between hosts from probe timestamps, in the style of Huygens (NSDI 2018).

Pure: standard library only, no sockets, no clock reads, no randomness inside the estimators.
Timestamps come in as `Exchange`s; estimates come out as numbers. `SyntheticClock` is the one
exception that owns a random generator: it is a simulation aid for tests and the simulator, not
part of the estimation path.

Conventions (all integer nanoseconds unless a name says otherwise):

    t1  sender TX     (sender's clock)        t2  reflector RX  (reflector's clock)
    t3  reflector TX  (reflector's clock)     t4  sender RX     (sender's clock)

    theta(t) = reflector clock - sender clock, as a function of the sender's clock reading t
    drift    = d theta / dt, in ppm: positive means the reflector's clock runs faster

Why this works: t2 - t1 = d_fwd + theta and t4 - t3 = d_rev - theta, where the one-way delays
d are a fixed propagation time plus queueing, which only ever adds. The lower envelopes of both
series over a short window are therefore lines Lf(t) = dmin_fwd + theta(t) and
Lr(t) = dmin_rev - theta(t); if the minimum delays are equal in both directions (the one
assumption every two-way method makes), theta(t) = (Lf(t) - Lr(t)) / 2 and the drift is the
slope. The NTP midpoint ((t2 - t1) - (t4 - t3)) / 2 makes the same assumption per exchange and
so absorbs half of every queueing difference; the envelope ignores queueing altogether as long
as some probes in each window see empty queues.

Pipeline:  probe pairs -> PurePairFilter -> PairEstimator (per ordered pair of hosts)
           -> MeshCorrector (all pairs: loops must sum to zero) -> one_way_delays.
"""
from __future__ import annotations

import enum
import math
import random
import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

NS_PER_S = 1_000_000_000

# A pair is pure when both of its spacings survive within this tolerance. 2 us: kernel software
# timestamps (SO_TIMESTAMPING *_SOFTWARE, what this project has without NIC hardware stamps)
# scatter by up to about a microsecond between the stack and the stamp point, so a tighter bound
# would reject undisturbed pairs and starve the windows. Disturbed pairs that slip through do no
# harm to the envelope: queueing only raises a point above it. What the filter must catch are
# timestamp glitches (a late TX stamp makes a delay look *shorter*, the one error the lower
# envelope cannot ignore), and those change the spacing by the size of the glitch. With NIC
# hardware timestamps, lower it to ~200 ns.
DEFAULT_PURITY_TOLERANCE_NS = 2_000
# Back-to-back means back to back: beyond 1 ms apart, two probes no longer see the same queue.
DEFAULT_MAX_PAIR_SPACING_NS = 1_000_000

MAX_SYNTHETIC_OFFSET_NS = 50_000_000  # +-50 ms: a host that booted without NTP, at worst
MAX_SYNTHETIC_DRIFT_PPM = 100.0  # +-100 ppm: the tolerance of a cheap crystal oscillator
MAX_SYNTHETIC_SEGMENTS = 10_000_000  # ~12 simulated days at 100 ms steps, ~1 GB of segments


class ClockNotReadyError(RuntimeError):
    """An estimate was asked for before any window was fitted (feed more exchanges first)."""


# ---- argument checks (errors name the parameter and the fix) ----------------------------------

def _check_int(value: object, name: str, lo: int | None = None, hi: int | None = None, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r} ({type(value).__name__}){hint}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"{'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"
        raise ValueError(f"{name}: {value} is out of range; allowed {bounds}{hint}")
    return value


def _check_float(value: object, name: str, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}{hint}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        low = "-inf" if lo is None else (f">{lo}" if lo_open else f"{lo}")
        raise ValueError(f"{name}: {value} is out of range; allowed {low}..{'inf' if hi is None else hi}{hint}")
    return float(value)


# ---- one exchange -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Exchange:
    """One probe and its reflection: four timestamps in integer nanoseconds.

    t1, t4 are on the sender's clock, t2, t3 on the reflector's, so only same-clock differences
    (t4 - t1, t3 - t2) mean anything before the offset is known. Integers, because epoch
    nanoseconds (~1.7e18) do not fit a float's 53 bits; every difference is taken in integers.
    """

    t1: int
    t2: int
    t3: int
    t4: int

    def __post_init__(self) -> None:
        for name in ("t1", "t2", "t3", "t4"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Exchange.{name}: expected integer nanoseconds, got {value!r} "
                                 f"({type(value).__name__}); convert at the timestamp source")
        if self.t3 < self.t2:
            raise ValueError(f"Exchange.t3: reflector TX {self.t3} is before its RX t2={self.t2}; "
                             "the reflector's stamps are swapped or from different clocks")
        if self.t4 < self.t1:
            raise ValueError(f"Exchange.t4: sender RX {self.t4} is before its TX t1={self.t1}; "
                             "the sender's stamps are swapped or from different clocks")

    @property
    def forward_ns(self) -> int:
        """t2 - t1: forward one-way delay plus theta."""
        return self.t2 - self.t1

    @property
    def reverse_ns(self) -> int:
        """t4 - t3: reverse one-way delay minus theta."""
        return self.t4 - self.t3

    @property
    def rtt_ns(self) -> int:
        """Round trip without the reflector's residence time."""
        return (self.t4 - self.t1) - (self.t3 - self.t2)


def ntp_midpoint_offset(exchange: Exchange) -> float:
    """The NTP estimate of theta from one exchange: ((t2 - t1) - (t4 - t3)) / 2.

    Exact only when both directions queued equally; otherwise off by half the difference.
    """
    return (exchange.forward_ns - exchange.reverse_ns) / 2


# ---- coded probe pairs ------------------------------------------------------------------------

class PairVerdict(enum.Enum):
    PURE = "pure"
    FORWARD_DISTURBED = "forward_disturbed"  # spacing changed on the way to the reflector
    REVERSE_DISTURBED = "reverse_disturbed"  # spacing changed on the way back
    MALFORMED = "malformed"  # not a back-to-back pair in TX order


def classify_pair(first: Exchange, second: Exchange, tolerance_ns: int = DEFAULT_PURITY_TOLERANCE_NS,
                  max_spacing_ns: int = DEFAULT_MAX_PAIR_SPACING_NS) -> PairVerdict:
    """Judge two probes sent back to back (Huygens' coded probes).

    Two probes sent s apart arrive s apart unless something (a queue, a timestamp glitch) hit one
    and not the other. The spacing is compared on the same clock at each end, so the unknown
    offset cancels; drift changes it by only drift x s (0.1 ns at 100 ppm and 1 us).
    """
    spacing_tx = second.t1 - first.t1
    if spacing_tx <= 0 or spacing_tx > max_spacing_ns:
        return PairVerdict.MALFORMED
    if abs((second.t2 - first.t2) - spacing_tx) > tolerance_ns:
        return PairVerdict.FORWARD_DISTURBED
    if abs((second.t4 - first.t4) - (second.t3 - first.t3)) > tolerance_ns:
        return PairVerdict.REVERSE_DISTURBED
    return PairVerdict.PURE


class PurePairFilter:
    """Passes the exchanges of pure probe pairs and counts what it rejects, by reason.

    Both exchanges of a pure pair are kept: neither was disturbed relative to the other. A pair
    whose probes were delayed by the same queue passes, elevated; the envelope fit ignores it.
    """

    def __init__(self, tolerance_ns: int = DEFAULT_PURITY_TOLERANCE_NS,
                 max_spacing_ns: int = DEFAULT_MAX_PAIR_SPACING_NS) -> None:
        self.tolerance_ns = _check_int(tolerance_ns, "tolerance_ns", 0, None,
                                       "; use e.g. 2000 with software timestamps, 200 with NIC hardware stamps")
        self.max_spacing_ns = _check_int(max_spacing_ns, "max_spacing_ns", 1, None,
                                         "; use the largest TX spacing the prober uses, e.g. 1_000_000")
        self.pairs_seen = 0
        self.pairs_pure = 0
        self.rejected_forward = 0
        self.rejected_reverse = 0
        self.rejected_malformed = 0

    @property
    def rejected(self) -> int:
        return self.rejected_forward + self.rejected_reverse + self.rejected_malformed

    def accept(self, first: Exchange, second: Exchange) -> tuple[Exchange, ...]:
        """(first, second) if the pair is pure, else () with the reason counted."""
        verdict = classify_pair(first, second, self.tolerance_ns, self.max_spacing_ns)
        self.pairs_seen += 1
        if verdict is PairVerdict.PURE:
            self.pairs_pure += 1
            return (first, second)
        if verdict is PairVerdict.FORWARD_DISTURBED:
            self.rejected_forward += 1
        elif verdict is PairVerdict.REVERSE_DISTURBED:
            self.rejected_reverse += 1
        else:
            self.rejected_malformed += 1
        return ()

    def filter(self, pairs: Iterable[tuple[Exchange, Exchange]]) -> Iterator[Exchange]:
        for first, second in pairs:
            yield from self.accept(first, second)


# ---- lower envelope -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Line:
    """y = y0 + slope * (x - x0); anchored where it was fitted so evaluation stays precise."""

    x0: float
    y0: float
    slope: float

    def at(self, x: float) -> float:
        return self.y0 + self.slope * (x - self.x0)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def lower_support_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """The line below all points that is closest to them: min sum(y_i - L(x_i)) s.t. y_i >= L(x_i).

    Why this fit: queueing only adds delay, so the points that carry the offset are the lowest
    ones, and the rest (most of them) must not pull the line up. The linear program above has a
    closed form: its objective is n * (mean(y) - L(mean(x))), so the optimum is the supporting
    line of the lower convex hull at mean(x), i.e. the hull edge spanning mean(x). Cost O(n log n)
    for the sort, no tuning, exact. Huygens fits the two envelopes jointly with an SVM (a
    quadratic program, and soft margins for noisy stamps); the pure-pair filter takes over the
    job of removing below-envelope glitches here. Needs two distinct x values.
    """
    if len(xs) != len(ys):
        raise ValueError(f"ys: {len(ys)} values for {len(xs)} xs; give one y per x")
    hull: list[tuple[float, float]] = []
    for p in sorted(zip(xs, ys)):
        if hull and p[0] == hull[-1][0]:
            continue  # same x, higher y (sorted): never on the lower hull
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    if len(hull) < 2:
        raise ValueError("xs: a line needs points at two distinct x values at least")
    x_mean = math.fsum(xs) / len(xs)
    for k in range(len(hull) - 1):
        (xa, ya), (xb, yb) = hull[k], hull[k + 1]
        if xa <= x_mean <= xb:
            slope = (yb - ya) / (xb - xa)
            if x_mean == xb and k + 2 < len(hull):
                # mean on a vertex: every slope between its two edges is optimal; take the middle
                xc, yc = hull[k + 2]
                return Line(xb, yb, (slope + (yc - yb) / (xc - xb)) / 2)
            return Line(x_mean, ya + slope * (x_mean - xa), slope)
    # unreachable: mean(x) lies within [min x, max x], which the hull spans
    raise AssertionError("mean of xs outside the hull")


def _ols_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


# ---- per-window fits and their history -----------------------------------------------------

@dataclass(frozen=True, slots=True)
class WindowFit:
    """What one window of pure exchanges says, evaluated at the window's data centre."""

    start_ns: int  # window start, sender clock
    center_ns: int  # where offset_ns applies, sender clock
    offset_ns: float  # envelope theta at center_ns
    drift_ppm: float  # slope of the envelopes within this window alone
    min_delay_ns: float  # symmetric minimum one-way delay, (Lf + Lr) / 2
    ntp_offset_ns: float | None  # median NTP midpoint of the same exchanges (None: not compared)
    exchanges: int


class _LineTracker:
    """The last few per-window values of one estimate and the least-squares line through them.

    Why a line over several windows: drift from one 1-s window is only as good as the envelope
    noise divided by 1 s; a line over N windows divides it by about N seconds. Older windows drop
    out, so slow wander of the oscillators is followed. A window far off the line is a clock
    step (e.g. the peer's NTP daemon stepped its clock): the history restarts from it.
    """

    def __init__(self, history: int, step_threshold_ns: float, converge: int) -> None:
        self._points: deque[tuple[int, float]] = deque(maxlen=history)
        self._step_threshold_ns = step_threshold_ns
        self._converge = converge
        self.ref_ns: int | None = None
        self.value_at_ref = 0.0
        self.slope = 0.0  # ns per ns
        self.residual_rms_ns = 0.0
        self.steps = 0

    def __len__(self) -> int:
        return len(self._points)

    def predict(self, t_ns: int) -> float:
        if self.ref_ns is None:
            raise ClockNotReadyError("no window fitted yet: feed at least one full window of pure exchanges")
        return self.value_at_ref + self.slope * (t_ns - self.ref_ns)  # int difference: exact

    def add(self, center_ns: int, value: float, window_slope: float) -> bool:
        stepped = False
        if self.ref_ns is not None and abs(value - self.predict(center_ns)) > self._step_threshold_ns:
            # Count only steps away from a converged line: the window that straddles a step is
            # itself half-stepped, so the one after it restarts the history a second time.
            if len(self._points) >= self._converge:
                self.steps += 1
            self._points.clear()
            stepped = True
        self._points.append((center_ns, value))
        self.ref_ns = center_ns
        if len(self._points) == 1:
            self.value_at_ref, self.slope, self.residual_rms_ns = value, window_slope, 0.0
            return stepped
        us = [float(c - center_ns) for c, _ in self._points]  # small, exact offsets from the newest
        vs = [v for _, v in self._points]
        self.slope = _ols_slope(us, vs)
        mean_u, mean_v = math.fsum(us) / len(us), math.fsum(vs) / len(vs)
        self.value_at_ref = mean_v - self.slope * mean_u
        self.residual_rms_ns = math.sqrt(
            math.fsum((v - self.value_at_ref - self.slope * u) ** 2 for u, v in zip(us, vs)) / len(us))
        return stepped


class PairEstimator:
    """Offset and drift of one reflector's clock relative to one sender's, from pure exchanges.

    Exchanges are grouped into fixed windows of the sender's clock (by t1). When an exchange
    opens a new window, the previous one is fitted: lower support lines of the forward series
    (t1, t2 - t1) and the reverse series (t4, t4 - t3) give theta and the in-window drift, and
    a line through the last `history_windows` window estimates gives the offset and the drift
    over the long baseline (`offset_at`, `drift_ppm`). The reverse series is placed at t4 and the
    forward at t1: theta is sampled at T2 = t1 + d_fwd and T3 = t4 - d_rev, so with equal minimum
    delays the two placement errors cancel exactly.

    The NTP midpoint estimate of the same exchanges (median per window, same line over windows)
    runs alongside as `ntp_offset_at` / `ntp_drift_ppm`, for comparison; `compare_ntp=False` (the
    agent) leaves it out (measured: ~13 % less CPU per exchange added).

    history_windows=8: a longer line averages envelope noise, a shorter one follows oscillator
    wander sooner. In simulation (wander 0.01 ppm/sqrt(s), stamps late by up to 1 us) 5 to 10
    windows did equally well, 16 worse on both offset and drift.
    """

    def __init__(self, *, window_ns: int = NS_PER_S, history_windows: int = 8, min_points_per_window: int = 8,
                 converge_windows: int = 3, step_threshold_ns: int = 100_000, compare_ntp: bool = True) -> None:
        self.window_ns = _check_int(window_ns, "window_ns", 1_000_000, None,
                                    "; use e.g. 1_000_000_000 (1 s of sender time)")
        self.history_windows = _check_int(history_windows, "history_windows", 2, 10_000,
                                          "; use e.g. 10 (drift over a 10-window baseline)")
        self.min_points_per_window = _check_int(min_points_per_window, "min_points_per_window", 2, None,
                                                "; a window needs at least 2 exchanges to fit a line")
        self.converge_windows = _check_int(converge_windows, "converge_windows", 1, self.history_windows,
                                           " (at most history_windows)")
        self.step_threshold_ns = _check_int(step_threshold_ns, "step_threshold_ns", 1, None,
                                            "; use e.g. 100_000 (far above envelope noise)")
        self._huygens = _LineTracker(self.history_windows, self.step_threshold_ns, self.converge_windows)
        self._ntp = (_LineTracker(self.history_windows, self.step_threshold_ns, self.converge_windows)
                     if compare_ntp else None)
        self._window_start: int | None = None
        self._buffer: list[Exchange] = []
        self.last_fit: WindowFit | None = None
        self.exchanges = 0  # accepted into a window
        self.late_exchanges = 0  # t1 before the open window: dropped
        self.sparse_windows = 0  # closed with too few exchanges to fit: skipped
        self.window_count = 0  # windows fitted

    # -- input --------------------------------------------------------------------------------
    def add(self, exchange: Exchange) -> WindowFit | None:
        """Take one pure exchange; returns the fit of the window it closed, if it closed one."""
        t1 = exchange.t1
        if self._window_start is None:
            self._window_start = t1
        elif t1 < self._window_start:
            self.late_exchanges += 1
            return None
        fit = None
        if t1 >= self._window_start + self.window_ns:
            fit = self._close_window()
            self._window_start += (t1 - self._window_start) // self.window_ns * self.window_ns
        self._buffer.append(exchange)
        self.exchanges += 1
        return fit

    def flush(self) -> WindowFit | None:
        """Fit the open window now (e.g. at the end of a run).

        Later exchanges start the next window; any still stamped inside the flushed one count as late.
        """
        if self._window_start is None or not self._buffer:
            return None
        fit = self._close_window()
        self._window_start += self.window_ns
        return fit

    def _close_window(self) -> WindowFit | None:
        exchanges, self._buffer = self._buffer, []
        assert self._window_start is not None
        start = self._window_start
        if len(exchanges) < self.min_points_per_window:
            self.sparse_windows += 1
            return None
        # Integer baselines first, floats after: epoch-sized values would lose nanoseconds.
        fwd_base, rev_base = exchanges[0].forward_ns, exchanges[0].reverse_ns
        try:
            fwd = lower_support_line([float(e.t1 - start) for e in exchanges],
                                     [float(e.forward_ns - fwd_base) for e in exchanges])
            rev = lower_support_line([float(e.t4 - start) for e in exchanges],
                                     [float(e.reverse_ns - rev_base) for e in exchanges])
        except ValueError:
            self.sparse_windows += 1  # all at one instant: no slope to fit
            return None
        center_rel = round((fwd.x0 + rev.x0) / 2)
        lf, lr = fwd.at(center_rel), rev.at(center_rel)
        offset = ((fwd_base - rev_base) + (lf - lr)) / 2
        slope = (fwd.slope - rev.slope) / 2
        center = start + center_rel
        ntp_offset = None
        if self._ntp is not None:
            midpoints = [e.forward_ns - e.reverse_ns for e in exchanges]  # 2 x midpoint, exact ints
            ntp_offset = statistics.median(midpoints) / 2
            self._ntp.add(center, ntp_offset,
                          _ols_slope([float(e.t1 - start) for e in exchanges], [m / 2 for m in midpoints]))
        fit = WindowFit(start_ns=start, center_ns=center, offset_ns=offset, drift_ppm=slope * 1e6,
                        min_delay_ns=((fwd_base + rev_base) + (lf + lr)) / 2, ntp_offset_ns=ntp_offset,
                        exchanges=len(exchanges))
        self._huygens.add(center, offset, slope)
        self.last_fit = fit
        self.window_count += 1
        return fit

    # -- output -------------------------------------------------------------------------------
    def offset_at(self, t_sender_ns: int) -> float:
        """theta = reflector clock - sender clock at sender reading `t_sender_ns`, in ns."""
        return self._huygens.predict(t_sender_ns)

    @property
    def drift_ppm(self) -> float:
        """How much faster the reflector's clock runs than the sender's, in ppm."""
        return self._huygens.slope * 1e6

    @property
    def converged(self) -> bool:
        """At least `converge_windows` consistent windows since the start or the last clock step."""
        return len(self._huygens) >= self.converge_windows

    @property
    def steps_detected(self) -> int:
        """Clock steps seen after convergence (each restarts the history and clears `converged`)."""
        return self._huygens.steps

    @property
    def residual_rms_ns(self) -> float:
        """Scatter of the window offsets around the line: a quality figure (e.g. for mesh weights)."""
        return self._huygens.residual_rms_ns

    def ntp_offset_at(self, t_sender_ns: int) -> float:
        """The NTP-midpoint estimate of theta from the same exchanges (for comparison)."""
        return self._compared().predict(t_sender_ns)

    @property
    def ntp_drift_ppm(self) -> float:
        return self._compared().slope * 1e6

    def _compared(self) -> _LineTracker:
        if self._ntp is None:
            raise RuntimeError("this estimator was made with compare_ntp=False: it keeps no NTP-midpoint estimate")
        return self._ntp


class OffsetSource(Protocol):
    def offset_at(self, t_sender_ns: int) -> float: ...


def one_way_delays(exchange: Exchange, estimator: OffsetSource) -> tuple[float, float]:
    """(forward, reverse) one-way delay of one exchange in ns, using the estimated offset.

    theta is taken where each direction's fit placed it (t1 forward, t4 reverse), so an exchange
    on the envelope gets back exactly the minimum delay.
    """
    return (exchange.forward_ns - estimator.offset_at(exchange.t1),
            exchange.reverse_ns + estimator.offset_at(exchange.t4))


# ---- mesh: loops must sum to zero ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CorrectedPair:
    sender: Hashable
    reflector: Hashable
    measured_offset_ns: float
    offset_ns: float  # x_reflector - x_sender after the solve
    measured_drift_ppm: float
    drift_ppm: float

    @property
    def residual_ns(self) -> float:
        """measured - corrected: a large one points at an asymmetric path or a bad estimate."""
        return self.measured_offset_ns - self.offset_ns


@dataclass(frozen=True)
class MeshSolution:
    node_offset_ns: dict[Hashable, float]  # node clock - its component reference's clock
    node_drift_ppm: dict[Hashable, float]  # how much faster than its component reference, ppm
    reference_of: dict[Hashable, Hashable]
    pairs: list[CorrectedPair]  # one per measurement, in the order added

    def _same_component(self, sender: Hashable, reflector: Hashable) -> None:
        for name, node in (("sender", sender), ("reflector", reflector)):
            if node not in self.reference_of:
                raise ValueError(f"{name}: node {node!r} has no measurements in this mesh")
        if self.reference_of[sender] != self.reference_of[reflector]:
            raise ValueError(f"reflector: {reflector!r} is not connected to {sender!r} by any chain of "
                             "measured pairs; measure a pair that links the two groups")

    def offset(self, sender: Hashable, reflector: Hashable) -> float:
        """Loop-consistent theta of `reflector` relative to `sender`, in ns."""
        self._same_component(sender, reflector)
        return self.node_offset_ns[reflector] - self.node_offset_ns[sender]

    def drift(self, sender: Hashable, reflector: Hashable) -> float:
        """Loop-consistent drift of `reflector` relative to `sender`, in ppm."""
        self._same_component(sender, reflector)
        return _ppm_from_log(_log_rate(self.node_drift_ppm[reflector]) - _log_rate(self.node_drift_ppm[sender]))


def _log_rate(drift_ppm: float) -> float:
    # Rates compose by multiplication ((1+a)(1+b) = 1+c); their logs add, so loops close exactly.
    return math.log1p(drift_ppm * 1e-6)


def _ppm_from_log(log_rate: float) -> float:
    return math.expm1(log_rate) * 1e6


def _solve_linear(matrix: list[list[float]], rhs: list[list[float]]) -> list[list[float]]:
    """Solve matrix @ x = b for each b in rhs, by Gaussian elimination with partial pivoting.

    Dense O(n^3): 100 nodes is ~3e5 multiply-adds, a fraction of a second in pure Python. The
    matrix here is a reduced graph Laplacian of a connected graph, hence positive definite.
    """
    n = len(matrix)
    a = [row[:] + [b[i] for b in rhs] for i, row in enumerate(matrix)]
    width = n + len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0.0:
            raise ValueError("weight: the mesh equations are singular; give every pair a positive weight")
        a[col], a[pivot] = a[pivot], a[col]
        pivot_row = a[col]
        inv = 1.0 / pivot_row[col]
        for r in range(col + 1, n):
            factor = a[r][col] * inv
            if factor != 0.0:
                row = a[r]
                for c in range(col, width):
                    row[c] -= factor * pivot_row[c]
    solutions = []
    for k in range(len(rhs)):
        x = [0.0] * n
        for r in range(n - 1, -1, -1):
            acc = a[r][n + k] - math.fsum(a[r][c] * x[c] for c in range(r + 1, n))
            x[r] = acc / a[r][r]
        solutions.append(x)
    return solutions


class MeshCorrector:
    """Makes pairwise estimates agree around every loop (Huygens' "network effect").

    Each measured pair (i, j) says x_j - x_i = theta_ij, with x the clock offsets of the nodes.
    Around a loop the true thetas sum to zero; measured ones do not, by their errors. Weighted
    least squares over all pairs, min sum w_ij (x_j - x_i - theta_ij)^2 with x_ref = 0, averages
    those errors over every path between two nodes, so one bad pair is outvoted by the others and
    shows up in its residual. Drift is solved the same way on log(1 + drift) so that rates
    compose exactly. Estimates must refer to the same instant (e.g. each estimator's offset_at
    at "now"); a sender clock off by 50 ms at 100 ppm moves theta by only 5 ns.

    Weights: inverse variances, e.g. 1 / (residual_rms_ns**2 + floor**2). Disconnected groups of
    nodes are solved separately, each against its own reference.
    """

    def __init__(self, reference: Hashable | None = None) -> None:
        self.reference = reference
        self._measurements: list[tuple[Hashable, Hashable, float, float, float]] = []
        self._nodes: dict[Hashable, None] = {}  # insertion-ordered set

    def add(self, sender: Hashable, reflector: Hashable, offset_ns: float, drift_ppm: float = 0.0,
            weight: float = 1.0) -> None:
        """One pairwise estimate: theta of `reflector` relative to `sender`. Repeats are allowed."""
        if sender == reflector:
            raise ValueError(f"reflector: {reflector!r} is also the sender; a node has no offset to itself")
        offset_ns = _check_float(offset_ns, "offset_ns")
        drift_ppm = _check_float(drift_ppm, "drift_ppm", -1e6, None, lo_open=True)
        weight = _check_float(weight, "weight", 0.0, None, lo_open=True,
                              hint="; use an inverse variance, e.g. 1 / error_ns**2")
        self._measurements.append((sender, reflector, offset_ns, drift_ppm, weight))
        self._nodes.setdefault(sender)
        self._nodes.setdefault(reflector)

    def _components(self) -> list[list[Hashable]]:
        adjacent: dict[Hashable, list[Hashable]] = {n: [] for n in self._nodes}
        for i, j, *_ in self._measurements:
            adjacent[i].append(j)
            adjacent[j].append(i)
        seen: set[Hashable] = set()
        components = []
        for start in self._nodes:
            if start in seen:
                continue
            seen.add(start)
            component, frontier = [start], [start]
            while frontier:
                for nxt in adjacent[frontier.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        component.append(nxt)
                        frontier.append(nxt)
            components.append(component)
        return components

    def solve(self) -> MeshSolution:
        if self.reference is not None and self.reference not in self._nodes:
            raise ValueError(f"reference: node {self.reference!r} has no measurements; "
                             "pick a node that appears in add(), or None")
        offsets: dict[Hashable, float] = {}
        log_rates: dict[Hashable, float] = {}
        reference_of: dict[Hashable, Hashable] = {}
        for component in self._components():
            ref = self.reference if self.reference in component else component[0]
            unknown = {node: k for k, node in enumerate(n for n in component if n != ref)}
            m = len(unknown)
            laplacian = [[0.0] * m for _ in range(m)]
            b_offset, b_rate = [0.0] * m, [0.0] * m
            members = set(component)
            for i, j, theta, drift, w in self._measurements:
                if i not in members:
                    continue
                log_rate = _log_rate(drift)
                ki, kj = unknown.get(i), unknown.get(j)
                # d/dx of w (x_j - x_i - theta)^2, with the reference's column removed
                if ki is not None:
                    laplacian[ki][ki] += w
                    b_offset[ki] -= w * theta
                    b_rate[ki] -= w * log_rate
                if kj is not None:
                    laplacian[kj][kj] += w
                    b_offset[kj] += w * theta
                    b_rate[kj] += w * log_rate
                if ki is not None and kj is not None:
                    laplacian[ki][kj] -= w
                    laplacian[kj][ki] -= w
            x_offset, x_rate = _solve_linear(laplacian, [b_offset, b_rate]) if m else ([], [])
            offsets[ref], log_rates[ref], reference_of[ref] = 0.0, 0.0, ref
            for node, k in unknown.items():
                offsets[node], log_rates[node], reference_of[node] = x_offset[k], x_rate[k], ref
        pairs = [CorrectedPair(sender=i, reflector=j, measured_offset_ns=theta, offset_ns=offsets[j] - offsets[i],
                               measured_drift_ppm=drift, drift_ppm=_ppm_from_log(log_rates[j] - log_rates[i]))
                 for i, j, theta, drift, _ in self._measurements]
        return MeshSolution(node_offset_ns=offsets,
                            node_drift_ppm={n: _ppm_from_log(r) for n, r in log_rates.items()},
                            reference_of=reference_of, pairs=pairs)


# ---- a clock to simulate against -----------------------------------------------------------

class SyntheticClock:
    """A free-running oscillator: maps true time (ns) to this clock's reading (ns).

    reading(T) = T + offset_ns + integral of drift, where the drift starts at `drift_ppm` and,
    every `step_ns` of true time, takes a Gaussian random-walk step of
    wander_ppm_per_sqrt_s * sqrt(step seconds), reflected at +-100 ppm so it stays a plausible
    crystal. The reading is piecewise linear, one segment per step, and floored to integer ns,
    so it never decreases.

    Queries may come in any order: segments are generated lazily in order (segment k always uses
    the k-th draw of its own random.Random(seed)) and kept, so a reading depends only on the
    seed and the true time, never on which times were asked before. This class owns its RNG on
    purpose: it is a test and simulation aid, not an estimator. With wander, memory grows by one
    segment per step up to the latest time queried (36 000 per simulated hour at the default
    100 ms), so start_ns should be near the simulated times; without wander there is one segment.
    """

    def __init__(self, *, offset_ns: int = 0, drift_ppm: float = 0.0, wander_ppm_per_sqrt_s: float = 0.0,
                 seed: int = 0, start_ns: int = 0, step_ns: int = 100_000_000) -> None:
        self.offset_ns = _check_int(offset_ns, "offset_ns", -MAX_SYNTHETIC_OFFSET_NS, MAX_SYNTHETIC_OFFSET_NS,
                                    " ns (+-50 ms)")
        self.drift_ppm = _check_float(drift_ppm, "drift_ppm", -MAX_SYNTHETIC_DRIFT_PPM, MAX_SYNTHETIC_DRIFT_PPM)
        self.wander_ppm_per_sqrt_s = _check_float(wander_ppm_per_sqrt_s, "wander_ppm_per_sqrt_s", 0.0, 10.0,
                                                  hint="; a real crystal wanders ~0.001-0.05 ppm/sqrt(s)")
        self.seed = _check_int(seed, "seed")
        self.start_ns = _check_int(start_ns, "start_ns")
        self.step_ns = _check_int(step_ns, "step_ns", 1_000, None, "; use e.g. 100_000_000 (100 ms)")
        self._rng = random.Random(seed)
        self._sigma_per_step = self.wander_ppm_per_sqrt_s * math.sqrt(self.step_ns / NS_PER_S)
        # segment k starts at true start_ns + k * step_ns with reading base + frac (0 <= frac < 1)
        self._base: list[int] = [start_ns + offset_ns]
        self._frac: list[float] = [0.0]
        self._drift: list[float] = [self.drift_ppm]

    @classmethod
    def random(cls, seed: int, *, max_offset_ns: int = MAX_SYNTHETIC_OFFSET_NS,
               max_drift_ppm: float = MAX_SYNTHETIC_DRIFT_PPM, wander_ppm_per_sqrt_s: float = 0.0,
               start_ns: int = 0) -> SyntheticClock:
        """A clock with offset and drift drawn uniformly within the bounds, all from `seed`."""
        _check_int(max_offset_ns, "max_offset_ns", 0, MAX_SYNTHETIC_OFFSET_NS)
        _check_float(max_drift_ppm, "max_drift_ppm", 0.0, MAX_SYNTHETIC_DRIFT_PPM)
        rng = random.Random(seed)
        return cls(offset_ns=rng.randint(-max_offset_ns, max_offset_ns),
                   drift_ppm=rng.uniform(-max_drift_ppm, max_drift_ppm),
                   wander_ppm_per_sqrt_s=wander_ppm_per_sqrt_s, seed=rng.randrange(2**63), start_ns=start_ns)

    def _extend(self) -> None:
        drift = self._drift[-1]
        advance = self._frac[-1] + self.step_ns * drift * 1e-6
        whole = math.floor(advance)
        self._base.append(self._base[-1] + self.step_ns + whole)
        self._frac.append(advance - whole)
        nxt = drift + self._rng.gauss(0.0, self._sigma_per_step)
        while abs(nxt) > MAX_SYNTHETIC_DRIFT_PPM:  # reflect at the bounds
            nxt = math.copysign(2 * MAX_SYNTHETIC_DRIFT_PPM, nxt) - nxt
        self._drift.append(nxt)

    def _segment(self, true_ns: int) -> int:
        _check_int(true_ns, "true_ns", self.start_ns, None, f" (the clock starts at start_ns={self.start_ns})")
        if self.wander_ppm_per_sqrt_s == 0.0:
            return 0  # constant drift: one segment reaches any time
        k = (true_ns - self.start_ns) // self.step_ns
        if k - len(self._drift) >= MAX_SYNTHETIC_SEGMENTS:
            raise ValueError(f"true_ns: {true_ns} is {k} steps of step_ns past start_ns={self.start_ns}; "
                             f"a wandering clock keeps every step (at most {MAX_SYNTHETIC_SEGMENTS} at a time): "
                             "set start_ns near the simulated times or a larger step_ns")
        while len(self._drift) <= k:
            self._extend()
        return k

    def read(self, true_ns: int) -> int:
        """This clock's reading at true time `true_ns`."""
        k = self._segment(true_ns)
        into = true_ns - (self.start_ns + k * self.step_ns)
        return self._base[k] + into + math.floor(self._frac[k] + into * self._drift[k] * 1e-6)

    def offset_at(self, true_ns: int) -> int:
        """reading - true time."""
        return self.read(true_ns) - true_ns

    def drift_ppm_at(self, true_ns: int) -> float:
        return self._drift[self._segment(true_ns)]

    def segment(self, true_ns: int) -> tuple[int, int, int]:
        """This clock as a line from `true_ns` on: (base_true_ns, base_local_ns, rate_ppb), the
        form the C probe core applies to its timestamps between two updates."""
        return true_ns, self.read(true_ns), round(self.drift_ppm_at(true_ns) * 1000)

"""Per-path telemetry from completed exchanges: loss per direction, RTT, one-way delay, jitter.

Pure: fed with exchanges and times, no clock reads. Memory per path is bounded (ring buffers).

Loss per direction. Each reply carries `rx_count`, the number of requests the reflector has
received on this path so far. At the highest sequence answered so far, `hi`:

    requests sent     S = hi - first_seq + 1
    requests arrived  R = rx_count in the reply to hi
    replies arrived   Q = replies received with seq <= hi
    lost forward      S - R        (request lost on the way out)
    lost reverse      R - Q        (reply lost on the way back)

Probes still in flight (seq > hi) are not counted as lost. A window's figures are differences
of these cumulative counts between its two ends.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .probe_event import EV_MISS, ProbeEvent

# RTT histogram bucket upper bounds (ns): 5 µs .. 1 s, fixed so Prometheus series stay bounded
RTT_BUCKETS_NS = (5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000, 2_000_000, 5_000_000,
                  10_000_000, 20_000_000, 50_000_000, 100_000_000, 200_000_000, 500_000_000, 1_000_000_000)


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


@dataclass
class LossCounters:
    """Cumulative per-direction loss of one path, from the replies' `rx_count`."""

    start_seq: int | None = None  # first answered sequence: accounting starts there
    hi: int = -1  # highest answered sequence
    arrived: int = 0  # requests in [start_seq, hi] that reached the reflector
    replies: int = 0  # replies received for requests in [start_seq, hi]
    reflector_restarts: int = 0
    _last_rx: int = 0

    def on_reply(self, seq: int, rx_count: int, replies: int = 1) -> None:
        """`replies` > 1: that many replies, `seq` and `rx_count` being the newest's (batched)."""
        if self.start_seq is None:
            self.start_seq = self.hi = seq
            self.arrived = self.replies = 1
            self._last_rx = rx_count
            return
        if seq < self.start_seq:
            return
        self.replies += replies
        if seq > self.hi:
            step = rx_count - self._last_rx
            if not 0 < step <= seq - self.hi:
                # the reflector restarted (its counter went back) or is inconsistent: we cannot
                # tell what was lost in between, so count nothing as lost
                self.reflector_restarts += 1
                step = seq - self.hi
            self.arrived += step
            self.hi = seq
            self._last_rx = rx_count

    def on_event(self, ev: ProbeEvent) -> None:
        """The replies a probe event carries (see `feed_events`)."""
        self.on_reply(ev.seq, ev.rx_count, ev.replies)

    @property
    def answered(self) -> int:
        return 0 if self.start_seq is None else self.hi - self.start_seq + 1

    @property
    def lost_fwd(self) -> int:
        return max(0, self.answered - self.arrived)

    @property
    def lost_rev(self) -> int:
        return max(0, self.arrived - self.replies)


@dataclass
class Sample:
    seq: int
    t4: int  # sender-clock time the reply arrived
    rtt: int  # ns, reflector residence time excluded
    fwd_raw: int  # t2 - t1: forward one-way delay + clock offset (reflector - sender)
    rev_raw: int  # t4 - t3: reverse one-way delay - clock offset


@dataclass
class PathTelemetry:
    """Telemetry of one probed path (local NIC, peer NIC, source port); bounded memory."""

    ring: int = 4096
    loss: LossCounters = field(default_factory=LossCounters)
    samples: deque = field(default_factory=deque)
    sent: int = 0
    rtt_counts: list = field(default_factory=lambda: [0] * (len(RTT_BUCKETS_NS) + 1))  # last: +Inf
    rtt_sum_ns: int = 0

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.ring)

    def on_sent(self) -> None:
        self.sent += 1

    def on_reply(self, seq: int, t1: int, t2: int, t3: int, t4: int, rx_count: int, replies: int = 1) -> Sample:
        """One exchange; `replies` > 1 when it stands for a batch of on-time replies (judging mode)."""
        self.loss.on_reply(seq, rx_count, replies)
        s = Sample(seq, t4, (t4 - t1) - (t3 - t2), t2 - t1, t4 - t3)
        self.samples.append(s)
        self.rtt_counts[bisect_left(RTT_BUCKETS_NS, s.rtt)] += 1
        self.rtt_sum_ns += s.rtt
        return s

    def on_event(self, ev: ProbeEvent) -> Sample:
        """The replies a probe event carries (see `feed_events`): one sample, its newest exchange."""
        return self.on_reply(ev.seq, ev.t1, ev.t2, ev.t3, ev.t4, ev.rx_count, ev.replies)

    def latest_t4(self) -> int | None:
        return self.samples[-1].t4 if self.samples else None

    def window(self, since_t4: int, offset_ns: float | None = None) -> dict:
        """Statistics of the samples whose reply arrived at or after `since_t4` (sender clock).

        With `offset_ns` (reflector clock minus sender clock, from clock sync) the one-way delays
        are true delays; without it only RTT is meaningful and one-way figures are omitted.
        """
        xs = [s for s in list(self.samples) if s.t4 >= since_t4]  # list(): one atomic copy under the GIL
        out = {"samples": len(xs), "rtt_ns": _summary(sorted(s.rtt for s in xs)),
               "jitter_ns": _jitter([s.rtt for s in xs])}
        if offset_ns is not None:
            out["owd_fwd_ns"] = _summary(sorted(s.fwd_raw - offset_ns for s in xs))
            out["owd_rev_ns"] = _summary(sorted(s.rev_raw + offset_ns for s in xs))
        return out


def feed_events(events: Iterable[ProbeEvent], telemetry: Mapping[int, PathTelemetry | LossCounters]) -> None:
    """Feed the replies that judging-mode events carry into their paths' telemetry, in order:
    what the probe engine does before the decision loop sees the events (and the simulator,
    whose paths keep only `LossCounters`). ANSWERED stands for `count` on-time replies, LATE
    for one, MISS for none; a path missing from `telemetry` (removed) is skipped."""
    for ev in events:
        if ev.kind != EV_MISS:
            sink = telemetry.get(ev.path_id)
            if sink is not None:
                sink.on_event(ev)


def _summary(sorted_values: list[float]) -> dict:
    if not sorted_values:
        return {"min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"min": sorted_values[0], "p50": percentile(sorted_values, 0.5), "p90": percentile(sorted_values, 0.9),
            "p99": percentile(sorted_values, 0.99), "max": sorted_values[-1]}


def _jitter(values: list[float]) -> float | None:
    """Mean absolute difference of consecutive values (RFC 3550's interarrival jitter, unsmoothed)."""
    if len(values) < 2:
        return None
    return sum(abs(b - a) for a, b in zip(values, values[1:])) / (len(values) - 1)


@dataclass(frozen=True)
class LossSnapshot:
    """Cumulative counters of a path at one instant; subtract two to get a window.

    `sent` counts every request; `answered` only the span up to the highest answered one. A
    dark path (nothing comes back) shows as sent without replies: `unanswered`, with no
    direction, since nothing returned to tell which way was lost.
    """

    sent: int
    answered: int
    arrived: int
    replies: int

    @classmethod
    def of(cls, t: "PathTelemetry") -> "LossSnapshot":
        return cls(t.sent, t.loss.answered, t.loss.arrived, t.loss.replies)

    def minus(self, earlier: "LossSnapshot", in_flight: int = 0) -> dict:
        """The window between two snapshots. `in_flight`: how many of the newest unanswered
        probes may still be on their way (not counted as lost: only a longer silence is)."""
        sent = self.sent - earlier.sent
        answered = self.answered - earlier.answered
        arrived = self.arrived - earlier.arrived
        replies = self.replies - earlier.replies
        lost_fwd, lost_rev = max(0, answered - arrived), max(0, arrived - replies)
        unanswered = max(0, sent - answered)
        silent = max(0, unanswered - in_flight)
        return {"sent": sent, "replies": replies, "lost_fwd": lost_fwd, "lost_rev": lost_rev,
                "unanswered": unanswered,
                "loss_pct": 100.0 * min(sent, lost_fwd + lost_rev + silent) / sent if sent else None,
                "loss_fwd_pct": 100.0 * lost_fwd / answered if answered else None,
                "loss_rev_pct": 100.0 * lost_rev / arrived if arrived else None}

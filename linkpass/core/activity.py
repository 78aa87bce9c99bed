"""Which paths carry the job's traffic, and so how often each is probed. Pure: the caller passes
what the host saw, with the time.

Four rates, from what the host can see cheaply (TCP sockets, the kernel's socket diagnostics;
the NCCL plugin's and the RDMA library's lane reports, docs/lanes.md):

- **active** (`probe.interval_ms`, millisecond detection): a path whose lane has bytes waiting for
  acknowledgement and no fresh progress (the transport needs the path now and has no evidence it
  works), or one TCP data moved on: to the peer's address on its plane, or to the peer's service
  address (whose plane the routes choose, so every path of the peer counts). TCP to a plane
  address that a TCP lane reports on (the plugin's socket lanes) is that lane's traffic: its
  report, progressing, stalled or silent, decides the rate, not the sockets seen;
- **progressing** (`probe.progress_interval_ms`): a path whose lanes report acknowledged bytes
  advancing within `progress_window_ns`. The transport's own progress says the path works; when
  it stops while bytes wait, the path is active at the next look, and stays active for
  STALL_HOLD_NS after the lane last stalled (a job whose acknowledgements come in bursts would
  otherwise flip its paths between the two rates many times a second);
- **standby** (`probe.standby_interval_ms`): a lane's path quiet between transfers, and every other
  path of a peer the job uses: failover, or the next transfer, moves traffic onto them at once,
  so their state must be known within a few tens of milliseconds;
- **idle** (`probe.idle_interval_ms`): the rest, known good within about a second.

A stall is judged on the writer's clock: the window runs from the lane's last progress to the
writer's last look at its acknowledgements (its report's heartbeat), so a writer kept off the CPU
is not taken for a stalled path, whose 250 ms at the active rate would take more CPU from a host
already short of it. A writer silent for longer than WRITER_SILENT_WINDOWS windows gives no
evidence either way: its lanes' paths are standby (the peer is in use) until it looks again, and
its first look judges a stall at once if nothing was acknowledged meanwhile. A silent writer is
most often one the host keeps off the CPU; putting its paths at the full rate would take more CPU
from the job, keep its writer off longer, and hold the host there. While the writer is away its
job moves no new chunk either. One that gives no look time is judged on the reader's clock.

RDMA traffic no lane report names (NCCL's own IB transport, another RDMA application) is seen
only as packets on a plane's RDMA device: a plane whose device moves more than the agent's own
probes account for, while no lane report names that plane (`UnreportedRdma`), makes every path of
that plane active, since the agent cannot tell which peers the traffic goes to.

A peer's or path's traffic counts from the first look that sees it until `idle_after_ns` pass
without any. New paths start active; the next look sets their rate (the agent looks as soon as
it adds paths).

What the detector makes of a slower rate: its thresholds count probes and its timeouts follow
each probe's round trip, so a slow path is judged by the same rules, only later (three misses at
10 Hz are ~300 ms); recovery takes `recovery_good_probes` probes, which is why a path the job
starts to use is promoted as soon as it is seen, before traffic depends on it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

ACTIVE, PROGRESSING, STANDBY, IDLE = "active", "progressing", "standby", "idle"
RATES = (ACTIVE, PROGRESSING, STANDBY, IDLE)
STALL_HOLD_NS = 250_000_000  # a lane that stalled stays at the active rate this long before progress may slow it again
FUTURE_SLACK_NS = 1_000_000  # a writer may stamp its progress just after the reader took its time
WRITER_SILENT_WINDOWS = 5  # a writer that has not looked for this many progress windows gives no evidence
# a lane view that changed, or that the probe core's lane watch saw change, stays unsettled this many
# windows: a lane re-made on a path is taken as progressing on its predecessor's progress until
# its writer's look is a window past it, and a writer may look up to WRITER_SILENT_WINDOWS late
SETTLE_WINDOWS = WRITER_SILENT_WINDOWS + 2
ANY_PORT = 0  # a lane whose path the agent does not probe (a TCP lane) stands for every path of its plane
# the longest the decision loop lets on-time replies wait (`batch_interval_s`): hold-downs and
# flap reuse are judged when a batch comes, so a recovered path may return this much late
BATCH_CEILING_S = 0.05


def batch_interval_s(intervals_s: Iterable[float], floor_s: float) -> float:
    """How often the decision loop takes on-time replies (misses and late replies wake it at
    once): as often as the fastest path is probed, but no more often than `floor_s`
    (`probe.batch_ms`) and no less often than BATCH_CEILING_S (unless the floor is longer).

    A batch taken while most paths have no new reply is a wake-up for a handful of events; with
    every path slow (the job's lanes progressing, the rest idle) that fixed cost was most of the
    decision loop's CPU. Replies on time carry RTT, delay and loss evidence, none of it urgent
    at the rate of a path probed every 50 ms; a path that goes active shortens the batch at once."""
    fastest = min(intervals_s, default=floor_s)
    return max(floor_s, min(fastest, BATCH_CEILING_S))


def _peer_of(key: str | tuple) -> str:
    """The peer of what Activity keeps a time for: a peer itself, or a (peer, plane[, sport]) key."""
    return key if isinstance(key, str) else key[0]


@dataclass(frozen=True)
class PathKey:
    peer: str
    plane: int
    sport: int


class LaneSeen(NamedTuple):  # a tuple: built for every lane at every look, every 2 ms
    """One lane at one look: its path, when its acknowledged bytes last advanced (0: never),
    whether bytes handed to it wait for acknowledgement, and when its writer last looked for
    acknowledgements (its report's heartbeat; 0: not known, judged at the reader's time)."""
    peer: str
    plane: int
    sport: int
    progress_ns: int
    waiting: bool
    looked_ns: int = 0


@dataclass(frozen=True)
class RateChange:
    path: int
    peer: str
    rate: str  # one of RATES


class Activity:
    """When each peer, plane and lane last moved data, and the rate each probed path has been given."""

    def __init__(self, idle_after_ns: int, progress_window_ns: int = 4_000_000):
        if idle_after_ns <= 0:
            raise ValueError(f"idle_after_ns must be > 0, got {idle_after_ns}")
        if progress_window_ns <= 0:
            raise ValueError(f"progress_window_ns must be > 0, got {progress_window_ns}")
        self.idle_after_ns = idle_after_ns
        self.progress_window_ns = progress_window_ns
        self.last_moved: dict[str, int] = {}  # peer -> TCP data to its service address last seen
        self.plane_moved: dict[tuple[str, int], int] = {}  # (peer, plane) -> TCP data on that plane last seen
        self.lane_moved: dict[tuple[str, int, int], int] = {}  # (peer, plane, sport) -> a lane last carried data
        self.lane_progress: dict[tuple[str, int, int], int] = {}  # ... -> its acknowledged bytes last advanced
        self.lane_waiting: dict[tuple[str, int, int], int] = {}  # lanes with bytes waiting at the last look -> since when
        self.lane_judged: dict[tuple[str, int, int], int] = {}  # lanes at the last look -> when their progress was judged
        # ... -> (progressing, bytes waiting without progress while its writer looks) then: all of
        # a look that a path's rate depends on
        self.lane_status: dict[tuple[str, int, int], tuple[bool, bool]] = {}
        self.lane_stalled: dict[tuple[str, int, int], int] = {}  # ... -> last look that saw bytes wait without progress
        self.lanes_changed_ns = 0  # the last look whose lane_status differed from the one before
        self.rdma_moved: dict[int, int] = {}  # plane -> its RDMA device last moved traffic no lane reports
        self.rate: dict[int, str] = {}  # path -> the rate it is probed at now

    def saw(self, peers: Iterable[str], now_ns: int) -> None:
        """These peers moved TCP data over their service addresses in the look taken at `now_ns`."""
        for peer in peers:
            self.last_moved[peer] = now_ns

    def saw_planes(self, planes: Iterable[tuple[str, int]], now_ns: int) -> None:
        """TCP data moved to these (peer, plane) addresses in the look taken at `now_ns`."""
        for key in planes:
            self.plane_moved[key] = now_ns

    def saw_unreported_rdma(self, planes: Iterable[int], now_ns: int) -> None:
        """These planes' RDMA devices moved traffic no lane report names in the look at `now_ns`."""
        for plane in planes:
            self.rdma_moved[plane] = now_ns

    def unreported_rdma_planes(self, now_ns: int) -> list[int]:
        """The planes whose every path is active for RDMA traffic no lane report names."""
        return sorted(p for p, t in self.rdma_moved.items() if self._fresh(t, now_ns, self.idle_after_ns))

    def saw_lanes(self, lanes: Iterable[LaneSeen], now_ns: int) -> bool:
        """Every lane the reports held at `now_ns` (each look replaces the last one's). Returns
        whether any lane came, went, started or stopped progressing, or started or stopped waiting
        without progress since the last look: if not, the lanes change no path's rate (the stall
        hold and `idle_after` still run out with time, so the caller updates now and then all the
        same). A progressing lane's bytes wait and drain at every chunk: that alone changes nothing."""
        before, waited = self.lane_status, self.lane_waiting
        self.lane_waiting, self.lane_judged, status = {}, {}, {}
        silent_ns = WRITER_SILENT_WINDOWS * self.progress_window_ns
        for lane in lanes:
            key = (lane.peer, lane.plane, lane.sport)
            # a report is untrusted: a time ahead of this look (beyond a write racing the look) is no evidence
            progress = lane.progress_ns if lane.progress_ns <= now_ns + FUTURE_SLACK_NS else 0
            progress = min(progress, now_ns)
            # judged at the writer's last look where it is believable, else at this look
            looked = lane.looked_ns if 0 < lane.looked_ns <= now_ns + FUTURE_SLACK_NS else now_ns
            silent = now_ns - looked > silent_ns
            judged = max(min(looked, now_ns), progress)
            if not silent:
                self.lane_judged[key] = max(judged, self.lane_judged.get(key, 0))
            moved = now_ns if lane.waiting else progress
            if moved > self.lane_moved.get(key, 0):
                self.lane_moved[key] = moved
            if progress > self.lane_progress.get(key, 0):
                self.lane_progress[key] = progress
            progressing = not silent and self._fresh(self.lane_progress.get(key), judged, self.progress_window_ns)
            if lane.waiting:
                # bytes handed to a lane that had nothing waiting are not late yet: the window runs
                # from the first look that saw them (a transfer after a quiet spell is no stall)
                since = self.lane_waiting.setdefault(key, waited.get(key, judged))
                if not progressing and not silent and not self._fresh(since, judged, self.progress_window_ns):
                    self.lane_stalled[key] = now_ns
            was = status.get(key, (False, False))  # several lanes on one path: any of them
            status[key] = (was[0] or progressing, was[1] or (lane.waiting and not silent))
        self.lane_status = {k: (progressing, waiting and not progressing) for k, (progressing, waiting) in status.items()}
        if self.lane_status != before:
            self.lanes_changed_ns = now_ns
            return True
        return False

    def unsettle(self, now_ns: int) -> None:
        """The probe core's lane watch saw the lanes change: look often until the view settles."""
        self.lanes_changed_ns = max(self.lanes_changed_ns, now_ns)

    def lanes_settled(self, now_ns: int) -> bool:
        """Whether the lanes' view can now change only in ways the probe core's lane watch sees
        (linkpass/probe/lane_watch.h: a lane comes or goes, starts or stops progressing or waiting
        without progress), so the caller may look again only when it says so: no lane waits without
        progress (a stall is marked from the looks that see it wait) and the view has not changed
        for SETTLE_WINDOWS windows."""
        return (not any(stuck for _, stuck in self.lane_status.values())
                and now_ns - self.lanes_changed_ns > SETTLE_WINDOWS * self.progress_window_ns)

    @staticmethod
    def _fresh(t: int | None, now_ns: int, window_ns: int) -> bool:
        return bool(t) and now_ns - t <= window_ns

    def busy_peers(self, now_ns: int) -> set[str]:
        """The peers the job uses now (any of their planes or lanes moved data within idle_after)."""
        out = set()
        for seen in (self.last_moved, self.plane_moved, self.lane_moved):
            out.update(_peer_of(k) for k, t in seen.items()
                       if self._fresh(t, now_ns, self.idle_after_ns))
        return out

    def classify(self, key: PathKey, now_ns: int, busy: set[str]) -> str:
        """The rate `key`'s path wants now; `busy` is busy_peers(now_ns)."""
        lanes = ((key.peer, key.plane, key.sport), (key.peer, key.plane, ANY_PORT))
        held = any(self._fresh(self.lane_stalled.get(k), now_ns, STALL_HOLD_NS) for k in lanes)
        if not held and any(k in self.lane_judged and self._fresh(self.lane_progress.get(k), self.lane_judged[k],
                                                                  self.progress_window_ns) for k in lanes):
            return PROGRESSING
        # a lane that stalled keeps its paths at the full rate for the hold, waiting or not; the
        # TCP a plane's own TCP lane reports is that lane's traffic, judged by the lane alone
        tcp_lane = lanes[1] in self.lane_status
        if (held or any(self.lane_status.get(k, (False, False))[1] for k in lanes)
                or self._fresh(self.last_moved.get(key.peer), now_ns, self.idle_after_ns)
                or (not tcp_lane and self._fresh(self.plane_moved.get((key.peer, key.plane)), now_ns,
                                                 self.idle_after_ns))
                or self._fresh(self.rdma_moved.get(key.plane), now_ns, self.idle_after_ns)):
            return ACTIVE
        return STANDBY if key.peer in busy else IDLE

    def update(self, paths: Mapping[int, PathKey], now_ns: int) -> list[RateChange]:
        """The rate of every path in `paths` now; returns the paths whose rate changed. Paths not
        seen before count as active (new paths start at the full rate); paths gone from `paths`
        are forgotten, and so is what was seen of peers without paths or long quiet."""
        self._forget(now_ns, {k.peer for k in paths.values()})
        busy = self.busy_peers(now_ns)
        # a path whose peer no evidence names, on a plane without unreported RDMA, can only be
        # standby or idle: most of a fleet host's paths, classified at every look that changed
        # anything (88 paths: ~390 -> ~160 us)
        named = {_peer_of(k)  # (lane_judged's lanes are lane_status's)
                 for seen in (self.last_moved, self.plane_moved, self.lane_stalled, self.lane_status) for k in seen}
        rdma = {p for p, t in self.rdma_moved.items() if self._fresh(t, now_ns, self.idle_after_ns)}
        changes = []
        for pid, key in paths.items():
            if key.peer in named or key.plane in rdma:
                want = self.classify(key, now_ns, busy)
            else:
                want = STANDBY if key.peer in busy else IDLE
            if self.rate.get(pid, ACTIVE) != want:
                changes.append(RateChange(pid, key.peer, want))
            self.rate[pid] = want
        for pid in [p for p in self.rate if p not in paths]:
            del self.rate[pid]
        return changes

    def _forget(self, now_ns: int, peers: set[str]) -> None:
        for seen in (self.last_moved, self.plane_moved, self.lane_moved, self.lane_progress, self.lane_stalled):
            for key in [k for k, t in seen.items()
                        if _peer_of(k) not in peers or now_ns - t > self.idle_after_ns]:
                del seen[key]
        for plane in [p for p, t in self.rdma_moved.items() if now_ns - t > self.idle_after_ns]:
            del self.rdma_moved[plane]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(RATES, 0)
        for rate in self.rate.values():
            out[rate] += 1
        return out


class UnreportedRdma:
    """Which planes' RDMA devices move traffic the agent cannot place: per look, the packets a
    plane's device sent and received since the last look, less every packet the agent's own
    probing could have put on it (its requests and replies, the requests it reflected and its
    answers: an upper bound, as if all of them crossed that one plane), above `floor_pps`, on a
    plane no lane report names. A counter that went backwards (a device reset) is no evidence;
    the next look starts from it."""

    def __init__(self, floor_pps: float):
        if floor_pps <= 0:
            raise ValueError(f"floor_pps must be > 0, got {floor_pps}")
        self.floor_pps = floor_pps
        self._last: tuple[int, dict[int, int], int] | None = None

    def look(self, now_ns: int, port_packets: Mapping[int, int], own_packets: int,
             lane_planes: Iterable[int]) -> dict[int, float]:
        """`port_packets`: plane -> its device's packet counter (sent + received) now;
        `own_packets`: the agent's own probe packets so far (a counter); `lane_planes`: planes
        a lane report names at this look. Returns the planes with unreported traffic, each with
        its packets/s beyond the probes."""
        last, self._last = self._last, (now_ns, dict(port_packets), own_packets)
        if last is None or now_ns <= last[0]:
            return {}
        seconds = (now_ns - last[0]) / 1e9
        own = max(0, own_packets - last[2])
        reported = set(lane_planes)
        out = {}
        for plane, count in sorted(port_packets.items()):
            before = last[1].get(plane)
            if before is None or count < before or plane in reported:
                continue
            pps = (count - before - own) / seconds
            if pps > self.floor_pps:
                out[plane] = pps
        return out

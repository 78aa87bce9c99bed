"""What the demo measured, from its logs: per fault detected → localized → rerouted → stall →
back to speed, and the run's summary. Pure: it reads records, it runs nothing.

Inputs, all on the wall clock (CLOCK_REALTIME is shared by every namespace of the testbed):
- steps: rank 0's step log, {"step", "start_ns", "end_ns", "ok"} (the all-reduce only, so a
  stall is the collective's, not the simulated compute's);
- faults: one `Fault` per scripted fault, with when it took effect and when it was cleared;
- agent events: the agents' JSON log lines (`path_state`, `route_change`, with `ts` in seconds);
- coordinator events: `/v1/events` rows (`localization` with `subject` "link:direction", `ts`);
- alert spans: {alertname: [(first, last) time seen firing, epoch s]} from the demo's Prometheus,
  each instance of an alert (host, peer, plane, ...) its own spans.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ..core.states import is_bad

BASELINE_S = 3.0  # the pre-fault rate and step time come from this much of the run before each fault
SETTLE_S = 0.5  # a stall may end this long after the fault was cleared (TCP's retransmit backoff)
RATE_WINDOW = 10  # steps per throughput window
RECOVERED_FRACTION = 0.95
TARGET_STALL_MS = {"hard": 100.0, "gray": 500.0}
TARGET_RECOVERED_S = 1.0
ALERT_LATE_S = 10.0  # an alert may fire this long after its fault was cleared (scrape, evaluation, hold-down)


@dataclass
class Fault:
    """One scripted fault as it was run."""

    index: int
    kind: str  # uplink-cut | link-down | gray-loss | flap | one-way-loss | mtu-blackhole
    label: str
    link: str
    direction: str | None  # from-node of a one-direction fault
    severity: str  # "hard" | "gray"
    load_mbps: float  # the job's traffic through the link (that way) just before the fault, MB/s
    injected_ns: int  # wall clock, so anyone can line the step logs up again
    cleared_ns: int
    alerts: tuple[str, ...] = field(default=(), kw_only=True)  # the Prometheus alerts that report this fault


@dataclass
class FaultResult(Fault):
    """A fault as it was run, and what the job and LinkPass did about it."""

    detect_ms: float | None  # first agent verdict against a path
    localized_ms: float | None  # first coordinator finding naming this link (or it as an alternative)
    localized_as: str | None  # the directed link the coordinator named
    reroute_ms: float | None  # first route change that takes a plane away
    stall_ms: float | None  # longest all-reduce in the fault's window minus the pre-fault median
    longest_step_ms: float | None
    recovered_s: float | None  # until a window of steps runs at ≥ 95 % of the pre-fault rate
    target_stall_ms: float
    met: bool
    alert_ms: float | None = None  # first of the fault's alerts firing in Prometheus
    alert: str | None = None  # ... which one


@dataclass
class RunSummary:
    mode: str  # "linkpass" | "off"
    steps: int
    wrong_results: int
    restarts: int
    step_ms_p50: float | None
    step_ms_p99: float | None
    faults: list[FaultResult] = field(default_factory=list)
    # the STALL measure over fault-free windows as long as a fault's: what scheduling noise alone
    # reads as a stall on this machine ({"windows", "median", "p90"} in ms)
    noise_stall_ms: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _ms(t_ns: float, t0_ns: int) -> float:
    return round((t_ns - t0_ns) / 1e6, 2)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def allreduce_ms(step: dict) -> float:
    return (step["end_ns"] - step["start_ns"]) / 1e6


def first_verdict(fault: Fault, agent_events: list[dict]) -> float | None:
    """ms from injection to the first agent judging a path bad (`states.BAD`), while the fault was on."""
    times = [e["ts"] * 1e9 for e in agent_events
             if e.get("event") == "path_state" and is_bad(e.get("new"))
             and fault.injected_ns <= e["ts"] * 1e9 <= fault.cleared_ns]
    return _ms(min(times), fault.injected_ns) if times else None


def first_reroute(fault: Fault, agent_events: list[dict], planes: int) -> float | None:
    """ms from injection to the first route change that took a plane away from a peer."""
    times = [e["ts"] * 1e9 for e in agent_events
             if e.get("event") == "route_change" and len(e.get("planes") or ()) < planes
             and not e.get("dry_run") and fault.injected_ns <= e["ts"] * 1e9 <= fault.cleared_ns]
    return _ms(min(times), fault.injected_ns) if times else None


def first_localization(fault: Fault, coordinator_events: list[dict]) -> tuple[float | None, str | None]:
    """ms from injection to the coordinator's first finding that names the faulty link, either as
    its answer or as an alternative it cannot tell apart (two leaves per plane make twins)."""
    for e in sorted(coordinator_events, key=lambda e: e["ts"]):
        t = e["ts"] * 1e9
        if e.get("kind") != "localization" or not fault.injected_ns <= t <= fault.cleared_ns + SETTLE_S * 1e9:
            continue
        named = [e["subject"], *((e.get("detail") or {}).get("alternatives") or [])]
        if any(n.split(":")[0] == fault.link for n in named):
            return _ms(t, fault.injected_ns), e["subject"]
    return None, None


def first_alert(fault: Fault, alert_spans: dict[str, list[tuple[float, float]]]) -> tuple[float | None, str | None]:
    """ms from injection to the first of the fault's alerts seen firing, and its name: it must
    start firing within the fault's window (or ALERT_LATE_S after)."""
    hits = [(start, name) for name in fault.alerts for start, _ in alert_spans.get(name, ())
            if fault.injected_ns <= start * 1e9 <= fault.cleared_ns + ALERT_LATE_S * 1e9]
    if not hits:
        return None, None
    start, name = min(hits)
    return _ms(start * 1e9, fault.injected_ns), name


def baseline(steps: list[dict], before_ns: int) -> list[dict]:
    return [s for s in steps if before_ns - BASELINE_S * 1e9 <= s["end_ns"] < before_ns]


def stall(fault: Fault, steps: list[dict]) -> tuple[float | None, float | None]:
    """(stall ms, longest all-reduce ms) over the steps overlapping the fault's window."""
    base = [allreduce_ms(s) for s in baseline(steps, fault.injected_ns)]
    hit = [allreduce_ms(s) for s in steps
           if s["end_ns"] > fault.injected_ns and s["start_ns"] < fault.cleared_ns + SETTLE_S * 1e9]
    if not base or not hit:
        return None, None
    longest = max(hit)
    return round(max(0.0, longest - statistics.median(base)), 1), round(longest, 1)


def recovered(fault: Fault, steps: list[dict]) -> float | None:
    """Seconds from injection until throughput is back: the first window of RATE_WINDOW steps
    starting after the fault whose step rate is ≥ 95 % of the pre-fault rate. None if never."""
    base = baseline(steps, fault.injected_ns)
    if len(base) < 2:
        return None
    pre_rate = (len(base) - 1) / ((base[-1]["end_ns"] - base[0]["end_ns"]) / 1e9)
    ends = [s["end_ns"] for s in steps]
    for k in range(1, len(ends) - RATE_WINDOW + 1):
        window_start = ends[k - 1]
        if ends[k] <= fault.injected_ns:
            continue
        rate = RATE_WINDOW / ((ends[k + RATE_WINDOW - 1] - window_start) / 1e9)
        if rate >= RECOVERED_FRACTION * pre_rate:
            return round(max(0.0, (window_start - fault.injected_ns) / 1e9), 3)
    return None


def analyse_fault(fault: Fault, steps: list[dict], agent_events: list[dict], coordinator_events: list[dict],
                  planes: int, alert_spans: dict | None = None) -> FaultResult:
    stall_ms, longest = stall(fault, steps)
    alert_ms, alert = first_alert(fault, alert_spans or {})
    localized_ms, named = first_localization(fault, coordinator_events)
    back = recovered(fault, steps)
    target = TARGET_STALL_MS[fault.severity]
    result = FaultResult(
        **asdict(fault), detect_ms=first_verdict(fault, agent_events), localized_ms=localized_ms, localized_as=named,
        reroute_ms=first_reroute(fault, agent_events, planes), stall_ms=stall_ms, longest_step_ms=longest,
        recovered_s=back, target_stall_ms=target, met=False, alert_ms=alert_ms, alert=alert)
    result.met = stall_within_target(result) and recovered_within_target(result)
    return result


def stall_within_target(f: FaultResult) -> bool:
    return f.stall_ms is not None and f.stall_ms <= f.target_stall_ms


def recovered_within_target(f: FaultResult) -> bool:
    return f.recovered_s is not None and f.recovered_s <= TARGET_RECOVERED_S


def _fault_spans(faults: list[Fault], margin_s: float) -> list[tuple[float, float]]:
    """Each fault's window (until SETTLE_S after it cleared), widened by `margin_s` both ways."""
    return [(f.injected_ns - margin_s * 1e9, f.cleared_ns + (SETTLE_S + margin_s) * 1e9) for f in faults]


def quiet_steps(steps: list[dict], faults: list[Fault], margin_s: float = 1.0) -> list[dict]:
    """The steps that ended `margin_s` clear of every fault's window."""
    spans = _fault_spans(faults, margin_s)
    return [s for s in steps if not any(a <= s["end_ns"] <= b for a, b in spans)]


def noise_stalls(steps: list[dict], faults: list[Fault], window_s: float = 2.5, margin_s: float = 1.0) -> list[float]:
    """The STALL measure (longest all-reduce in a window minus the median) over windows of
    `window_s` that stay `margin_s` clear of every fault: a stall this machine shows with no fault."""
    spans = _fault_spans(faults, margin_s)
    quiet = quiet_steps(steps, faults, margin_s)
    if len(quiet) < 2:
        return []
    median = statistics.median(allreduce_ms(s) for s in quiet)
    out, i = [], 0
    while i < len(quiet):
        start = quiet[i]["end_ns"]
        j = i
        while j < len(quiet) and quiet[j]["end_ns"] < start + window_s * 1e9:
            j += 1
        window, end = quiet[i:j], start + window_s * 1e9
        if j < len(quiet) and not any(a < end and b > start for a, b in spans):  # whole, and fault-free
            out.append(round(max(allreduce_ms(s) for s in window) - median, 1))
        i = j
    return out


def summarise(mode: str, steps: list[dict], wrong_results: int, restarts: int, faults: list[Fault],
              agent_events: list[dict], coordinator_events: list[dict], planes: int,
              alert_spans: dict | None = None) -> RunSummary:
    durations = [allreduce_ms(s) for s in steps]
    p50 = _percentile(durations, 0.5)
    p99 = _percentile(durations, 0.99)
    noise = noise_stalls(steps, faults)
    return RunSummary(mode=mode, steps=len(steps), wrong_results=wrong_results, restarts=restarts,
                      step_ms_p50=None if p50 is None else round(p50, 1),
                      step_ms_p99=None if p99 is None else round(p99, 1),
                      faults=[analyse_fault(f, steps, agent_events, coordinator_events, planes, alert_spans)
                              for f in faults],
                      noise_stall_ms={"windows": len(noise), "median": _percentile(noise, 0.5),
                                      "p90": _percentile(noise, 0.9)} if noise else None)


def targets_met(run: RunSummary) -> bool:
    return job_unharmed(run) and all(f.met for f in run.faults)


def job_unharmed(run: RunSummary) -> bool:
    """No restart, no wrong result, and every fault seen and routed around: what must hold
    whatever the machine's noise does to the timings."""
    return run.restarts == 0 and run.wrong_results == 0 and \
        all(f.detect_ms is not None and f.reroute_ms is not None for f in run.faults)

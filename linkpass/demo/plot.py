"""The demo's pictures: per-step all-reduce time with the faults marked, as a PNG (one panel per
run: LinkPass on, and off with --compare) and as a terminal sparkline."""
from __future__ import annotations

import math

from .timeline import Fault, allreduce_ms

BARS = "▁▂▃▄▅▆▇█"


def sparkline(steps: list[dict], faults: list[Fault], width: int = 72) -> tuple[str, str]:
    """(bars, marks): the slowest all-reduce per time bucket on a log scale, and under it the
    number of each fault at the bucket where it was injected."""
    if not steps:
        return "", ""
    t0, t1 = steps[0]["start_ns"], steps[-1]["end_ns"]
    span = max(1, t1 - t0)
    worst = [0.0] * width
    for s in steps:
        i = min(width - 1, (s["end_ns"] - t0) * width // span)
        worst[i] = max(worst[i], allreduce_ms(s))
    seen = [w for w in worst if w > 0]
    lo, hi = math.log(min(seen)), math.log(max(seen))
    bars = "".join(" " if w <= 0 else BARS[0 if hi == lo else round((math.log(w) - lo) / (hi - lo) * (len(BARS) - 1))]
                   for w in worst)
    marks = [" "] * width
    for f in faults:
        if t0 <= f.injected_ns <= t1:
            marks[min(width - 1, (f.injected_ns - t0) * width // span)] = str(f.index)
    return bars, "".join(marks)


def write_png(path: str, runs: list[tuple[str, list[dict], list[Fault], list[int]]], title: str) -> str:
    """One panel per run: (name, steps, faults, restart times ns). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, nor on most hosts that run this
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.6 * len(runs)), squeeze=False)
    top = max((allreduce_ms(s) for _, steps, _, _ in runs for s in steps), default=1.0)
    for ax, (name, steps, faults, restarts) in zip(axes[:, 0], runs):
        if not steps:
            ax.set_title(f"{name}: no steps")
            continue
        t0 = steps[0]["start_ns"]
        starts = [(s["start_ns"] - t0) / 1e9 for s in steps]
        xs = [(s["end_ns"] - t0) / 1e9 for s in steps]
        ys = [allreduce_ms(s) for s in steps]
        bad = [(x, y) for x, y, s in zip(xs, ys, steps) if not s["ok"]]
        # each step as a bar from its start to its end at the height of its duration: a stall
        # reads as a long bar over the time it took, not as a ramp from the previous step
        ax.hlines(ys, starts, xs, lw=2, color="#1f77b4", label="all-reduce, one bar per step")
        ax.scatter(xs, ys, s=2, color="#1f77b4")
        if bad:
            ax.scatter(*zip(*bad), color="red", zorder=3, label="wrong result")
        for f in faults:
            a, b = (f.injected_ns - t0) / 1e9, (f.cleared_ns - t0) / 1e9
            ax.axvspan(a, b, color="#d62728" if f.severity == "hard" else "#ff7f0e", alpha=0.15)
            ax.text(a, top * 1.3, f"{f.index} {f.kind}", fontsize=8, va="bottom", rotation=0)
        for r in restarts:
            ax.axvline((r - t0) / 1e9, color="black", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(top=top * 3)
        ax.set_ylabel("all-reduce (ms)")
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the job started (shaded: fault on; red hard, orange gray; "
                           "dashed: job restart)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_alerts_png(path: str, spans: dict[str, list[tuple[float, float]]], faults: list[Fault], t0_s: float,
                     eval_s: float = 1.0) -> str:
    """The alerts Prometheus fired, one lane per alert (bars: firing), over the faults (shaded),
    in seconds since `t0_s` (epoch). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(spans, key=lambda n: spans[n][0][0], reverse=True)  # the first to fire on top
    fig, ax = plt.subplots(figsize=(12, 0.45 * max(3, len(names)) + 1.2))
    for f in faults:
        a, b = f.injected_ns / 1e9 - t0_s, f.cleared_ns / 1e9 - t0_s
        ax.axvspan(a, b, color="#d62728" if f.severity == "hard" else "#ff7f0e", alpha=0.15)
        ax.text(a, len(names) - 0.4, f"{f.index} {f.kind}", fontsize=8, va="bottom")
    for i, name in enumerate(names):
        # a span is the evaluations that saw it firing: each stands for one evaluation interval
        ax.broken_barh([(a - t0_s, b - a + eval_s) for a, b in spans[name]], (i - 0.3, 0.6), color="#9467bd")
    ax.set_yticks(range(len(names)), [n.removeprefix("LinkPass") for n in names], fontsize=9)
    ax.set_ylim(-0.7, len(names) + 0.3)
    ax.set_xlabel("seconds since the demo started (shaded: fault on; red hard, orange gray)")
    ax.set_title("Prometheus alerts firing (LinkPass's rules, lab durations), read from Prometheus' API",
                 loc="left", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The fleet simulator's report: summary.json, report.md and three plots in a directory."""
from __future__ import annotations

import dataclasses
import json
import os

from . import jobmodel

CHECKPOINT_MIN = (5, 10, 15, 30, 60, 120, 180, 240)


def write(directory: str, r, s: dict) -> list[str]:
    """Write the report of run `r` (fleet.RunResult) with summary `s`; returns the files written."""
    os.makedirs(directory, exist_ok=True)
    files = []

    def path(name):
        files.append(os.path.join(directory, name))
        return files[-1]

    with open(path("summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    sens = sensitivity(r)
    plots = _plots(directory, r, s, sens)
    files += plots
    with open(path("report.md"), "w") as f:
        f.write(markdown(r, s, sens, [os.path.basename(p) for p in plots]))
    return files


def sensitivity(r) -> list[dict]:
    """Goodput with and without LinkPass as the checkpoint interval varies (same failures)."""
    out = []
    for minutes in CHECKPOINT_MIN:
        p = dataclasses.replace(r.params, checkpoint_s=minutes * 60.0)
        wall = r.days * 86_400.0
        out.append({"checkpoint_min": minutes,
                    "with_pct": round(100 * jobmodel.run(r.hits_with, wall, p).goodput, 3),
                    "without_pct": round(100 * jobmodel.run(r.hits_without, wall, p).goodput, 3)})
    return out


def _plots(directory: str, r, s: dict, sens: list[dict]) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the report's tables still hold every figure
        return []
    out = []
    gpus = r.gpus
    # 1. lost GPU-hours over the run
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, job, colour in (("without LinkPass (checkpoint-restart)", r.without, "tab:red"),
                               ("with LinkPass", r.with_linkpass, "tab:green")):
        xs = [0.0] + [t / 86_400 for t, _ in job.timeline] + [r.days]
        ys = [0.0] + [lost / 3600 * gpus for _, lost in job.timeline]
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"{label}: goodput {100 * job.goodput:.2f} %", color=colour)
    _style(ax, f"{gpus} GPUs, scenario {r.scenario}, seed {r.seed}", "day", "GPU-hours lost (cumulative)")
    out.append(_save(plt, fig, directory, "lost-gpu-hours.png"))
    # 2. detection, localization and stall per failure kind
    kinds = sorted({o.kind for o in r.outcomes})
    if kinds:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
        for ax, (title, values_of) in zip(axes, (
                ("fault → path called bad (ms)", lambda os_: [d for o in os_ for d in o.detect_ms]),
                ("fault → link named by the coordinator (ms)",
                 lambda os_: [o.localized_ms for o in os_ if o.localized_ms is not None]),
                ("the job's stall (ms)", lambda os_: [o.stall_ms for o in os_]))):
            everything = []
            for k in kinds:
                v = sorted(values_of([o for o in r.outcomes if o.kind == k]))
                everything += v
                if v:
                    ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{k} (n={len(v)})")
            # a log axis only where the kinds span decades (ms for cuts, seconds for gray loss)
            wide = bool(everything) and min(everything) > 0 and max(everything) > 20 * min(everything)
            _style(ax, title, None, "share of cases", log_x=wide)
        out.append(_save(plt, fig, directory, "detection.png"))
    # 3. goodput against the checkpoint interval
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = [p["checkpoint_min"] for p in sens]
    ax.plot(xs, [p["without_pct"] for p in sens], "o-", color="tab:red", label="without LinkPass")
    ax.plot(xs, [p["with_pct"] for p in sens], "o-", color="tab:green", label="with LinkPass")
    _style(ax, "same failures, other checkpoint intervals", "checkpoint interval (min)", "goodput (%)", log_x=True)
    out.append(_save(plt, fig, directory, "goodput-vs-checkpoint.png"))
    return out


def _style(ax, title: str, xlabel: str | None, ylabel: str, log_x: bool = False) -> None:
    if log_x:
        ax.set_xscale("log")
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)


def _save(plt, fig, directory: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(directory, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(r, s: dict, sens: list[dict], images: list[str]) -> str:
    w, wo = s["with_linkpass"], s["without_linkpass"]
    jp = s["job_params"]
    lines = [f"# Fleet simulation: {s['gpus']} GPUs, {s['days']:g} days, scenario `{s['scenario']}`, seed {s['seed']}", "",
             "Failure models and every parameter's source: `docs/fleet-sim.md`. Figures below come from the real",
             "LinkPass detector, decision and localization code run on simulated time.", "",
             "| | goodput | restarts | GPU-hours lost |", "|---|---|---|---|",
             f"| with LinkPass | {w['goodput_pct']:.3f} % | {w['restarts']} | {w['lost_gpu_hours']:,.0f} |",
             f"| without (checkpoint-restart) | {wo['goodput_pct']:.3f} % | {wo['restarts']} | {wo['lost_gpu_hours']:,.0f} |",
             "", f"Paid: {s['paid_gpu_hours']:,.0f} GPU-hours. Failures: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())) + ".",
             "", "Where the lost time went (GPU-hours):", ""]
    for label, j in (("with", w), ("without", wo)):
        lines.append(f"- {label}: " + ", ".join(f"{k} {v:,.0f}" for k, v in j["lost_by_gpu_hours"].items()))
    lines += ["", f"Job: checkpoint every {jp['checkpoint_s'] / 60:g} min, restart {jp['restart_s'] / 60:g} min, "
                  f"NCCL gives up after {jp['nccl_timeout_s']:g} s, the network is {100 * jp['comm_fraction']:g} % of a step.",
              "", "## Per failure kind (LinkPass)", "",
              "| kind | n | detect p50 / p99 ms | stall p50 / p99 ms | localized | localize p50 ms | false findings | unrecovered |",
              "|---|---|---|---|---|---|---|---|"]
    for k, d in s["per_kind"].items():
        lines.append(f"| {k} | {d['failures']} | {d['detect_ms']['median']} / {d['detect_ms']['p99']} | "
                     f"{d['stall_ms']['median']} / {d['stall_ms']['p99']} | {d['localized_pct']} % | "
                     f"{d['localized_ms']['median']} | {d['false_findings']} | {d['unrecovered']} |")
    p, c = s["probe_overhead"], s["coordinator_load"]
    lines += ["", "## Overhead", "",
              f"- Probes: {p['paths']:,} paths; per NIC {p['tx_pps_per_nic_median']:,.0f} packets/s median "
              f"({p['tx_pps_per_nic_max']:,.0f} max), {p['link_share_pct_median']} % of a {p['link_gbps']:g} Gb/s link "
              f"({p['link_share_pct_max']} % max).",
              f"- Coordinator: {c['agents']} agents; steady {c['reports_per_s_steady']:,} reports/s carrying "
              f"{c['path_rows_per_s_steady']:,} path rows/s and {c['digests_per_s_steady']:,} digests/s (every 10 s; "
              f"whole tables instead would be {c['path_rows_per_s_whole_tables']:,} rows/s; heartbeats every 1 s); "
              f"a failure "
              f"brings {c['path_changes_per_failure_median']} path changes from {c['agents_reporting_per_failure_median']} "
              f"agents (median); localization took {c['findings_ms_median']} ms per call (max {c['findings_ms_max']} ms).",
              "", "## Checkpoint interval", "", "| checkpoint (min) | with LinkPass | without |", "|---|---|---|"]
    lines += [f"| {x['checkpoint_min']} | {x['with_pct']:.3f} % | {x['without_pct']:.3f} % |" for x in sens]
    lines += [""] + [f"![{img}]({img})" for img in images]
    lines += ["", f"Simulated in {s['sim_wall_s']} s (setup {s['setup_s']} s)."]
    return "\n".join(lines) + "\n"

"""Sweeps: many fleet-simulator runs at once, GPU counts x scenarios x checkpoint intervals x seeds.

    python -m linkpass_sim.sweep [--gpus 16384] [--days 30] [--scenarios llama3,clockwork]
                                 [--checkpoint-min 15,30,60] [--seeds 1-5]
                                 [--ray local|ADDRESS] [--cpus N] [-o json]

Each cell is one seeded `fleet.run`: the same cell gives the same result wherever it runs. So a
sweep fanned out as Ray tasks (`--ray local` starts a Ray on this machine, `--ray ADDRESS` joins
a cluster, e.g. `--ray auto` on one of its nodes) equals the same sweep run one cell after the
other in this process. A cell's result is its `fleet.summary` without the wall-clock fields.
Every `ray.*` call of the simulator is in this module (`run_on_ray`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from . import failures as fm
from . import fleet, jobmodel

# a cell's summary fields that say how long the simulation took, not what it found
WALL_FIELDS = ("sim_wall_s", "setup_s")
WALL_LOAD_FIELDS = ("findings_ms_median", "findings_ms_max")


class SweepError(ValueError):
    """A sweep's specification is wrong; the message names the option and the fix."""


@dataclass(frozen=True)
class Cell:
    gpus: int
    days: float
    scenario: str
    checkpoint_min: float
    seed: int
    restart_min: float = 10.0


def cells(gpus: Iterable[int], days: float, scenarios: Iterable[str], checkpoint_mins: Iterable[float],
          seeds: Iterable[int], restart_min: float = 10.0) -> list[Cell]:
    """Every combination, in a fixed order (GPU count, scenario, checkpoint interval, seed)."""
    out = [Cell(g, days, s, c, seed, restart_min) for g in gpus for s in scenarios for c in checkpoint_mins for seed in seeds]
    for cell in out:
        check(cell)
    return out


def check(cell: Cell) -> None:
    if cell.scenario not in fm.SCENARIOS:
        raise SweepError(f"--scenarios: {cell.scenario!r} is unknown; one of {', '.join(fm.SCENARIOS)}")
    if not cell.days > 0:
        raise SweepError(f"--days: {cell.days} must be > 0")
    try:
        fm.Shape.for_gpus(cell.gpus)
        jobmodel.JobParams(checkpoint_s=cell.checkpoint_min * 60, restart_s=cell.restart_min * 60)
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def run_cell(cell: Cell) -> dict:
    """One simulator run; its summary without wall-clock fields, with the cell that made it."""
    params = jobmodel.JobParams(checkpoint_s=cell.checkpoint_min * 60, restart_s=cell.restart_min * 60)
    s = fleet.summary(fleet.run(cell.gpus, cell.days, cell.scenario, cell.seed, params))
    for k in WALL_FIELDS:
        s.pop(k, None)
    for k in WALL_LOAD_FIELDS:
        s["coordinator_load"].pop(k, None)
    return {"cell": asdict(cell), "summary": s}


def run_serial(todo: list[Cell], progress: Callable[[str], None] | None = None) -> list[dict]:
    out = []
    for n, cell in enumerate(todo, 1):
        out.append(run_cell(cell))
        if progress:
            progress(f"{n}/{len(todo)} cells ({_label(cell)})")
    return out


def run_on_ray(todo: list[Cell], address: str = "local", cpus: int | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict]:
    """The cells as Ray tasks, one CPU each; results in the cells' order. `address` "local"
    starts a Ray of `cpus` CPUs on this machine for the sweep; otherwise Ray joins that cluster."""
    import ray  # only sweeps on Ray need it (the `coordinator` extra installs it)

    started = not ray.is_initialized()
    if started:
        kwargs = {"namespace": "linkpass-sim", "log_to_driver": False, "configure_logging": False}
        if address == "local":
            ray.init(num_cpus=cpus, include_dashboard=False, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    try:
        task = ray.remote(num_cpus=1, max_retries=2)(run_cell)
        refs = [task.remote(cell) for cell in todo]
        index = {ref: i for i, ref in enumerate(refs)}
        out: list[dict | None] = [None] * len(todo)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = index[ready[0]]
            out[i] = ray.get(ready[0])
            if progress:
                progress(f"{len(refs) - len(pending)}/{len(refs)} cells ({_label(todo[i])})")
        return out  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()


def _label(cell: Cell) -> str:
    return f"{cell.gpus} GPUs, {cell.scenario}, checkpoint {cell.checkpoint_min:g} min, seed {cell.seed}"


def aggregate(results: list[dict]) -> list[dict]:
    """Per (GPUs, scenario, checkpoint interval): median goodput with and without LinkPass over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        c = r["cell"]
        groups.setdefault((c["gpus"], c["scenario"], c["checkpoint_min"]), []).append(r["summary"])
    out = []
    for (gpus, scenario, ckpt), ss in groups.items():
        w = [s["with_linkpass"]["goodput_pct"] for s in ss]
        wo = [s["without_linkpass"]["goodput_pct"] for s in ss]
        out.append({"gpus": gpus, "scenario": scenario, "checkpoint_min": ckpt, "seeds": len(ss),
                    "goodput_with_pct": round(statistics.median(w), 3), "goodput_without_pct": round(statistics.median(wo), 3),
                    "restarts_with": statistics.median(s["with_linkpass"]["restarts"] for s in ss),
                    "restarts_without": statistics.median(s["without_linkpass"]["restarts"] for s in ss)})
    return out


def text(rows: list[dict]) -> str:
    lines = [f"{'GPUs':>7} {'scenario':<10} {'ckpt min':>8} {'seeds':>5} {'goodput with':>13} {'without':>8} "
             f"{'restarts with / without':>24}"]
    for r in rows:
        lines.append(f"{r['gpus']:>7} {r['scenario']:<10} {r['checkpoint_min']:>8g} {r['seeds']:>5} "
                     f"{r['goodput_with_pct']:>12.2f}% {r['goodput_without_pct']:>7.2f}% "
                     f"{str(r['restarts_with']) + ' / ' + str(r['restarts_without']):>24}")
    return "\n".join(lines)


def _ints(text: str, option: str) -> list[int]:
    """"1-5" or "1,3,8" (or both: "1-3,8")."""
    out = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    except ValueError:
        raise SweepError(f"{option}: {text!r} is not a list of numbers (e.g. 1-5 or 1,3,8)") from None
    if not out:
        raise SweepError(f"{option}: empty")
    return out


def _floats(text: str, option: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise SweepError(f"{option}: {text!r} is not a list of numbers (e.g. 15,30,60)") from None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linkpass_sim.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="16384", help="GPU counts, comma-separated (default 16384)")
    ap.add_argument("--days", type=float, default=30.0, help="simulated days per cell (default 30)")
    ap.add_argument("--scenarios", default="llama3,clockwork", help="comma-separated (default llama3,clockwork)")
    ap.add_argument("--checkpoint-min", default="30", help="checkpoint intervals, comma-separated (default 30)")
    ap.add_argument("--restart-min", type=float, default=10.0, help="restart overhead (default 10)")
    ap.add_argument("--seeds", default="1-5", help="seeds: 1-5, 1,3,8 (default 1-5)")
    ap.add_argument("--ray", metavar="ADDRESS", help="fan the cells out as Ray tasks: 'local' or a cluster's address")
    ap.add_argument("--cpus", type=int, help="with --ray local: CPUs to give Ray (default: all)")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text")
    a = ap.parse_args(argv)
    try:
        todo = cells(_ints(a.gpus, "--gpus"), a.days, [s.strip() for s in a.scenarios.split(",")],
                     _floats(a.checkpoint_min, "--checkpoint-min"), _ints(a.seeds, "--seeds"), a.restart_min)
    except SweepError as exc:
        ap.error(str(exc))

    def progress(msg):
        print(f"  {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    t = time.perf_counter()
    results = run_on_ray(todo, a.ray, a.cpus, progress) if a.ray else run_serial(todo, progress)
    rows = aggregate(results)
    if a.output == "json":
        print(json.dumps({"cells": results, "aggregate": rows, "wall_s": round(time.perf_counter() - t, 2)}, indent=2))
    else:
        print(text(rows))
        print(f"{len(todo)} cells in {time.perf_counter() - t:.1f} s" + (f" on Ray ({a.ray})" if a.ray else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

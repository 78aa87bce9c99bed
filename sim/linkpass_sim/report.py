"""The benchmark report format (docs/benchmarks/README.md), in one place for every benchmark
(`bench/*.py`, `sim/bench/*.py`): trial statistics, the JSON document, the progress line and
the root check they all need. Each document records the commit it ran on (and whether the tree
had uncommitted changes), so a figure quoted from it can be checked against later changes to the
code it measures."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MIN_TRIALS_FOR_P99 = 20


def tail(values: list[float], q: float = 0.99) -> float | None:
    """The q-quantile of the trials, or None when there are too few for it to mean anything.
    For a rate, whose bad tail is its low end, pass q=0.01."""
    if len(values) < MIN_TRIALS_FOR_P99:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def row(case: str, metric: str, unit: str, values: list[float], peer: str | None = None,
        peer_values: list[float] | None = None, better: str = "lower", q: float = 0.99, **extra) -> dict:
    """One benchmark row: median and tail of `values` and, when a peer was measured in the same
    run, its figures and the ratio (how many times better: peer/ours when lower is better)."""
    r = {"case": case, "metric": metric, "unit": unit, "n": len(values),
         "median": round(statistics.median(values), 3) if values else None,
         "p99": tail(values, q) if values else None}
    if peer is not None:
        r.update(peer=peer, peer_n=len(peer_values or []),
                 peer_median=round(statistics.median(peer_values), 3) if peer_values else None,
                 peer_p99=tail(peer_values, q) if peer_values else None)
        if r["median"] and r["peer_median"]:
            r["ratio"] = round(r["peer_median"] / r["median"] if better == "lower" else r["median"] / r["peer_median"], 2)
    r.update(extra)
    return r


def progress(msg: str) -> None:
    """One timestamped line of a long run's progress."""
    print(f"  {time.strftime('%H:%M:%S')} {msg}", flush=True)


def require_root() -> bool:
    if os.geteuid() != 0:
        print("this benchmark builds network namespaces: run it as root", file=sys.stderr)
        return False
    return True


def document(benchmark: str, rows: list[dict], **extra) -> dict:
    commit, dirty = checkout()
    return {"benchmark": benchmark, "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{os.cpu_count()} cores, Linux {platform.release().split('-')[0]}",
            "commit": commit, "dirty": dirty, "rows": rows, **extra}


def checkout() -> tuple[str | None, bool | None]:
    """(the commit the benchmarks' tree is at, whether tracked files differ from it), or
    (None, None) outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), None if status is None else bool(status.strip())


def write(doc: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)

"""The digest of a simulated run: what the decision code did about each network failure (its
detection times, localization, stalls, exposure, reports; wall times left out), hashed. Two
commits whose decision code behaves the same give the same digest for the same run, so a change
meant to move code without changing behaviour can be checked:

    python -m linkpass_sim.digest [--gpus 16384] [--days 30] [--seed 1]
"""
from __future__ import annotations

import argparse
import hashlib
import json

from . import fleet


def digest(r: fleet.RunResult) -> tuple[int, str]:
    """(network failures simulated, the SHA-256 of what was decided about them)."""
    rows = [[o.kind, o.t_s, o.paths, o.agents, [round(x, 6) for x in o.detect_ms], o.localized_ms, o.false_findings,
             round(o.stall_ms, 6), round(o.exposed_ms, 6), o.exposed_at_end, o.unrecovered, round(o.lost_share, 9),
             o.reports] for o in r.outcomes]
    return len(rows), hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=16_384)
    ap.add_argument("--days", type=float, default=30.0, help="simulated days (default 30: about 20 network failures)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    n, h = digest(fleet.run(args.gpus, args.days, "llama3", seed=args.seed))
    print(f"{args.gpus} GPUs, {args.days:g} days, seed {args.seed}: {n} network failures, digest {h}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

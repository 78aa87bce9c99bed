"""One rank of the demo's training job: torch.distributed all-reduce over gloo, bit-checked.

Run by the demo inside a host's namespace (`python -m linkpass.demo.job ...`), one rank per host,
bound to the host's service address so its TCP connections follow the routes LinkPass manages.
Each step "computes" (sleeps `--compute-ms`, standing in for forward/backward), then all-reduces a
gradient bucket of `--size-mb` whose values are small integers derived from (step, rank, index)
(a prime-length pattern, repeated): their float32 sum is exact, so every element of the result is
compared with the sum computed locally and any wrong result is caught. One extra element carries the stop flag (set by rank 0
when the stop file appears), so stopping costs no extra collective and every rank stops after
the same step.

Each step is one JSON line on `--out`: step, start and end (CLOCK_REALTIME ns, shared by all
namespaces of the testbed), ok. A collective that fails (gloo timeout, peer gone) is written as
{"error": ...} and the process exits with 3: the demo counts that as a job restart.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

EXIT_COLLECTIVE_FAILED = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m linkpass.demo.job")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--addr", required=True, help="this rank's service address (gloo binds to it)")
    p.add_argument("--master", required=True, help="rank 0's service address (rendezvous store)")
    p.add_argument("--port", type=int, required=True, help="rendezvous store port")
    p.add_argument("--size-mb", type=float, default=4.0, help="all-reduce bucket size, MB of float32")
    p.add_argument("--compute-ms", type=float, default=10.0, help="simulated compute per step")
    p.add_argument("--timeout-s", type=float, default=30.0, help="collective timeout (NCCL's is ~30 s)")
    p.add_argument("--start-step", type=int, default=0, help="first step (after a restart: the next one)")
    p.add_argument("--max-steps", type=int, default=1_000_000, help="bound on steps if the stop file never comes")
    p.add_argument("--stop-file", required=True, help="rank 0 ends the job after the step in which this appears")
    p.add_argument("--out", required=True, help="JSON-lines step log")
    return p.parse_args(argv)


PERIOD = 65521  # the bucket repeats a prime-length pattern: cheap to build and check, chunks can't alias


def pattern(step: int, rank: int):
    """Rank `rank`'s gradient pattern at `step`: integers in [-125, 125], so float32 sums are exact."""
    import torch
    return ((torch.arange(PERIOD, dtype=torch.int64) * 7 + (step * 13 + rank * 31)) % 251 - 125).float()


def expected_sum(step: int, world: int):
    """One period of the exact all-reduce result for `step`: the sum of every rank's pattern."""
    return sum(pattern(step, r) for r in range(world))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two cores are shared with four ranks, the agents and the fabric
    reps = max(1, round(args.size_mb * 1024 * 1024 / 4 / PERIOD))
    n = reps * PERIOD
    timeout = datetime.timedelta(seconds=args.timeout_s)
    out = open(args.out, "a", buffering=1)

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")

    try:
        store = dist.TCPStore(args.master, args.port, args.world, args.rank == 0, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=args.addr)]
        opts._timeout = timeout
        pg = dist.ProcessGroupGloo(store, args.rank, args.world, opts)
        emit({"event": "ready", "rank": args.rank, "at_ns": time.time_ns(), "elements": n})
        buf = torch.empty(n + 1)
        for step in range(args.start_step, args.start_step + args.max_steps):
            if args.compute_ms > 0:
                time.sleep(args.compute_ms / 1000)
            buf[:n].view(reps, PERIOD).copy_(pattern(step, args.rank).expand(reps, PERIOD))
            buf[n] = 1.0 if args.rank == 0 and os.path.exists(args.stop_file) else 0.0
            t0 = time.time_ns()
            pg.allreduce([buf]).wait()
            t1 = time.time_ns()
            ok = bool(torch.equal(buf[:n].view(reps, PERIOD), expected_sum(step, args.world).expand(reps, PERIOD)))
            emit({"step": step, "start_ns": t0, "end_ns": t1, "ok": ok})
            if buf[n].item() > 0:
                break
        emit({"event": "done", "rank": args.rank, "at_ns": time.time_ns()})
        return 0
    except Exception as exc:  # a collective that failed: the demo restarts the job from the next step
        emit({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              "rank": args.rank, "at_ns": time.time_ns()})
        return EXIT_COLLECTIVE_FAILED
    finally:
        out.close()


if __name__ == "__main__":
    sys.exit(main())

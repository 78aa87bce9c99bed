"""Background process behind `linkpass testbed fault flap`: takes a link down and up each period.

Bounded: it stops by itself after --duration. On SIGTERM (fault --clear, testbed down) it
leaves the link up with its routes restored. Each transition is logged with its time, so a
benchmark or the demo can line detections up against it.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from .build import load_fabric
from .faults import set_link_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="linkpass.testbed.flapper")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--link", required=True)
    ap.add_argument("--period", type=float, required=True, help="seconds per down+up cycle")
    ap.add_argument("--duration", type=float, required=True, help="stop after this many seconds")
    args = ap.parse_args(argv)

    fab = load_fabric(args.prefix)
    lk = fab.link(args.link)
    stopping = False

    def on_term(_sig, _frm):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    half = args.period / 2
    end = time.monotonic() + args.duration
    is_up = True
    try:
        while not stopping and time.monotonic() < end:
            is_up = not is_up
            t = set_link_state(fab, lk, up=is_up)[0]
            print(f"{t} {'up' if is_up else 'down'} {lk.name}", flush=True)
            deadline = time.monotonic() + half
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
    finally:
        if not is_up:
            t = set_link_state(fab, lk, up=True)[0]
            print(f"{t} up {lk.name} (stopped)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

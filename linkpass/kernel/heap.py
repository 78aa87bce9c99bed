"""The cyclic garbage collector around the fleet-sized state: millions of small, acyclic,
long-lived objects (the fabric model, every path's evidence).

Python's collector makes a full pass whenever the objects that survived since the last one
number a quarter of the older ones. While a large state is built (a 131 072-GPU fleet's
evidence: ~10^7 objects), that is a pass every few hundred thousand new objects, each walking
everything built so far, and none of them finds garbage: at 131 072 GPUs they were a third of
the simulator's set-up (14 of 40 s). Built, the state stays; out of the collector's sight, a
full pass does not walk it (a 1.3 s pause in the middle of a localization at that size).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while a large acyclic state is built; the collector as it was
    afterwards (also on error). Reference counting still frees what is dropped meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle() -> None:
    """For a process whose state is now built and lives as long as it does (the coordinator's,
    a shard's): collect once, then freeze everything out of the collector's sight. Not for a
    process that goes on with other work (a test run): what is frozen is never collected."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen() -> Iterator[None]:
    """`settle`, for a stretch of work over a large built state in a process that goes on
    afterwards (the simulator's day): everything is thawed at the end (also what was frozen
    before), so what it dropped can still be collected."""
    settle()
    try:
        yield
    finally:
        gc.unfreeze()

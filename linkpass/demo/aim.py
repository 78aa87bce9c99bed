"""Which fabric link carries the training job's traffic, so each scripted fault hits it.

Measured, not predicted: the bytes each directed link sent over a short sample, from the
interfaces' TX counters in every namespace. (Predicting each TCP flow's links from its 5-tuple
with `ip route get` matched Python sockets 20 of 20 times, yet for gloo's sockets it named the
wrong plane for two of four data flows in one run; counters need no model of the hashing.) A
ring all-reduce sends its data one way round the ring, so some links, and some directions,
carry nothing worth breaking; the fault goes where the bytes are.
"""
from __future__ import annotations

import time
from collections import Counter

from ..testbed.topology import Fabric
from ..testbed.traffic import link_counters


def measure_load(fab: Fabric, sample_s: float = 0.3) -> Counter:
    """Bytes per second each directed fabric link (link, from-node) sent over `sample_s`."""
    nodes = sorted({n for lk in fab.links.values() for n in (lk.a, lk.b)})
    before = {n: link_counters(fab, n) for n in nodes}
    time.sleep(sample_s)
    after = {n: link_counters(fab, n) for n in nodes}
    load: Counter = Counter()
    for lk in fab.links.values():
        for node in (lk.a, lk.b):
            ifname = lk.end(node)[0]
            load[(lk.name, node)] = (after[node][ifname]["tx_bytes"] - before[node][ifname]["tx_bytes"]) / sample_s
    return load


def busiest(fab: Fabric, load: Counter, kind: str, directed: bool) -> tuple[str, str | None, float]:
    """The link of `kind` (a tier of core.names: HOST_LEAF or LEAF_SPINE) carrying the most bytes per second:
    (link, from-node or None, bytes/s). With `directed`, the busiest single direction. Ties go
    to the first name."""
    best: tuple[float, str, str | None] | None = None
    for lk in sorted(fab.links.values(), key=lambda lk: lk.name):
        if lk.kind != kind:
            continue
        options = [(load[(lk.name, lk.a)], lk.a), (load[(lk.name, lk.b)], lk.b)] if directed else \
            [(load[(lk.name, lk.a)] + load[(lk.name, lk.b)], None)]
        for n, frm in options:
            if best is None or n > best[0]:
                best = (n, lk.name, frm)
    if best is None:
        raise RuntimeError(f"this testbed has no {kind} link")
    return best[1], best[2], best[0]

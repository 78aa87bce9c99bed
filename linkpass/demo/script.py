"""The demo's fault script: what breaks, where, how long, and how bad counts as "hard" or "gray".

Each entry names a tier, not a link: the demo aims it at the link of that tier that carries the
most of the training job's traffic when the fault is due (see aim.py), so every fault hits the
job. Faults run one at a time; between them the fabric recovers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.names import HOST_LEAF, LEAF_SPINE


@dataclass(frozen=True)
class Scripted:
    kind: str  # the name used in --faults and in the JSON summary
    label: str
    tier: str  # HOST_LEAF | LEAF_SPINE
    fault: str  # testbed fault kind: down | flap | loss | mtu
    params: dict = field(default_factory=dict)
    directed: bool = False  # one direction only (aimed at the busier one)
    severity: str = "hard"  # "hard" (the link passes nothing) | "gray" (it passes some)
    hold_s: float = 2.0  # how long the fault stays before the script clears it
    # the Prometheus alerts that report this fault (deploy/prometheus); heavy loss also flaps paths
    alerts: tuple[str, ...] = ()


SCRIPT = (
    Scripted("uplink-cut", "host uplink cut", HOST_LEAF, "down", alerts=("LinkPassPlaneDown",)),
    Scripted("link-down", "leaf–spine link down", LEAF_SPINE, "down", alerts=("LinkPassPathDown",)),
    Scripted("gray-loss", "20 % gray loss on a spine link", LEAF_SPINE, "loss", {"pct": 20}, severity="gray",
             hold_s=3.0, alerts=("LinkPassGrayLoss", "LinkPassPathDegraded", "LinkPassPathFlapping")),
    Scripted("flap", "flapping link (down/up every 100 ms)", HOST_LEAF, "flap", {"period": "200ms", "duration": "10s"},
             hold_s=1.5, alerts=("LinkPassPathFlapping", "LinkPassPlaneDown")),
    Scripted("one-way-loss", "30 % loss, one direction only", LEAF_SPINE, "loss", {"pct": 30}, directed=True,
             severity="gray", hold_s=3.0, alerts=("LinkPassGrayLoss", "LinkPassPathDegraded", "LinkPassPathFlapping")),
    Scripted("mtu-blackhole", "MTU black hole (packets > 1200 B dropped)", LEAF_SPINE, "mtu", {"bytes": 1200},
             severity="gray", hold_s=3.0, alerts=("LinkPassPathDegraded",)),
)
KINDS = tuple(s.kind for s in SCRIPT)
SHORT = ("uplink-cut", "gray-loss")  # what the end-to-end test runs


def select(kinds: str | None) -> tuple[Scripted, ...]:
    """The scripted faults named in a comma-separated list, in script order; all when None."""
    if not kinds:
        return SCRIPT
    asked = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = [k for k in asked if k not in KINDS]
    if unknown or not asked:
        raise ValueError(f"--faults: unknown fault kind {', '.join(unknown) or '(empty)'}; "
                         f"choose from {', '.join(KINDS)}")
    return tuple(s for s in SCRIPT if s.kind in asked)

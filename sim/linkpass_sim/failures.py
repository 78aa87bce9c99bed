"""Failure models for a training fleet, from published statistics (docs/fleet-sim.md cites each).

Pure and seeded: `draw(scenario, shape, days, rng)` gives the failures of a run as `Failure`s.
A failure is either *network* (it acts on fabric links; the simulator runs LinkPass against it)
or *other* (a GPU, a host, software: it restarts the job whether LinkPass runs or not).

Scenarios:
    llama3     the unexpected interruptions of Llama 3 405B pre-training (Meta, "The Llama 3 Herd
               of Models", 2024, §3.3.4, Table 5): 419 in 54 days on 16 384 GPUs, scaled by GPU
               count. Its network rows become fabric faults: "Network Switch/Cable" (35) a cable
               (host-leaf link down) or a leaf switch down, split as Alibaba HPN's monthly rates
               (0.057 % of NIC-ToR links, 0.051 % of ToRs; SIGCOMM 2024, §2.3); "NIC" (7) a host
               NIC down. Every other row (incl. NCCL watchdog timeouts, cause unknown) is other.
    clockwork  llama3's other rows, but every NIC-to-leaf link fails with a 5-year MTTF each, as in
               Clockwork's example (26.28 minutes to the first job failure; 5 years over 100 000
               links, our reconstruction of its link count): here 16 384 links for 16 384 GPUs.
    stress     clockwork plus flap bursts and gray (lossy) links at rates we ASSUME (no published
               per-link rate found): 1 flap burst and 1 new gray link per hour per 16 384 GPUs,
               gray loss rates drawn from CorrOpt's distribution of corrupting links' loss rates
               (Zhuo et al., SIGCOMM 2017, Table 1, as transcribed by LinkGuardian), only the
               part above 1e-4 (below it a link is not worth draining, and the detector's H0 is
               0.1 %). It exercises every fault model; its goodput is not a published figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from linkpass.core.fabric import DOWN, UP
from linkpass.core.names import LeafSpine, ThreeTier, core_name, host_index, host_name, leaf_name, link_name, spine_name

DAY_S = 86_400.0
YEAR_S = 365.0 * DAY_S

# Llama 3, Table 5: unexpected interruptions in 54 days on 16 384 GPUs
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_TOTAL = 419
LLAMA3_SWITCH_CABLE = 35
LLAMA3_NIC = 7
# Alibaba HPN §2.3, per month: share of NIC-ToR links failing, share of ToR switches crashing
HPN_LINK_MONTHLY = 0.00057
HPN_TOR_MONTHLY = 0.00051
CLOCKWORK_LINK_MTTF_S = 5 * YEAR_S
# CorrOpt Table 1 (via LinkGuardian): share of corrupting links by loss-rate decade
CORROPT_LOSS = ((1e-8, 1e-5, 0.4723), (1e-5, 1e-4, 0.1843), (1e-4, 1e-3, 0.2167), (1e-3, 1e-2, 0.1267))
GRAY_MIN_LOSS = 1e-4
ASSUMED_FLAPS_PER_HOUR_16K = 1.0
ASSUMED_GRAY_PER_HOUR_16K = 1.0
FLAP_BURST_S = (1.0, 3.0)  # assumed: a burst flaps for 1-3 s
FLAP_HALF_MS = (50, 500)  # assumed: each down and up phase lasts 50-500 ms
REPAIR_S = 4 * 3600.0  # assumed: a failed link or NIC is out this long (SWARM: "days" for optics)
SCENARIOS = ("llama3", "clockwork", "stress")

NETWORK_KINDS = ("cable", "switch", "nic", "flap", "gray")


@dataclass(frozen=True)
class Failure:
    t_s: float
    kind: str  # cable | switch | nic | flap | gray | other
    target: tuple = ()  # cable/nic: (host, plane); switch: (leaf,); flap: (host, plane); gray: (link, direction)
    duration_s: float = REPAIR_S
    loss: float = 0.0  # gray
    flap_half_ms: float = 0.0  # flap

    @property
    def network(self) -> bool:
        return self.kind in NETWORK_KINDS


@dataclass(frozen=True)
class Shape:
    """A rail-optimized fabric: `hosts` × `rails` GPUs (one NIC per GPU, one plane per rail).
    2-tier (`leaves_per_pod` 0: every leaf of a plane meets its `spines_per_pod` spines) or
    3-tier (pods of `leaves_per_pod` leaves and `spines_per_pod` spines, spine j of every pod
    meeting the `cores_per_group` cores of group j)."""

    hosts: int
    rails: int = 8
    hosts_per_leaf: int = 32
    spines_per_pod: int = 32
    leaves_per_pod: int = 0
    cores_per_group: int = 0

    @property
    def gpus(self) -> int:
        return self.hosts * self.rails

    @property
    def tiers(self) -> int:
        return 3 if self.leaves_per_pod else 2

    @property
    def leaves_per_plane(self) -> int:
        return -(-self.hosts // self.hosts_per_leaf)

    def layout(self) -> LeafSpine | ThreeTier:
        """The generator's shape of this fabric (racks of `hosts_per_leaf`), as the model is built."""
        if self.tiers == 3:
            return ThreeTier(self.hosts, self.rails, self.hosts_per_leaf, self.leaves_per_pod, self.spines_per_pod,
                             self.cores_per_group)
        return LeafSpine.racks(self.hosts, self.rails, self.hosts_per_leaf, self.spines_per_pod)

    def pod_of_leaf(self, leaf: int) -> int:
        return leaf // self.leaves_per_pod if self.tiers == 3 else 0

    @classmethod
    def for_gpus(cls, gpus: int, rails: int = 8) -> "Shape":
        """The default fabric for `gpus`: 32 hosts per leaf; up to 64 leaves per plane 2-tier,
        with as many spines as leaves up to 32; beyond, 3-tier of radix-64 switches: pods of 32
        leaves and 32 spines, 32 cores per group (up to 64 pods, 524 288 GPUs)."""
        if gpus < rails or gpus % rails:
            raise ValueError(f"gpus: {gpus} is not a positive multiple of {rails} (one host has {rails} GPUs)")
        hosts = gpus // rails
        per_leaf = min(32, hosts)
        leaves = -(-hosts // per_leaf)
        if leaves <= 64:
            return cls(hosts, rails, per_leaf, min(32, max(2, leaves)))
        if leaves > 64 * 32:
            raise ValueError(f"gpus: {gpus} needs {leaves} leaves per plane; radix-64 switches reach 2 048")
        return cls(hosts, rails, per_leaf, 32, leaves_per_pod=32, cores_per_group=32)


def _poisson_times(rate_per_s: float, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    n = rng.poisson(rate_per_s * horizon_s)
    return np.sort(rng.uniform(0.0, horizon_s, n))


def _gray_loss(rng: np.random.Generator) -> float:
    """A loss rate from CorrOpt's distribution, above GRAY_MIN_LOSS (log-uniform within a decade)."""
    bins = [(lo, hi, w) for lo, hi, w in CORROPT_LOSS if hi > GRAY_MIN_LOSS]
    weights = np.array([w for *_, w in bins])
    lo, hi, _ = bins[rng.choice(len(bins), p=weights / weights.sum())]
    lo = max(lo, GRAY_MIN_LOSS)
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def draw(scenario: str, shape: Shape, days: float, rng: np.random.Generator) -> list[Failure]:
    """The failures of `days` on `shape` under `scenario`, in time order."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r} is unknown; one of {', '.join(SCENARIOS)}")
    horizon = days * DAY_S
    scale = shape.gpus / LLAMA3_GPUS
    per_s = scale / (LLAMA3_DAYS * DAY_S)
    out: list[Failure] = []
    other = LLAMA3_TOTAL - LLAMA3_SWITCH_CABLE - LLAMA3_NIC
    out += [Failure(float(t), "other") for t in _poisson_times(other * per_s, horizon, rng)]

    def host_plane():
        return (host_name(int(rng.integers(shape.hosts))), int(rng.integers(shape.rails)))

    if scenario == "llama3":
        links = shape.hosts * shape.rails
        tors = shape.leaves_per_plane * shape.rails
        switch_share = tors * HPN_TOR_MONTHLY / (tors * HPN_TOR_MONTHLY + links * HPN_LINK_MONTHLY)
        for t in _poisson_times(LLAMA3_SWITCH_CABLE * per_s, horizon, rng):
            if rng.random() < switch_share:
                plane = int(rng.integers(shape.rails))
                leaf = leaf_name(plane, int(rng.integers(shape.leaves_per_plane)))
                out.append(Failure(float(t), "switch", (leaf,)))
            else:
                out.append(Failure(float(t), "cable", host_plane()))
        out += [Failure(float(t), "nic", host_plane()) for t in _poisson_times(LLAMA3_NIC * per_s, horizon, rng)]
    else:
        links = shape.hosts * shape.rails
        out += [Failure(float(t), "cable", host_plane())
                for t in _poisson_times(links / CLOCKWORK_LINK_MTTF_S, horizon, rng)]
    if scenario == "stress":
        host_leaf = shape.layout().host_leaf
        for t in _poisson_times(ASSUMED_FLAPS_PER_HOUR_16K * scale / 3600, horizon, rng):
            out.append(Failure(float(t), "flap", host_plane(), duration_s=float(rng.uniform(*FLAP_BURST_S)),
                               flap_half_ms=float(rng.uniform(*FLAP_HALF_MS))))
        for t in _poisson_times(ASSUMED_GRAY_PER_HOUR_16K * scale / 3600, horizon, rng):
            host, plane = host_plane()
            leaf = leaf_name(plane, host_leaf[host_index(host)])
            direction = UP if rng.random() < 0.5 else DOWN
            if rng.random() < 0.5:  # a host's cable or a link above its leaf, either way
                link = link_name(host, leaf)
            else:
                pod = shape.pod_of_leaf(host_leaf[host_index(host)])
                # a 3-tier fabric: half of them a spine-core link of the leaf's pod
                upper = shape.tiers == 3 and rng.random() < 0.5
                j = int(rng.integers(shape.spines_per_pod))
                spine = spine_name(plane, pod * shape.spines_per_pod + j)
                if upper:
                    link = link_name(spine, core_name(plane, j * shape.cores_per_group
                                                      + int(rng.integers(shape.cores_per_group))))
                else:
                    link = link_name(leaf, spine)
            out.append(Failure(float(t), "gray", (link, direction), loss=_gray_loss(rng)))
    out.sort(key=lambda f: f.t_s)
    return out

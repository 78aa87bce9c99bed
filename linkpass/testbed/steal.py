"""Time the hypervisor took from this guest's CPUs, for benchmarks whose trials last milliseconds.

On a virtual machine a vCPU that wants to run can be kept waiting while the host runs something
else ("steal"). Nothing in the guest runs then, at any priority, so a fault → route trial that
falls into such a wait measures the hypervisor as much as the agent. The kernel counts it per
CPU in /proc/stat, in clock ticks (USER_HZ, 10 ms on Linux): too coarse to time a trial, enough
to say that one was stretched by a wait of that order. `sample()` before and after a trial,
`stolen_ms(before, after)` the most any one CPU lost in between.
"""
from __future__ import annotations

import os

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
STEAL_FIELD = 8  # cpuN user nice system idle iowait irq softirq steal ... (proc(5))


def parse(text: str) -> list[int]:
    """Per CPU (cpu0, cpu1, ...), the steal it has counted, in ns; [] when the file says none
    (a kernel without the field)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
            continue
        if len(parts) <= STEAL_FIELD or not parts[STEAL_FIELD].isdigit():
            return []
        out.append(int(parts[STEAL_FIELD]) * TICK_NS)
    return out


def sample(path: str = "/proc/stat") -> list[int]:
    with open(path) as f:
        return parse(f.read())


def stolen_ms(before: list[int], after: list[int]) -> float:
    """The most steal any one CPU counted between two samples, in ms (a multiple of the tick:
    one tick may be far less stolen time, two or more ticks is at least one tick's worth)."""
    if len(before) != len(after):
        return 0.0
    return round(max((a - b for a, b in zip(after, before)), default=0) / 1e6, 3)

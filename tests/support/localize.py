"""Observations for the localizer: what agents would see of a set of broken links, untraced."""
from __future__ import annotations


def untraced_observations(model, plan, truth, *, noisy=(), seed=0):
    """Per planned path: bad where its probes or its replies cross a directed link of `truth`,
    with the direction it breaks. Replies take a route of ECMP's choosing (not the probes'), and
    are not traced: the observation carries no reverse links, as the coordinator's do. Noisy
    agents call half their paths bad at random and their truly bad ones good half the time."""
    import random  # noqa: PLC0415

    from linkpass.core.localize import Observation  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for host, paths in plan.paths.items():
        for n, p in enumerate(paths):
            fwd = model.node_path(host, p.peer, p.plane, p.spine, p.core)
            spines, cores = model.spines_per_pod(p.plane), model.cores_per_group(p.plane)
            rev = model.node_path(p.peer, host, p.plane, rng.randrange(spines) if spines else None,
                                  rng.randrange(cores) if cores else None)
            f, r = any(d in truth for d in fwd), any(d in truth for d in rev)
            bad, direction = f or r, ("both" if f and r else "forward" if f else "reverse" if r else None)
            if host in noisy:
                if bad and rng.random() < 0.5:
                    bad, direction = False, None
                elif not bad and rng.random() < 0.5:
                    bad, direction = True, rng.choice(("forward", "reverse", "both", None))
            out.append(Observation(host, f"{host}/{n}", fwd, None, bad, direction))
    return out

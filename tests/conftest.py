"""The suite's tier rules and shared fixtures.

Tiers: every test carries exactly one of four markers, from its module's `pytestmark` or its
own decorator (a module whose tests differ marks each test); collection fails when a test has
none or two, so `-m` selects every test into exactly one tier.

- `unit`: needs no root and starts no service. Pure code, files under tmp_path, short-lived
  subprocesses that exit by themselves (the CLI, gcc, the simulator's command), an in-process
  SQLite file. The fast tier: `make test-unit`.
- `root`: needs root and the kernel: network namespaces, routes, nft. A test that also starts a
  service (agents, Ray, FRR) is `root`: it cannot run without root. Skipped when not root.
- `service`: starts a real service without needing root: Ray, the coordinator's HTTP server,
  a `linkpass coordinator` process, gloo ranks and torch.
- `sim`: seeded fleet-simulator runs (tests/test_fleet_sim.py): pure and deterministic, but whole
  simulated days, calibration over hundreds of trials, two processes compared: ~2 CPU-minutes.

    make test-unit                 the unit tier (pytest -m unit)
    pytest -m service              the service tier (likewise -m sim, -m root)
    sudo make test                 the import contracts (lint-imports), then every test

Shared code lives in tests/support/, by subject; no test module imports another test module or this file
(tests/test_layout.py checks).

Every testbed a test makes carries a prefix unique to this pytest run (support.testbed.prefix_for), and
is torn down in a finally block, also when the test fails; a session-end hook reaps anything
left over.
"""
from __future__ import annotations

import os

import pytest

from support.fleet import four_agents_registered
from support.testbed import prefix_for

IS_ROOT = os.geteuid() == 0
TIERS = ("unit", "root", "service", "sim")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if wrong:
        raise pytest.UsageError("each test needs exactly one tier marker, unit, root, service or sim "
                                "(tests/conftest.py says which):\n  " + "\n  ".join(wrong))
    if IS_ROOT:
        return
    skip = pytest.mark.skip(reason="needs root to create network namespaces (run `sudo make test`)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if not IS_ROOT:
        return
    from linkpass.testbed import build

    for letter in "abcdefghijklmnopqrstuvwxyz":
        if build.namespaces_with_prefix(prefix_for(letter)) or build.root_links_with_prefix(prefix_for(letter)):
            build.down(prefix_for(letter))


@pytest.fixture(scope="session")
def fabric():
    """The default preset (4 hosts, 2 planes, 2 leaves + 2 spines per plane), shared."""
    from linkpass.testbed import build, topology

    prefix = prefix_for("d")
    build.clean(prefix)
    fab = build.up(topology.preset("default"), prefix)
    try:
        yield fab
    finally:
        build.down(prefix)


@pytest.fixture
def clean_faults(fabric):
    """Faults a test applies on the shared fabric are cleared after it, pass or fail."""
    from linkpass.testbed import faults

    yield fabric
    faults.clear(fabric.prefix)


@pytest.fixture
def coord(tmp_path):
    """A Coordinator (no Ray, no sockets) with h0..h3 registered at t=1000 (support.fleet.four_agents_registered)."""
    c, store = four_agents_registered(str(tmp_path / "c.db"))
    yield c
    store.close()

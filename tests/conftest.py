"""The suite's tier rules.

A test's tier is the folder it lives in; tests/<tier>/ holds the tests of one tier, and this file
marks every test collected there with that tier's marker, so `-m` selects every test into exactly
one tier. Collection fails for a test outside the four folders, and for a test whose own marker
(a decorator or its module's `pytestmark`) names another tier than its folder: a test is filed
where it runs.

- `unit/`: needs no root and starts no service. Pure code, files under tmp_path, short-lived
  subprocesses that exit by themselves (the CLI, gcc, the simulator's command), an in-process
  SQLite file. The fast tier: `make test-unit`.
- `root/`: needs root and the kernel: network namespaces, routes, nft. A test that also starts a
  service (agents, Ray, FRR) is `root`: it cannot run without root. Skipped when not root.
- `service/`: starts a real service without needing root: Ray, the coordinator's HTTP server,
  a `linkpass coordinator` process, gloo ranks and torch.
- `sim/`: seeded fleet-simulator runs (tests/sim/test_fleet_sim.py): pure and deterministic, but
  whole simulated days, calibration over hundreds of trials, two processes compared: ~2 CPU-minutes.

    make test-unit                 the unit tier (pytest tests/unit)
    pytest -m service              the service tier (likewise -m sim, -m root, or the folder)
    sudo make test                 the import contracts (lint-imports), then every test

Each tier's fixtures live in its folder's conftest.py. Shared code lives in tests/support/, by
subject; no test module imports another test module or a conftest (tests/unit/test_layout.py
checks).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0
TIERS = ("unit", "root", "service", "sim")
TESTS = Path(__file__).parent
PACKAGE = [sys.executable, str(TESTS.parent / "deploy" / "package.py")]  # the fleet packages' builder


def folder_tier(item) -> str | None:
    """The tier folder under tests/ that holds the item's file, or None."""
    try:
        first = Path(item.path).resolve().relative_to(TESTS.resolve()).parts[0]
    except ValueError:
        return None
    return first if first in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        tier = folder_tier(item)
        own = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if tier is None:
            wrong.append(f"{item.nodeid}: not in a tier folder (tests/unit, root, service or sim)")
        elif own and own != [tier]:
            wrong.append(f"{item.nodeid}: in tests/{tier}/ but marked {', '.join(own)}")
        else:
            item.add_marker(getattr(pytest.mark, tier))
    if wrong:
        raise pytest.UsageError("each test's tier is its folder, and its own marker, if any, must agree "
                                "(tests/conftest.py says which):\n  " + "\n  ".join(wrong))
    if IS_ROOT:
        return
    skip = pytest.mark.skip(reason="needs root to create network namespaces (run `sudo make test`)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


# ---- fixtures more than one tier uses ------------------------------------------------------------

@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist (`package.py wheel`), then the .deb made from that wheel."""
    out = tmp_path_factory.mktemp("dist")
    for args in (["wheel", "--out", str(out)], None):
        if args is None:
            wheel = next(out.glob("linkpass-*.whl"))
            args = ["deb", "--out", str(out), "--wheel", str(wheel)]
        run = subprocess.run(PACKAGE + args, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "package: wrote" in run.stdout  # the progress lines a person watching sees
    return {"wheel": next(out.glob("linkpass-*.whl")), "sdist": next(out.glob("linkpass-*.tar.gz")),
            "deb": next(out.glob("linkpass_*.deb"))}

"""Rules about the layout itself: test modules stand alone (shared code lives in tests/support/),
each import contract in pyproject.toml breaks when a deliberate violation is added, and the C
sources' copies of shared constants agree with core/constants.py."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_test_module_imports_another_or_the_conftest():
    wrong = {}
    for path in sorted(TESTS.rglob("*.py")):  # every tier's folder, its conftest, and support/
        bad = sorted(n for n in imported_names(path)
                     if n.split(".")[0] in ("tests", "conftest") or n.split(".")[0].startswith("test_"))
        if bad:
            wrong[str(path.relative_to(TESTS))] = bad
    assert not wrong, f"import shared code from support/ instead: {wrong}"


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


# one deliberate violation per contract: (file, line appended to it) pairs
VIOLATIONS = {
    "layers": [("linkpass/kernel/proc.py", "from linkpass.agent import daemon")],
    "acyclic": [("linkpass/core/decide.py", "from . import decisions"),
                ("linkpass/core/decisions.py", "from . import decide")],
    "core-pure": [("linkpass/core/decide.py", "import gc")],
    "config-pure": [("linkpass/agent/config.py", "import os")],
    "control-pure": [("linkpass/control/reports.py", "import time")],
    "control-path": [("linkpass/agent/rates.py", "from linkpass.coordinator import store")],
    "sim": [("sim/linkpass_sim/digest.py", "from linkpass.probe import engine")],
    "testbed": [("linkpass/doctor/checks.py", "from linkpass.testbed import build")],
    "rdma-base": [("rdma/linkpass_rdma/entropy.py", "from linkpass.agent import routes")],
    "rdma-users": [("linkpass/agent/rates.py", "import linkpass_rdma")],
    "ray": [("linkpass/coordinator/store.py", "import ray")],
    "pg8000": [("linkpass/coordinator/auth.py", "import pg8000")],
    "cryptography": [("linkpass/coordinator/auth.py", "import cryptography")],
    "pyroute2": [("linkpass/agent/netlink.py", "import pyroute2")],
    "prometheus_client": [("linkpass/agent/rates.py", "import prometheus_client")],
    "yaml": [("linkpass/cli/times.py", "import yaml")],
}


def lint_copy(tmp_path: Path, appended=()) -> subprocess.CompletedProcess:
    """`lint-imports` over a copy of the three packages and pyproject.toml, with lines appended."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "build")
    for part in ("linkpass", "rdma/linkpass_rdma", "sim/linkpass_sim", "lint"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for rel, line in appended:
        with open(tmp_path / rel, "a") as f:
            f.write(f"\n{line}\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{tmp_path}/rdma:{tmp_path}/sim"}
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-logo", "--no-cache"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_every_contract_has_a_violation_that_shows_it_can_fail():
    assert sorted(c["id"] for c in contracts()) == sorted(VIOLATIONS)


def test_the_copy_the_violations_are_added_to_keeps_every_contract(tmp_path):
    out = lint_copy(tmp_path)
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("cid", sorted(VIOLATIONS))
def test_each_contract_breaks_on_its_violation(tmp_path, cid):
    out = lint_copy(tmp_path, VIOLATIONS[cid])
    name = next(c["name"] for c in contracts() if c["id"] == cid)
    flat = " ".join(out.stdout.split())  # the tool wraps long names over lines
    assert out.returncode == 1 and f"{name} BROKEN" in flat, out.stdout + out.stderr


def test_the_c_sources_copies_of_shared_constants_match_core_constants():
    """C cannot import core/constants.py; its few copies are checked against it instead."""
    from linkpass.core import constants as K, wire as W

    copies = {"linkpass/probe/probe_wire.h": {"ROCE_PORT": str(K.ROCE_PORT), "MAX_PAD": str(W.MAX_PAD)},
              "rdma/entropy_reader.c": {"DEFAULT_PATH": f'"{K.ENTROPY_PATH}"'},
              "rdma/entropy_table.h": {"LPE_DEFAULT_PATH": f'"{K.ENTROPY_PATH}"'}}
    for path, defines in copies.items():
        text = (ROOT / path).read_text()
        for name, value in defines.items():
            found = re.search(rf"^#define {name} (.+)$", text, re.M)
            assert found and found.group(1).strip() == value, f"{path}: #define {name} should be {value}"

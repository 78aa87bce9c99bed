"""Rules about the layout itself: test modules stand alone (shared code lives in tests/support/), and
the import contracts in pyproject.toml name every part of LinkPass they must keep out, and the C
sources' copies of shared constants agree with core/constants.py."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest


TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
PURE = {"linkpass", "linkpass.core", "linkpass.agent", "linkpass.agent.config"}  # what the simulator and the
# agent's config may import: core, and the config


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


def linkpass_modules() -> set[str]:
    out = set()
    for path in (ROOT / "linkpass").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def contract(cid: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c.get("id") == cid)


@pytest.mark.parametrize("cid", ["agent-pure", "sim", "control-pure"])
def test_the_pure_contracts_forbid_every_other_part_of_linkpass(cid):
    forbidden = contract(cid)["forbidden_modules"]
    covered = lambda m: any(m == f or m.startswith(f + ".") for f in forbidden)  # noqa: E731
    # the contract's own modules may import one another, and their package's __init__
    own = set(contract(cid)["source_modules"])
    own |= {m.rsplit(".", 1)[0] for m in own}
    missing = sorted(m for m in linkpass_modules() - PURE - own
                     if not m.startswith("linkpass.core.") and not covered(m))
    assert not missing, f"add these to the {cid!r} contract's forbidden_modules in pyproject.toml: {missing}"


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

"""Rules about the layout itself: test modules stand alone (shared code lives in helpers.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).parent
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
    for path in sorted(TESTS.glob("*.py")):
        bad = sorted(n for n in imported_names(path)
                     if n.split(".")[0] in ("tests", "conftest") or n.split(".")[0].startswith("test_"))
        if bad:
            wrong[path.name] = bad
    assert not wrong, f"import shared code from helpers.py instead: {wrong}"

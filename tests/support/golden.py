"""Golden-file comparison for the CLI's renderings (files in tests/golden/).

Regenerate golden files after an intended change:
LINKPASS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/...
"""
from __future__ import annotations

import os

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")  # tests/golden


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/<name>; LINKPASS_UPDATE_GOLDEN=1 rewrites it instead."""
    path = os.path.join(GOLDEN, name)
    if os.environ.get("LINKPASS_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return
    assert os.path.exists(path), f"{path} is missing: run with LINKPASS_UPDATE_GOLDEN=1 once to write it"
    with open(path) as f:
        want = f.read()
    assert text == want, f"output differs from {path} (LINKPASS_UPDATE_GOLDEN=1 rewrites it if intended)"

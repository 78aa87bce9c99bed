"""`linkpass demo` end to end, as `make demo` runs it: passes, and leaves nothing behind."""
from __future__ import annotations

import subprocess
import sys

import pytest

from linkpass.testbed import build

from conftest import prefix_for

pytestmark = pytest.mark.root


def test_demo_runs_clean_and_tears_down():
    prefix = prefix_for("m")
    out = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--prefix", prefix], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo passed" in out.stdout
    assert "48/48 paths deliver" in out.stdout
    assert "lossy link, forward" in out.stdout and "clean" in out.stdout
    assert "route to h3 moved to plane [1]" in out.stdout and "route to h0 moved to plane [1]" in out.stdout
    assert "h0 uses both planes again" in out.stdout
    assert not build.namespaces_with_prefix(prefix) and not build.root_links_with_prefix(prefix)

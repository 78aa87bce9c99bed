"""The unit tier's fixtures."""
from __future__ import annotations

import pytest

from support.fleet import four_agents_registered


@pytest.fixture
def coord(tmp_path):
    """A Coordinator (no Ray, no sockets) with h0..h3 registered at t=1000 (support.fleet.four_agents_registered)."""
    c, store = four_agents_registered(str(tmp_path / "c.db"))
    yield c
    store.close()

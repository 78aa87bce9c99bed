"""The root tier's fixtures: the shared testbed.

Every testbed a test makes carries a prefix unique to this pytest run (support.testbed.prefix_for),
and is torn down in a finally block, also when the test fails; a session-end hook reaps anything
left over.
"""
from __future__ import annotations

import os

import pytest

from support.testbed import prefix_for

IS_ROOT = os.geteuid() == 0


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

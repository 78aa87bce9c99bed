"""A free TCP port, on loopback and on the testbed's management address."""
from __future__ import annotations


def free_port() -> int:
    """A TCP port free on every address right now: on loopback, and on the management address
    the testbed's namespaces reach. Below the ephemeral range, as the demo picks the
    coordinator's: one the kernel hands out (bind to 0) can be taken by Ray's own outgoing
    connections before the actor that is given it binds it."""
    from linkpass.testbed.ports import free_port as lab_port

    return lab_port()

"""What the testbed benchmarks that run agents share (bench/failover.py and coordinator.py):
which hosts run them and their flap-damping half-life. No benchmark imports
another; both import this, and the simulator's calibration reads the agents' set-up from here.
The timed fault trials themselves run on the testbed: linkpass/testbed/trials.py."""
from __future__ import annotations

A, B = 0, 2  # the two hosts with agents (leaf 0 and leaf 1)
# Flap damping with its default 10 s half-life would (rightly) call a link that fails every few
# seconds flapping and keep it out; repeated trials are that link. The benchmarks' agents use a
# 1 s half-life so every trial starts undamped.
FLAP_HALF_LIFE_MS = 1000

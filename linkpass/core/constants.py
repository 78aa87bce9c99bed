"""Numbers that several layers share: ports, protocol numbers, cadences. Each is defined here once.

Pure: importing this module costs nothing, so the simulator, the CLI and the daemons can all read
the same value without importing each other.
"""
from __future__ import annotations

# ---- ports -------------------------------------------------------------------------------------
ROCE_PORT = 4791  # RoCEv2's UDP destination port: probes and discovery hash like RDMA traffic
PROBE_PORT_BASE = 49152  # the agent's probe and discovery source ports start here (mlx5: 0xC000 | 14 bits)
DISCOVERY_PORTS = 32  # source ports swept per (NIC, peer) by default
AGENT_API_PORT = 9471  # the agent's local query API (127.0.0.1 only) and /metrics
AGENT_METRICS_PORT = 9472  # the agent's /metrics and /healthz for Prometheus, on `metrics.address`
COORDINATOR_PORT = 9470
COORDINATOR_LISTEN = f"127.0.0.1:{COORDINATOR_PORT}"
COORDINATOR_URL = f"https://{COORDINATOR_LISTEN}"  # HTTPS by default (coordinator/tls.py)

# ---- kernel ------------------------------------------------------------------------------------
RTPROT_LINKPASS = 176  # route protocol of LinkPass-owned routes: unassigned in iproute2's rt_protos
ENTROPY_PATH = "/run/linkpass/entropy"  # the entropy table's default file (tmpfs; a directory only root can write)

# ---- cadences ----------------------------------------------------------------------------------
BATCH_S = 0.01  # the agent takes on-time replies this often (RTT, delay, good-probe counts; hold-down timers)
ENTROPY_HEARTBEAT_S = 0.1  # the entropy writer's heartbeat (readers treat a silent writer as gone)
# confirmation rounds (probe core): at most this many per peer a second, this many at once; a
# round is one probe per path to the peer, sent on each miss of a streak up to the one that makes
# a path DOWN (miss_threshold rounds a DOWN: the burst covers four paths to a peer failing at once)
CONFIRM_PER_PEER_PER_S = 20.0
CONFIRM_BURST = 12
# how far apart in time a host stall (a thread or softirq kept waiting) may reach a peer's paths:
# an on-time answer on one path confirms another's DOWN only for a probe sent this long after the
# DOWN path's streak began, and the probe core sends the DOWN's round no sooner. Measured on the
# testbed (2 agents, 9 min, 2 287 DOWNs that late replies undid): of the other paths a stall
# reached after the one it silenced, 99 % within 0.33 ms with two CPU burners, 97 % within 1 ms
# calm, a few up to 2.4 ms (those stood under a lateness allowance, which holds a DOWN until a
# stall is ruled out). 1.5 ms keeps the simulator's harsher model (every path reached at a
# uniform random time in 2 ms, tests/sim/test_host_lateness.py) at 0 false route changes; 1.25
# does not
HOST_STALL_SPREAD_NS = 1_500_000
# a stall ends on a peer's paths up to a spread apart too, and a path's last late probe may have
# been sent up to a probe interval and a timeout before its stall ended: a DOWN path's miss of a
# probe sent this long after every other path's last late or missed one is not that stall's (a
# held DOWN is acted on then, agent/failover.py). In the simulator's model above, over ten seeds,
# 3.5 ms adds no false route change to those the model makes without this rule; 1.5 ms adds one
HOST_STALL_END_MARGIN_NS = 3_500_000
REPORT_HEARTBEAT_S = 1.0  # an agent with nothing to report still reports this often (the coordinator's liveness)
COORDINATOR_TICK_S = 0.1  # the coordinator runs liveness and localization this often

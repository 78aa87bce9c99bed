"""doctor: the facts of a host where every check passes (NICS, PEERS, BASELINE, ...)."""
from __future__ import annotations

from linkpass.doctor import checks as D


NICS = (D.NicCfg(0, "p0", "198.18.64.1", "198.18.64.0"), D.NicCfg(1, "p1", "198.18.72.1", "198.18.72.0"))
PEERS = (D.PeerCfg("h1", "198.18.0.2"), D.PeerCfg("h2", "198.18.0.3"))
ALL_CAPS = (1 << D.CAP_NET_ADMIN) | (1 << D.CAP_NET_RAW) | (1 << D.CAP_SYS_NICE)
BASELINE = {"dst": "198.18.0.0/20", "protocol": "static", "flags": [],
            "nexthops": [{"gateway": "198.18.64.0", "dev": "p0", "flags": []},
                         {"gateway": "198.18.72.0", "dev": "p1", "flags": []}]}
DEFAULT_ROUTE = {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0", "flags": []}


def healthy() -> D.Facts:
    """A host where every check passes."""
    return D.Facts(
        netns=None,
        sysctl={"net.ipv4.fib_multipath_hash_policy": "1", "net.ipv4.conf.all.rp_filter": "0",
                "net.ipv4.conf.default.rp_filter": "0", "net.ipv4.conf.p0.rp_filter": "2",
                "net.ipv4.conf.p1.rp_filter": "0", "net.ipv4.icmp_errors_use_inbound_ifaddr": "1",
                "net.ipv4.ip_forward": "0", "net.ipv4.ip_local_port_range": "32768 49151",
                "net.ipv4.ip_local_reserved_ports": ""},
        cap_eff=ALL_CAPS, uid=0, config_path="/etc/linkpass/agent.yaml", nics=NICS, peers=PEERS,
        links={"p0": {"operstate": "UP", "flags": ["UP", "LOWER_UP"], "addrs": ["198.18.64.1/31"]},
               "p1": {"operstate": "UP", "flags": ["UP", "LOWER_UP"], "addrs": ["198.18.72.1/31"]}},
        neigh={"p0": {"198.18.64.0": ["REACHABLE"]}, "p1": {"198.18.72.0": ["PERMANENT"]}},
        peer_routes={"198.18.0.2": [DEFAULT_ROUTE, BASELINE], "198.18.0.3": [BASELINE]},
        rdma=[{"name": "mlx5_0", "ports": {"1": "4: ACTIVE"}, "netdevs": ["p0"]},
              {"name": "mlx5_1", "ports": {"1": "4: ACTIVE"}, "netdevs": ["p1"]}],
        clock={"state": 0, "status": 0x2001, "esterror_us": 12, "maxerror_us": 40},
        agent_rows=[{"peer": "h1", "plane": 0, "state": "up"}, {"peer": "h1", "plane": 1, "state": "up"}],
        coordinator_url="https://198.19.0.1:9470", coordinator_whoami={"name": "fleet-agents", "role": "agent"},
    )

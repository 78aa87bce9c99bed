"""Which UDP source port a RoCEv2 queue pair's packets carry, and how to choose it. Pure.

The fabric hashes a RoCEv2 packet onto a path by its 5-tuple, and the only field of it an RDMA
application controls is the UDP source port. LinkPass probes each path with its own source port
and publishes the healthy ones in the entropy table; a queue pair follows a path by making its
packets carry one of those ports.

On Linux (rxe, and mlx5 without a port override) an RC QP's source port is derived from the
IPv6-style flow label of its GRH, set when the QP goes INIT -> RTR (kernel
`rdma_get_udp_sport`):

    flow label 0  ->  the kernel derives one from the two QP numbers (`rdma_calc_flow_label`)
    port = 0xC000 | (fl[13:0] XOR fl[19:14])

so any port in 0xC000..0xFFFF is reachable by choosing the flow label, before the QP connects.
mlx5 can also re-path a QP already in RTS (`mlx5dv_modify_qp_udp_sport`); rxe cannot, so a QP
there moves by being replaced (see qp.py). UD QPs keep one fixed port on rxe.
"""
from __future__ import annotations

ROCE_V2_DPORT = 4791
SPORT_MIN = 0xC000  # IB_ROCE_UDP_ENCAP_VALID_PORT_MIN: the 14-bit range a flow label can reach
SPORT_MAX = 0xFFFF
FLOW_LABEL_MASK = 0xFFFFF


def default_flow_label(local_qpn: int, remote_qpn: int) -> int:
    """The flow label the kernel picks when the application leaves it 0."""
    fl = (local_qpn * remote_qpn) & 0xFFFFFFFFFFFFFFFF
    fl ^= fl >> 20
    fl ^= fl >> 40
    return fl & FLOW_LABEL_MASK


def sport_of_flow_label(flow_label: int) -> int:
    """The UDP source port of a RoCEv2 packet whose GRH carries `flow_label` (non-zero)."""
    fl = flow_label & FLOW_LABEL_MASK
    low = (fl & 0x03FFF) ^ ((fl & 0xFC000) >> 14)
    return SPORT_MIN | low


def qp_sport(flow_label: int, local_qpn: int, remote_qpn: int) -> int:
    """The source port an RC QP's packets carry, given the flow label it was connected with."""
    fl = flow_label & FLOW_LABEL_MASK
    return sport_of_flow_label(fl if fl else default_flow_label(local_qpn, remote_qpn))


def flow_label_for_sport(sport: int) -> int:
    """A non-zero flow label that makes an RC QP's packets carry `sport` (0xC000..0xFFFF)."""
    if isinstance(sport, bool) or not isinstance(sport, int) or not SPORT_MIN <= sport <= SPORT_MAX:
        raise ValueError(f"source port {sport!r}: a RoCEv2 flow label reaches only {SPORT_MIN}..{SPORT_MAX}; "
                         f"LinkPass probes from that range, so take the port from the entropy table")
    low = sport & 0x03FFF
    # 0 would mean "let the kernel choose"; for the one port whose low bits are 0, a set high
    # bit cancels itself out
    return low if low else (1 << 14) | 1


def choose_port(ports: tuple[int, ...] | list[int], key: int) -> int:
    """One of the table's ports for a connection identified by `key` (e.g. a QP index), spread
    evenly; the same key keeps its port while the set does not change."""
    if not ports:
        raise ValueError("no ports to choose from")
    return ports[key % len(ports)]

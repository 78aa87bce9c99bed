"""RoCEv2 source-port steering by flow label, against the kernel's formula and the ports a
capture on the testbed showed for rxe RC QPs (pure)."""
from __future__ import annotations

import pytest

from linkpass_rdma import steer


@pytest.mark.parametrize("flow_label,port", [(0x12345, 58177), (0xABCDE, 64756), (0x00001, 49153)])
def test_flow_labels_give_the_ports_seen_on_the_wire(flow_label, port):
    assert steer.sport_of_flow_label(flow_label) == port


def test_every_port_of_the_roce_range_is_reached_by_a_nonzero_flow_label():
    for port in range(steer.SPORT_MIN, steer.SPORT_MAX + 1):
        fl = steer.flow_label_for_sport(port)
        assert 0 < fl <= steer.FLOW_LABEL_MASK
        assert steer.qp_sport(fl, 0x11, 0x12) == port


def test_a_zero_flow_label_is_the_kernels_choice_from_the_qp_numbers():
    fl = steer.default_flow_label(0x11, 0x12)
    assert fl == (0x11 * 0x12) & 0xFFFFF
    assert steer.qp_sport(0, 0x11, 0x12) == steer.sport_of_flow_label(fl)
    big = steer.default_flow_label(0xFFFFFF, 0xFFFFFE)  # 24-bit QPNs: the product folds down to 20 bits
    assert 0 <= big <= steer.FLOW_LABEL_MASK


@pytest.mark.parametrize("bad", [0, 4791, 49151, 65536, -1, True, "49152", 49152.0])
def test_a_port_outside_the_range_is_refused_with_the_range_named(bad):
    with pytest.raises(ValueError, match="49152..65535"):
        steer.flow_label_for_sport(bad)


def test_choose_port_spreads_keys_and_refuses_an_empty_set():
    ports = (49152, 49153, 49160)
    assert [steer.choose_port(ports, k) for k in range(6)] == [49152, 49153, 49160] * 2
    with pytest.raises(ValueError):
        steer.choose_port((), 0)

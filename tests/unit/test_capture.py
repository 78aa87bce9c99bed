"""The wire parser behind the testbed's captures (pure): IPv4/UDP frames with or without a VLAN
tag give their flow; anything else, or a frame shorter than its headers claim, gives None."""
from __future__ import annotations

import socket
import struct

import pytest

from linkpass.testbed.capture import roce_bth, udp_of


def _frame(sport=49152, dport=4791, proto=17, vlan=False, ihl=5, frag=0, payload=b"x" * 12):
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    options = b"\0" * ((ihl - 5) * 4)
    ip = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, ihl * 4 + len(udp), 1, frag, 64, proto, 0,
                     socket.inet_aton("198.18.64.1"), socket.inet_aton("198.18.64.7")) + options
    eth = b"\x02" * 6 + b"\x04" * 6 + (b"\x81\x00\x00\x05" if vlan else b"") + b"\x08\x00"
    return eth + ip + udp


@pytest.mark.parametrize("vlan,ihl", [(False, 5), (True, 5), (False, 7)])
def test_a_udp_frame_gives_its_flow(vlan, ihl):
    assert udp_of(_frame(vlan=vlan, ihl=ihl)) == ("198.18.64.1", "198.18.64.7", 49152, 4791, ihl * 4 + 20)


def test_other_protocols_fragments_and_truncated_frames_give_none():
    assert udp_of(_frame(proto=6)) is None
    assert udp_of(_frame(frag=3)) is None  # a later fragment: no UDP header in it
    whole = _frame()
    for cut in (0, 10, 14, 33, 41):
        assert udp_of(whole[:cut]) is None, cut
    arp = b"\x02" * 12 + b"\x08\x06" + b"\0" * 28
    assert udp_of(arp) is None


@pytest.mark.parametrize("vlan,ihl", [(False, 5), (True, 5), (False, 7)])
def test_a_roce_frame_gives_the_opcode_and_destination_qp_of_its_bth(vlan, ihl):
    bth = bytes([0x04, 0x40, 0xFF, 0xFF, 0x00, 0x01, 0x23, 0x45, 0x80, 0x00, 0x00, 0x07])  # RC SEND only to QP 0x12345
    assert roce_bth(_frame(vlan=vlan, ihl=ihl, payload=bth)) == (0x04, 0x12345)
    ud = bytes([0x64]) + bth[1:]  # a UD SEND, as LinkPass's verbs probes are
    assert roce_bth(_frame(payload=ud)) == (0x64, 0x12345)


def test_no_qp_for_other_ports_or_a_payload_shorter_than_a_bth():
    bth = bytes(12)
    assert roce_bth(_frame(dport=4792, payload=bth)) is None
    assert roce_bth(_frame(payload=bth[:11])) is None
    assert roce_bth(_frame(proto=6, payload=bth)) is None

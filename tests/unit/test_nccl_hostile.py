"""The NCCL plugin's listener against hostile sockets, on two loopback planes: a flood of
connections that never say hello, a hello that names the handle's token without its key, and one
signed with the key that asks for a chunk size of its own. The real transfer that follows must
move every byte right, and the receiver counts each refusal by its reason."""
from __future__ import annotations

import hashlib
import os
import socket
import struct
import subprocess
import time

from support.nccl import harness_fields, nccl_build


HANDLE = struct.Struct("<IHBBQ16s")  # magic, version, planes, flags, token, key; then 8 x (addr, port, reserved)
FRAME = struct.Struct("<BBHIQQQ")  # type, flags, lane, len, seq, off, arg
HELLO = struct.Struct("<QQQIHHII16s")  # magic, token, nonce, chunk, plane, lane, epoch, kind, mac
HELLO_MAGIC = 0x314C43434E50504C
FLOOD = 600


def env():
    e = dict(os.environ)
    e.update({"LINKPASS_NICS": "127.0.0.1,127.0.0.2", "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"})
    return e


def read_handle(path: str, timeout_s: float = 30) -> tuple[int, bytes, list[tuple[str, int]]]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            raw = bytes.fromhex(open(path).read().strip())
            magic, version, planes, _flags, token, key = HANDLE.unpack_from(raw)
            assert magic == 0x4C504E31 and version == 2, "a handle of another layout"
            eps = [struct.unpack_from("<4sHH", raw, HANDLE.size + 8 * q) for q in range(planes)]
            return token, key, [(socket.inet_ntoa(a), port) for a, port, _ in eps]
        time.sleep(0.05)
    raise AssertionError("the receiver wrote no handle")


def hello(token: int, key: bytes | None, chunk: int = 512 << 10, lane: int = 0, kind: int = 0, qp: bytes = b"",
          magic: int = HELLO_MAGIC, frame_len: int | None = None) -> bytes:
    """A lane's first frame: its hello (signed with `key`, or a random tag) and the QP info after it."""
    body = HELLO.pack(magic, token, 0xBAD, chunk, 0, lane, 1, kind, bytes(16))
    mac = hashlib.blake2b(body + qp, key=key, digest_size=16).digest() if key else os.urandom(16)
    body = body[:-16] + mac + qp
    return FRAME.pack(1, 0, lane, len(body) if frame_len is None else frame_len, 0, 0, 0) + body


class Receiver:
    """The receive side alone (-r recv), its handle read back; finish() runs the sender against it
    and returns both sides' results."""

    def __init__(self, tmp_path, messages: int = 20):
        plugin, harness = nccl_build()
        self.hfile = str(tmp_path / "handle")
        self.base = [harness, "-l", plugin, "transfer", "-s", "1M", "-n", str(messages), "-T", "60", "-H", self.hfile]
        self.proc = subprocess.Popen([*self.base, "-r", "recv"], env=env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.messages = messages

    def __enter__(self):
        try:
            self.token, self.key, self.eps = read_handle(self.hfile)
        except BaseException:
            self.__exit__()
            raise
        return self

    def finish(self):
        sender = subprocess.run([*self.base, "-r", "send"], env=env(), capture_output=True, text=True, timeout=90)
        out, err = self.proc.communicate(timeout=90)
        assert sender.returncode == 0, f"{sender.stdout}\n{sender.stderr[-3000:]}"
        assert self.proc.returncode == 0, f"{out}\n{err[-3000:]}"
        t = harness_fields(out, "transfer")
        assert t["wrong"] == "0" and t["recv_done"] == t["messages"] == str(self.messages), out
        return harness_fields(out, "stats"), err

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def closed_unanswered(addr, data: bytes, half_close: bool = False) -> None:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)  # stops short: the plugin waits for the rest, then drops it
        assert s.recv(100) == b""  # closed by the plugin, nothing answered


def test_a_flood_and_forged_hellos_neither_starve_nor_take_over_a_connection(tmp_path):
    socks: list[socket.socket] = []
    with Receiver(tmp_path) as r:
        try:
            for i in range(FLOOD):  # connections that never say a word, on both planes
                s = socket.socket()
                s.settimeout(5)
                s.connect(r.eps[i % len(r.eps)])
                socks.append(s)
            closed_unanswered(r.eps[0], hello(r.token, None))  # the handle's token, not its key
            closed_unanswered(r.eps[0], hello(r.token, r.key, chunk=64 << 20))  # signed, a chunk of its own
            stats, err = r.finish()
        finally:
            for s in socks:
                s.close()
    assert int(stats["hellos_unsigned"]) == 1 and int(stats["hellos_chunk_mismatch"]) == 1, stats
    assert int(stats["hellos_evicted"]) >= FLOOD - 2 * 16 - 64, stats  # at most 16 wait per address
    assert "not signed with the handle's key" in err and "set LINKPASS_CHUNK_KB the same" in err


def test_garbage_at_a_listener_is_counted_by_reason_and_the_transfer_beside_it_is_unharmed(tmp_path):
    """Junk the size of a hello, a hello with a bad magic, one for a token nobody issued."""
    with Receiver(tmp_path) as r:
        closed_unanswered(r.eps[0], os.urandom(FRAME.size + HELLO.size))
        closed_unanswered(r.eps[0], hello(r.token, r.key, magic=0xBAD))
        closed_unanswered(r.eps[0], hello(12345, r.key))
        stats, _ = r.finish()
    assert stats["hellos_malformed"] == "2" and stats["hellos_unknown_token"] == "1", stats


def test_a_verbs_lane_asked_of_a_tcp_host_is_refused_with_a_warning_and_garbled_ones_are_malformed(tmp_path):
    """A signed hello asking for a verbs lane (the sender's QP after it) at a host whose lanes are
    TCP is closed unanswered and the host says why, once; a hello whose length claims a QP but whose
    kind says TCP, or that stops short, is refused too."""
    qp = struct.pack("<II16sHBBI", 17, 1234, bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]), 49152, 3, 0, 8)
    with Receiver(tmp_path) as r:
        for _ in range(2):
            closed_unanswered(r.eps[0], hello(r.token, r.key, kind=1, qp=qp))
        closed_unanswered(r.eps[0], hello(r.token, r.key, kind=0, qp=qp))
        closed_unanswered(r.eps[0], hello(r.token, r.key, kind=1, qp=qp)[:FRAME.size + HELLO.size],
                          half_close=True)  # its QP info never comes
        stats, err = r.finish()
    warns = [ln for ln in err.splitlines() if "a peer asked for verbs lanes, but this host uses TCP lanes" in ln]
    assert len(warns) == 1 and "set LINKPASS_TRANSPORT the same on every host" in warns[0], err[-3000:]
    assert stats["hellos_transport_mismatch"] == "2" and stats["hellos_malformed"] == "1", stats

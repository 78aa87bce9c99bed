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

import pytest

from helpers import harness_fields, nccl_build

pytestmark = pytest.mark.unit

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


def hello(token: int, key: bytes | None, chunk: int = 512 << 10, lane: int = 0) -> bytes:
    body = HELLO.pack(HELLO_MAGIC, token, 0xBAD, chunk, 0, lane, 1, 0, bytes(16))
    mac = hashlib.blake2b(body, key=key, digest_size=16).digest() if key else os.urandom(16)
    body = body[:-16] + mac
    return FRAME.pack(1, 0, lane, len(body), 0, 0, 0) + body


def test_a_flood_and_forged_hellos_neither_starve_nor_take_over_a_connection(tmp_path):
    plugin, harness = nccl_build()
    hfile = str(tmp_path / "handle")
    base = [harness, "-l", plugin, "transfer", "-s", "1M", "-n", "20", "-T", "60", "-H", hfile]
    recv = subprocess.Popen([*base, "-r", "recv"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    socks: list[socket.socket] = []
    try:
        token, key, eps = read_handle(hfile)
        for i in range(FLOOD):  # connections that never say a word, on both planes
            s = socket.socket()
            s.settimeout(5)
            s.connect(eps[i % len(eps)])
            socks.append(s)
        forged = []
        for frame in (hello(token, None), hello(token, key, chunk=64 << 20)):
            s = socket.create_connection(eps[0], timeout=5)
            s.sendall(frame)
            forged.append(s)
        for s in forged:  # each is closed by the listener, not answered
            assert s.recv(64) == b""
            s.close()
        sender = subprocess.run([*base, "-r", "send"], env=env(), capture_output=True, text=True, timeout=90)
        out, err = recv.communicate(timeout=90)
    finally:
        for s in socks:
            s.close()
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    assert sender.returncode == 0, f"{sender.stdout}\n{sender.stderr[-3000:]}"
    assert recv.returncode == 0, f"{out}\n{err[-3000:]}"
    t = harness_fields(out, "transfer")
    assert t["wrong"] == "0" and t["recv_done"] == t["messages"] == "20", out
    stats = harness_fields(out, "stats")
    assert int(stats["hellos_unsigned"]) == 1 and int(stats["hellos_chunk_mismatch"]) == 1, stats
    assert int(stats["hellos_evicted"]) >= FLOOD - 2 * 16 - 64, stats  # at most 16 wait per address
    assert "not signed with the handle's key" in err and "set LINKPASS_CHUNK_KB the same" in err

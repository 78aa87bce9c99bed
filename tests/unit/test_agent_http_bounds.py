"""The agent's HTTP servers (local API, /metrics on the management address) stay bounded against
idle, trickling and many clients: a request head must arrive within the read timeout, open
connections are capped in all and per client address (the longest-waiting head is evicted to make
room, so /healthz still answers during a flood of idle connections), and accept() failing for lack
of descriptors backs off instead of spinning. In this namespace, on 127.0.0.1, port 0: no root."""
from __future__ import annotations

import errno
import socket
import threading
import time
from contextlib import ExitStack

import pytest

from linkpass.agent import api


ROUTES = {"/healthz": lambda: (200, b"ok\n", "text/plain")}
HEAD = b"GET /healthz HTTP/1.0\r\n\r\n"


@pytest.fixture
def start():
    """serve(...) on 127.0.0.1, port 0; every server started is shut down after the test."""
    servers = []

    def make(routes=ROUTES, **limits):
        kw = {"limits": api.HttpLimits(**limits)} if limits else {}
        server = api.serve("127.0.0.1", 0, routes, name="test-http", **kw)
        servers.append(server)
        return server, server.server_address[1]

    try:
        yield make
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def sockets():
    """Client sockets, every one closed after the test, also when it fails."""
    with ExitStack() as stack:
        def connect(port: int, source: str | None = None) -> socket.socket:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.settimeout(5)
            if source is not None:
                sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            return sock

        yield connect


def get(port: int, path: str = "/healthz", source: str | None = None) -> tuple[int, bytes]:
    """One GET, bounded: (status, body)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        if source is not None:
            sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        return answer(sock)


def answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (what it said before, if anything, is read away)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # MSG_DONTWAIT alone would still wait out the socket's timeout
    try:
        while sock.recv(4096):
            pass
        return True  # end of stream
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        sock.settimeout(timeout)


def eventually(check, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def held(socks: list[socket.socket], at_most: int, within_s: float = 2.0) -> int:
    """How many of `socks` the server still holds open, once at most `at_most` (or `within_s` passed)."""
    deadline = time.monotonic() + within_s
    gone: set[int] = set()
    while True:
        gone |= {i for i, s in enumerate(socks) if i not in gone and closed_by_server(s)}
        if len(socks) - len(gone) <= at_most or time.monotonic() > deadline:
            return len(socks) - len(gone)
        time.sleep(0.05)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (None: still open after `seconds`)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.monotonic() - started


def test_a_flood_of_idle_connections_is_capped_and_healthz_still_answers(start, sockets):
    server, port = start()  # the shipped limits
    cap = api.HttpLimits().max_per_client if hasattr(api, "HttpLimits") else 16
    flood: list[socket.socket] = []
    stop = threading.Event()
    opened_50 = threading.Event()
    failed: list[BaseException] = []

    def open_idle():
        give_up = time.monotonic() + 10
        try:
            for i in range(300):
                if stop.is_set() or time.monotonic() > give_up:
                    return
                flood.append(sockets(port))
                if i == 50:
                    opened_50.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failed.append(exc)
        finally:
            opened_50.set()

    flooder = threading.Thread(target=open_idle, name="flooder", daemon=True)
    flooder.start()
    done = False
    try:
        assert opened_50.wait(10)
        started = time.monotonic()
        assert get(port) == (200, b"ok\n")  # while idle connections keep coming
        assert time.monotonic() - started < 3
        done = True
    finally:
        if not done:
            stop.set()
        flooder.join(30)
    assert not failed and len(flood) > 3 * cap
    # every client here is 127.0.0.1: the server keeps at most its per-client cap of them
    assert held(flood, cap) <= cap, f"the server holds {held(flood, cap, 0)} of {len(flood)} idle connections"
    assert len(flood) == 300  # and it took them all in quickly
    started = time.monotonic()
    assert get(port) == (200, b"ok\n")
    assert time.monotonic() - started < 3
    assert server.open_connections <= cap
    stats = server.stats
    assert stats["accepted"] == 302 and stats["evicted"] + stats["timed_out"] >= 300 - cap, stats


def test_caps_hold_per_client_address_and_in_all(start, sockets):
    server, port = start(max_connections=8, max_per_client=3, read_timeout_s=30)
    by_source = {f"127.0.0.{n}": [sockets(port, f"127.0.0.{n}") for _ in range(5)] for n in (2, 3, 4, 5)}
    every = [s for socks in by_source.values() for s in socks]
    assert held(every, 8) <= 8  # 4 clients x 3 would be 12: the oldest heads are evicted
    for socks in by_source.values():
        assert held(socks, 3, within_s=0) <= 3
    assert eventually(lambda: server.stats["evicted"] == 20 - 8) and server.stats["refused"] == 0
    # the longest waiting were evicted: the newest connection of the last client is still there
    assert not closed_by_server(by_source["127.0.0.5"][-1])
    assert get(port, source="127.0.0.6") == (200, b"ok\n")


def test_an_idle_connection_is_closed_after_the_read_timeout(start, sockets):
    server, port = start(read_timeout_s=0.3)
    idle = sockets(port)
    took = closed_within(idle, 5)
    assert took is not None and 0.2 < took < 2, took
    assert eventually(lambda: server.stats["timed_out"] == 1)
    assert get(port) == (200, b"ok\n")  # the server itself goes on


def test_a_request_head_that_trickles_in_is_cut_off_at_the_read_timeout(start, sockets):
    server, port = start(read_timeout_s=0.3)
    slow = sockets(port)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n")
    started = time.monotonic()
    cut = None
    try:
        while time.monotonic() - started < 5:  # a byte every 50 ms: no single read ever waits long
            slow.sendall(b"X")
            if closed_by_server(slow):
                cut = time.monotonic() - started
                break
            time.sleep(0.05)
    except ConnectionError:
        cut = time.monotonic() - started
    assert cut is not None and cut < 2, cut
    assert eventually(lambda: server.stats["timed_out"] == 1)


def test_a_request_being_answered_is_never_evicted(start, sockets):
    release = threading.Event()

    def slow():
        release.wait(5)
        return 200, b"done\n", "text/plain"

    server, port = start({**ROUTES, "/slow": slow}, max_connections=4, max_per_client=2, read_timeout_s=30)
    busy = sockets(port)
    busy.sendall(b"GET /slow HTTP/1.0\r\n\r\n")
    deadline = time.monotonic() + 5
    while server.open_connections < 1 or server.stats["accepted"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)  # its head read and its answer started
    idle = [sockets(port) for _ in range(4)]  # one slot left for them: each evicts the one before
    assert held(idle, 1) == 1
    release.set()
    assert answer(busy) == (200, b"done\n")
    # with every slot answering, a newcomer is told so at once rather than left waiting
    release.clear()
    busy2 = [sockets(port) for _ in range(2)]
    for s in busy2:
        s.sendall(b"GET /slow HTTP/1.0\r\n\r\n")
    time.sleep(0.2)
    try:  # a 503, or a reset when its request arrived after the server closed the connection
        assert get(port)[0] == 503
    except ConnectionResetError:
        pass
    assert server.stats["refused"] == 1
    release.set()
    assert [answer(s) for s in busy2] == [(200, b"done\n")] * 2


def test_accept_out_of_descriptors_backs_off_instead_of_spinning(start, sockets):
    server, port = start()
    idle = sockets(port)
    assert eventually(lambda: getattr(server, "open_connections", 1) == 1)
    calls = []

    def no_descriptors():
        calls.append(time.monotonic())
        raise OSError(errno.EMFILE, "Too many open files")

    server.get_request = no_descriptors  # what accept() says once the process is out of descriptors
    waiting = sockets(port)
    time.sleep(0.5)
    del server.get_request  # descriptors are back
    assert 1 <= len(calls) <= 10, f"{len(calls)} accept() calls in 0.5 s"
    # the idle connection gave its descriptor up for the newcomer; then, with none left, a pause
    assert closed_by_server(idle)
    assert server.stats["accept_failed"] == len(calls) and server.stats["evicted"] == 1
    waiting.sendall(HEAD)  # the connection waited in the kernel's queue and is answered now
    assert answer(waiting) == (200, b"ok\n")

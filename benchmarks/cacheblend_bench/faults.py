"""Fault runs against real processes: 2 `cacheblend-rag serve` replicas sharing one redis-server, a steady load of
C client threads (a fixed request count, round-robin over the live replicas like a load balancer), and one fault
per scenario:

    healthy      no fault (the baseline hit rate)
    redis_kill   kill -9 Redis at 25% of the requests, restart it (empty) at 50%
    replica_kill kill -9 replica b while one of its answers is streaming, at 25%; the rest go to replica a
    maxmemory    Redis's maxmemory set to half the working set (allkeys-lru) and filled with other keys first
    flip         one byte flipped in one layer of every stored entry at 25%
    big_body     a 256 MiB chunked upload without the API key to replica a at 25%, and one with it: both must be
                 cut off early (401 from the headers, 413 at --max-body-bytes); the replica's RSS is sampled
    slow_headers 64 connections (32 per replica) at 25% that send half a request's headers a byte a second: the
                 replicas must close them (--header-timeout) while the load goes on

Three more scenarios need no Redis and no load: they run against one server of their own (`cacheblend-rag serve`
with its defaults: --max-grammar-bytes 128 KiB, --grammar-timeout 10 s) and get a table of their own:

    schema_bomb   6 clients send a 10,000-property json_schema (~368 KB) at once while a 4-token chat request is
                  timed, 5 rounds; the bombs must get 400 and that request's median latency stays near its baseline
                  (measured just before), reported as a ratio (target ≤ 2×), with the server's CPU per bomb (its
                  CPU during the rounds less the timed requests' own, over the bombs: steadier than the ratio on a
                  shared machine) and its RSS before and after
    grammar_fails a schema that does not compile (`{"$ref": "#"}`) and one whose lexer gives up at its first token
                  (pattern `^(a{1000}){1000}$`): 400 for each, and the time to answer
    stop_in_json  a stop string that occurs inside a json_schema-constrained answer: the answer still parses as JSON

Two more probe what one client of a shared server learns about another's requests, against a server of their own
with two API keys A and B, `--hide-cache-usage` and `--metrics-key` (docs/serve.md, "What a shared server reveals"):

    document_oracle   A sends a memo as a document; B sends the memo's chunk id, and that of an edited memo:
                      the two answers must be the same (400 "unknown chunk id"), or B learns what A sent
    metrics_oracle    B reads /metrics around its guess of A's prompt (exact, then wrong): it must get 401; the
                      operator's key reads it, and the cached-token counter's rise per guess is reported

Per scenario: completed / failed / wrong, per replica. A request *failed* when it got no complete answer (an HTTP
error, or a stream cut before `finish_reason` and [DONE]). It is *wrong* when its answer differs from the answer
the same policy gives with the same chunks cached (greedy decoding, so that answer is one string): the replicas
report which chunks were hits, and the reference for that hit pattern is produced afterwards on a healthy Redis
(every chunk stored, then the missing ones deleted). A healthy cache gives the all-hit answer; how many answers
differ from it (degraded: a chunk was recomputed) is reported too. Time to recover: from the fault's end to the
first request started after it that had every chunk hit.

`--model tiny-random` serves a random-weight 4-layer Llama (hidden 64) with SmolLM2's tokenizer, built on the fly:
the counts do not depend on the model, and on a shared CPU it keeps a run to minutes (its greedy answers are
garbage, but deterministic and, with weights scaled up, sensitive to any difference in the KV).

The replicas use Redis as their only KV tier (`--kv-store redis://...`), so every request reads Redis and every
fault shows; a memory tier in front would hide most of them. Loopback only, every loop bounded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import select
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .replicas import RedisServer, Replica

logger = logging.getLogger(__name__)

TINY_RANDOM = "tiny-random"
CLUSTER_SCENARIOS = ("healthy", "redis_kill", "replica_kill", "maxmemory", "flip", "big_body", "slow_headers")
GRAMMAR_SCENARIOS = ("schema_bomb", "grammar_fails", "stop_in_json")  # one server of their own, no Redis
PRIVACY_SCENARIOS = ("document_oracle", "metrics_oracle")  # one server of their own with two keys
SCENARIOS = CLUSTER_SCENARIOS + GRAMMAR_SCENARIOS + PRIVACY_SCENARIOS
QUESTION_LIMIT_S = 300.0
BIG_BODY_BYTES = 256 * 1024**2  # what the big_body client would send if nothing stopped it
SLOW_CLIENTS = 64  # half-sent requests of slow_headers, split over the replicas
SLOW_LIMIT_S = 120.0  # how long slow_headers waits for the replicas to close them


@dataclass
class Outcome:
    """One request as a client saw it."""

    index: int
    question: int
    replica: str
    started: float
    finished: float = 0.0
    ok: bool = False
    error: str | None = None
    text: str = ""
    hits: tuple[str, ...] = ()
    misses: tuple[str, ...] = ()
    exact_cached: int = 0

    @property
    def pattern(self) -> tuple[frozenset[str], bool]:
        """Which chunks were hits, and whether the prompt's exact prefix was."""
        return frozenset(self.hits), self.exact_cached > 0

    @property
    def all_hit(self) -> bool:
        """Every chunk came from the cache."""
        return self.ok and not self.misses


def ask(url: str, question: str, docs: list[str], max_tokens: int, model: str, on_piece=None,
        timeout_s: float = QUESTION_LIMIT_S, extra: dict | None = None, api_key: str | None = None) -> dict:
    """One streamed chat completion: {"text", "usage"}; raises on an HTTP error or a stream cut short."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "documents": docs,
            **(extra or {})}
    text, usage, finished, done = [], None, False, False
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers,
                      timeout=timeout_s) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error'].get('message')}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    if on_piece is not None:
                        on_piece()
                finished |= choice.get("finish_reason") is not None
    if not (finished and done and usage):
        raise RuntimeError("the stream ended before its finish_reason, usage and [DONE]")
    return {"text": "".join(text).strip(), "usage": usage}


class Balancer:
    """Round-robin over the live replicas; a replica that refuses a connection is taken out (as a load balancer's
    health check would), and the request goes to the next one before anything was sent."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = list(replicas)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self) -> Replica:
        """The next live replica."""
        with self._lock:
            if not self.replicas:
                raise RuntimeError("no live replica")
            replica = self.replicas[self._next % len(self.replicas)]
            self._next += 1
            return replica

    def remove(self, replica: Replica) -> None:
        """Take a replica out of the rotation."""
        with self._lock:
            if replica in self.replicas:
                self.replicas.remove(replica)


def tiny_random_model(folder: Path, home: str | None) -> Path:
    """A random-weight 4-layer Llama with the default model's tokenizer, saved as a local model folder."""
    import torch
    import transformers as tf

    from cacheblend_rag.models.loader import DEFAULT_MODEL, model_folder

    tokenizer = tf.AutoTokenizer.from_pretrained(model_folder(DEFAULT_MODEL, home), local_files_only=True)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                            rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init leaves the logits nearly flat; scaled up, a KV difference shows
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Cluster:
    """One redis-server and two replicas (a, b), each replica with its own home; Redis is their only KV tier."""

    def __init__(self, workdir: Path, model: str, home: str | None) -> None:
        from cacheblend_rag import settings
        from cacheblend_rag.models.loader import model_folder
        from cacheblend_rag.serve.command import served_name

        self.workdir = Path(workdir)
        self.api_key = secrets.token_hex(16)  # the replicas require it: the big_body upload goes without
        if model == TINY_RANDOM:
            model = str(tiny_random_model(self.workdir / TINY_RANDOM, home))
        self.model = model
        self.served = served_name(model)  # what clients send as `model`
        self.redis = RedisServer(self.workdir).start()
        model_folder(model, home)  # converted once; every replica's home links to these models
        models = settings.models_dir()
        self.replicas: dict[str, Replica] = {}
        for name in ("a", "b"):
            self.replicas[name] = self._replica(name, models)
        for replica in self.replicas.values():
            replica.wait_ready()

    def _replica(self, name: str, models: Path) -> Replica:
        rhome = self.workdir / f"home-{name}-{int(time.time() * 1000)}"
        rhome.mkdir()
        (rhome / "models").symlink_to(models, target_is_directory=True)
        # a long server timeout: on a shared CPU a queued request may wait minutes, and that is not a fault
        return Replica(rhome, [self.redis.url], "--timeout", "3600", model=self.model, name=name,
                       api_key=self.api_key)

    def restart_replica(self, name: str, models: Path) -> None:
        """A fresh process for a killed replica."""
        self.replicas[name].kill9()
        self.replicas[name] = self._replica(name, models).wait_ready()

    def stop(self) -> None:
        """Stop every process."""
        for replica in self.replicas.values():
            replica.kill9()
        self.redis.stop()


@dataclass
class Scenario:
    """What happened in one scenario run."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # fault start/end times (monotonic)
    notes: dict = field(default_factory=dict)


def run_load(cluster: Cluster, items: list[tuple[str, list[str]]], num_requests: int, clients: int,
             max_tokens: int, fault=None, fault_at: float = 0.25) -> tuple[list[Outcome], dict]:
    """`num_requests` requests from `clients` threads (request i asks question i mod len(items)); `fault(state)`
    runs on its own thread once `fault_at` of the requests have finished."""
    balancer = Balancer(list(cluster.replicas.values()))
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "in_flight": {}, "events": {}, "balancer": balancer, "streaming": set()}
    triggered = threading.Event()

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= num_requests:
                    return
                state["next"] += 1
            q = i % len(items)
            question, docs = items[q]
            for _ in range(3):  # a replica that refuses the connection is taken out; the request goes elsewhere
                replica = balancer.pick()
                outcome = Outcome(i, q, replica.name, time.monotonic())
                marker = (replica.name, i)

                def on_piece(marker=marker) -> None:
                    state["streaming"].add(marker)

                try:
                    answer = ask(replica.url, question, docs, max_tokens, cluster.served, on_piece,
                                 api_key=cluster.api_key)
                except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
                    import httpx

                    if isinstance(e, httpx.ConnectError):
                        balancer.remove(replica)
                        continue
                    outcome.error = f"{type(e).__name__}: {e}"[:200]
                else:
                    cb = answer["usage"].get("cacheblend", {})
                    outcome.ok, outcome.text = True, answer["text"]
                    outcome.hits, outcome.misses = tuple(cb.get("hit_ids", ())), tuple(cb.get("miss_ids", ()))
                    outcome.exact_cached = int(cb.get("exact_cached_tokens", 0))
                finally:
                    state["streaming"].discard(marker)
                break
            else:
                outcome.error = "no replica accepted the connection"
            outcome.finished = time.monotonic()
            with lock:
                outcomes.append(outcome)
                state["done"] += 1
                if fault is not None and not triggered.is_set() and state["done"] >= fault_at * num_requests:
                    triggered.set()

    def run_fault() -> None:
        if triggered.wait(QUESTION_LIMIT_S * 2):
            try:
                fault(state)
            except Exception:  # noqa: BLE001 - a fault that could not be injected is reported, the run goes on
                logger.exception("fault injection failed")
                state["events"]["fault_error"] = time.monotonic()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    fault_thread = threading.Thread(target=run_fault, daemon=True) if fault is not None else None
    for t in threads + ([fault_thread] if fault_thread else []):
        t.start()
    for t in threads:
        t.join(QUESTION_LIMIT_S * num_requests)
    triggered.set()
    if fault_thread:
        fault_thread.join(QUESTION_LIMIT_S)
    return sorted(outcomes, key=lambda o: o.index), state


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_answer(sock: socket.socket) -> bytes:
    """An HTTP answer read whole: its headers and Content-Length bytes of body (they may come in separate packets),
    or what came before the server closed or reset the connection."""
    raw = b""
    try:
        while True:
            head, sep, body = raw.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
            if length and len(body) >= int(length.group(1)):
                return raw
            piece = sock.recv(65536)
            if not piece:
                return raw
            raw += piece
    except (ConnectionResetError, TimeoutError):
        return raw


def oversized_upload(port: int, headers: dict[str, str], limit: int = BIG_BODY_BYTES
                     ) -> tuple[int | None, int, bytes]:
    """A chunked POST of up to `limit` bytes to 127.0.0.1:port, stopped as soon as the server answers: (its status,
    None when it never answered; the body bytes sent by then; the raw answer)."""
    chunk = b"x" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "localhost", "Content-Type": "application/json",
                                                 "Transfer-Encoding": "chunked", **headers}.items())
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode())
        try:
            while sent < limit and not select.select([sock], [], [], 0)[0]:
                sock.sendall(frame)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: its answer is still to be read
        except TimeoutError:
            return None, sent, b""  # it stopped reading without answering
        if not select.select([sock], [], [], 10)[0]:
            return None, sent, b""
        raw = _read_answer(sock)
    first = raw.split(b"\r\n", 1)[0].split()
    return (int(first[1]) if len(first) >= 2 and first[0].startswith(b"HTTP/") else None), sent, raw


def slow_header_flood(ports: list[int], count: int = SLOW_CLIENTS, limit_s: float = SLOW_LIMIT_S) -> dict:
    """`count` connections (spread over `ports`) that each send half a request's headers, then a byte a second;
    how many the servers closed within `limit_s`, and the longest any stayed open (bounded by `limit_s`)."""
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
    socks, opened = [], time.monotonic()
    try:
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=10)
            sock.setblocking(False)
            sock.send(partial)
            socks.append(sock)
        open_since = {sock: time.monotonic() for sock in socks}
        closed: dict = {}
        deadline = opened + limit_s
        while len(closed) < len(socks) and time.monotonic() < deadline:
            live = [s for s in socks if s not in closed]
            readable, _, _ = select.select(live, [], [], 1.0)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    closed[sock] = time.monotonic() - open_since[sock]
            for sock in live:
                if sock not in closed:
                    try:
                        sock.send(b"a")  # a byte a second: the headers never end
                    except OSError:
                        closed[sock] = time.monotonic() - open_since[sock]
        longest = max(closed.values(), default=0.0) if len(closed) == len(socks) else limit_s
        return {"slow_clients": len(socks), "closed_by_server": len(closed), "longest_open_s": round(longest, 1)}
    finally:
        for sock in socks:
            sock.close()


def _wait_done_fraction(state: dict, fraction: float, total: int, limit_s: float = QUESTION_LIMIT_S * 4) -> None:
    deadline = time.monotonic() + limit_s
    while state["done"] < fraction * total and time.monotonic() < deadline:
        time.sleep(0.05)


def flip_every_entry(redis_server: RedisServer, rng: random.Random) -> int:
    """Flip one byte in one layer field of every stored entry; the number of entries changed."""
    client = redis_server.client()
    changed = 0
    for name in client.scan_iter(count=1000):
        if client.type(name) != b"hash":
            continue
        layers = [f for f in client.hkeys(name) if f.startswith(b"L")]
        if not layers:
            continue
        field_name = rng.choice(layers)
        data = bytearray(client.hget(name, field_name) or b"")
        if not data:
            continue
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        client.hset(name, field_name, bytes(data))
        changed += 1
    return changed


def _fill_to_maxmemory(redis_server: RedisServer, maxmemory: int) -> int:
    """Set maxmemory + allkeys-lru, then write filler keys until Redis is full (bounded); filler keys written."""
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(maxmemory))
    blob, written = b"f" * (256 * 1024), 0
    for i in range(4 * maxmemory // len(blob) + 16):
        client.set(f"filler:{i}", blob)
        written += 1
        if int(client.info("stats")["evicted_keys"]) > 0:
            break
    return written


def _warm(cluster: Cluster, items, max_tokens: int) -> None:
    """Every question once through replica a, so every chunk is stored."""
    for question, docs in items:
        ask(cluster.replicas["a"].url, question, docs, max_tokens, cluster.served, api_key=cluster.api_key)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _costs(cluster: Cluster) -> dict[str, float]:
    """CPU seconds of the replicas and of Redis, and KV bytes the replicas read from Redis, so far."""
    cpu = cluster.redis.client().info("cpu")
    return {"replica_cpu_s": sum(_cpu_s(r.proc.pid) for r in cluster.replicas.values()),
            "redis_cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "redis_read_bytes": sum(r.metric("cacheblend_kv_store_read_bytes_total", tier="redis")
                                    for r in cluster.replicas.values())}


def _stored_bytes(redis_server: RedisServer) -> int:
    return int(redis_server.client().info("memory")["used_memory"])


def run_scenario(name: str, cluster: Cluster, items, num_requests: int, clients: int, max_tokens: int,
                 models: Path, seed: int) -> Scenario:
    """Reset Redis, warm it, run the load with this scenario's fault."""
    scenario = Scenario(name)
    client = cluster.redis.client()
    client.flushall()
    client.config_set("maxmemory", "0")
    client.config_resetstat()
    for rname, replica in list(cluster.replicas.items()):
        if replica.proc.poll() is not None:
            cluster.restart_replica(rname, models)
    _warm(cluster, items, max_tokens)
    rng = random.Random(seed)
    fault = None
    if name == "redis_kill":
        def fault(state) -> None:
            cluster.redis.kill9()
            state["events"]["fault_start"] = time.monotonic()
            _wait_done_fraction(state, 0.5, num_requests)
            cluster.redis.start()
            state["events"]["fault_end"] = time.monotonic()
    elif name == "replica_kill":
        def fault(state) -> None:
            deadline = time.monotonic() + QUESTION_LIMIT_S
            while not any(r == "b" for r, _ in list(state["streaming"])) and time.monotonic() < deadline:
                time.sleep(0.005)
            state["balancer"].remove(cluster.replicas["b"])  # the load balancer's health check would, soon after
            cluster.replicas["b"].kill9()
            state["events"]["fault_start"] = state["events"]["fault_end"] = time.monotonic()
    elif name == "maxmemory":
        working_set = _stored_bytes(cluster.redis)
        scenario.notes["working_set_bytes"] = working_set
        scenario.notes["maxmemory_bytes"] = maxmemory = max(working_set // 2, 2 * 1024**2)
        scenario.notes["filler_keys"] = _fill_to_maxmemory(cluster.redis, maxmemory)
    elif name == "flip":
        def fault(state) -> None:
            state["events"]["fault_start"] = time.monotonic()
            scenario.notes["entries_flipped"] = flip_every_entry(cluster.redis, rng)
            state["events"]["fault_end"] = time.monotonic()
    elif name == "big_body":
        def fault(state) -> None:
            target = cluster.replicas["a"]
            state["events"]["fault_start"] = time.monotonic()
            rss = [rss_bytes(target.proc.pid)]
            sampling = threading.Event()

            def sample() -> None:
                while not sampling.wait(0.05):
                    rss.append(rss_bytes(target.proc.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                no_key = oversized_upload(target.port, {})[:2]
                with_key = oversized_upload(target.port, {"Authorization": f"Bearer {cluster.api_key}"})[:2]
            finally:
                sampling.set()
                sampler.join(10)
            state["events"]["fault_end"] = time.monotonic()
            mib = 1024**2
            scenario.notes.update(no_key_status=no_key[0], no_key_sent_mib=round(no_key[1] / mib, 1),
                                  with_key_status=with_key[0], with_key_sent_mib=round(with_key[1] / mib, 1),
                                  rss_before_mib=round(rss[0] / mib), rss_peak_mib=round(max(rss) / mib))
    elif name == "slow_headers":
        def fault(state) -> None:
            state["events"]["fault_start"] = time.monotonic()
            scenario.notes.update(slow_header_flood([r.port for r in cluster.replicas.values()]))
            state["events"]["fault_end"] = time.monotonic()
    before = _costs(cluster) if name == "healthy" else None
    outcomes, state = run_load(cluster, items, num_requests, clients, max_tokens, fault)
    scenario.outcomes, scenario.events = outcomes, dict(state["events"])
    if before is not None:  # what one request costs, for the scaling arithmetic in docs/deploy.md
        after = _costs(cluster)
        scenario.notes.update({f"{k}_per_request": round((after[k] - before[k]) / num_requests, 4) for k in after})
    try:
        stats = cluster.redis.client().info("stats")
        scenario.notes["evicted_keys"] = int(stats.get("evicted_keys", 0))
    except Exception:  # noqa: BLE001 - Redis may be the thing that is down
        pass
    return scenario


def references(cluster: Cluster, items, scenarios: list[Scenario], max_tokens: int, models: Path) -> dict:
    """The answer of each (question, hit pattern) seen, produced on a healthy Redis through replica a: all chunks
    stored by one request, the ones outside the pattern deleted, then the request; keyed (question, pattern)."""
    for rname, replica in list(cluster.replicas.items()):
        if replica.proc.poll() is not None:
            cluster.restart_replica(rname, models)
    if cluster.redis.proc is None or cluster.redis.proc.poll() is not None:
        cluster.redis.start()
    client = cluster.redis.client()
    client.config_set("maxmemory", "0")
    wanted = {(o.question, o.pattern) for s in scenarios for o in s.outcomes if o.ok}
    wanted |= {(q, None) for q in range(len(items))}  # the healthy-cache (all-hit) answer of every question
    refs: dict = {}
    url = cluster.replicas["a"].url
    for q, pattern in sorted(wanted, key=lambda w: (w[0], w[1] is not None)):
        question, docs = items[q]
        client.flushall()
        # stores every chunk (and the prefix, if it is stored)
        ask(url, question, docs, max_tokens, cluster.served, api_key=cluster.api_key)
        if pattern is None:
            refs[(q, None)] = ask(url, question, docs, max_tokens, cluster.served, api_key=cluster.api_key)["text"]
            continue
        hits, prefix_hit = pattern
        for name in client.scan_iter(count=1000):
            chunk_id = name.decode().rsplit(":", 1)[-1]
            keep = chunk_id in hits or (prefix_hit and chunk_id not in _all_ids(scenarios, q))
            if not keep:
                client.delete(name)
        answer = ask(url, question, docs, max_tokens, cluster.served, api_key=cluster.api_key)
        cb = answer["usage"]["cacheblend"]
        got = (frozenset(cb["hit_ids"]), int(cb.get("exact_cached_tokens", 0)) > 0)
        refs[(q, pattern)] = answer["text"] if got == pattern else None  # None: the pattern could not be rebuilt
    return refs


def _all_ids(scenarios: list[Scenario], q: int) -> set[str]:
    ids: set[str] = set()
    for s in scenarios:
        for o in s.outcomes:
            if o.question == q:
                ids |= set(o.hits) | set(o.misses)
    return ids


def summarize(scenario: Scenario, refs: dict) -> dict:
    """completed / failed / wrong / degraded per replica, hit rate, time to recover."""
    rows: dict = {}
    for replica in sorted({o.replica for o in scenario.outcomes}):
        mine = [o for o in scenario.outcomes if o.replica == replica]
        ok = [o for o in mine if o.ok]
        unverified = [o for o in ok if refs.get((o.question, o.pattern)) is None]
        wrong = [o for o in ok if refs.get((o.question, o.pattern)) not in (None, o.text)]
        degraded = [o for o in ok if o.text != refs.get((o.question, None))]
        rows[replica] = {"requests": len(mine), "completed": len(ok), "failed": len(mine) - len(ok),
                         "wrong": len(wrong), "unverified": len(unverified), "differs_from_healthy": len(degraded),
                         "all_hit": sum(o.all_hit for o in ok),
                         "errors": sorted({o.error.split(":")[0] for o in mine if o.error}),
                         "error_messages": sorted({o.error for o in mine if o.error})}
    end = scenario.events.get("fault_end")
    recover = None
    if end is not None:
        after = [o for o in scenario.outcomes if o.started >= end and o.all_hit]
        recover = min(o.finished for o in after) - end if after else None
    ok = [o for o in scenario.outcomes if o.ok]
    return {"scenario": scenario.name, "replicas": rows, "hit_rate": sum(len(o.hits) for o in ok) /
            max(1, sum(len(o.hits) + len(o.misses) for o in ok)), "recover_s": recover, **scenario.notes}


def format_faults(results: list[dict]) -> str:
    """The markdown table."""
    lines = ["| scenario | replica | requests | completed | failed | wrong | differs from healthy-cache answer "
             "(chunk recomputed) | chunk hit rate | time to recover hits | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("scenario", "replicas", "hit_rate",
                                                                          "recover_s"))
        recover = "—" if r["recover_s"] is None else f"{r['recover_s']:.1f} s"
        for name, row in r["replicas"].items():
            failed = str(row["failed"]) + (f" ({', '.join(row['errors'])})" if row["errors"] else "")
            wrong = str(row["wrong"]) + (f" (+{row['unverified']} unverified)" if row["unverified"] else "")
            lines.append(f"| {r['scenario']} | {name} | {row['requests']} | {row['completed']} | {failed} | {wrong} | "
                         f"{row['differs_from_healthy']} | {r['hit_rate']:.0%} | {recover} | {notes} |")
    return "\n".join(lines)


# ---- grammar scenarios: one server of its own, with its default grammar limits --------------------------------

BOMB_PROPERTIES = 10_000  # ~290 KB of json_schema, over the default --max-grammar-bytes (128 KiB)
BOMB_CLIENTS = 6
TIMED_REQUESTS = 5  # unrelated requests timed before the attack (the baseline) and during it; medians compared
BLOWN_PATTERN = "^(a{1000}){1000}$"  # compiles; its lexer gives up at the first token
GRAMMAR_LIMIT_S = 120.0  # one request of these scenarios, answered or not


def _schema_format(schema: dict) -> dict:
    """An OpenAI `response_format` asking for JSON that follows `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def wide_schema(num_properties: int) -> dict:
    """An object schema with `num_properties` string properties (a schema bomb when large)."""
    return {"type": "object", "properties": {f"property_{i}": {"type": "string"} for i in range(num_properties)}}


def _chat(url: str, model: str, *, max_tokens: int = 4, content: str = "Name a bee.", **extra) -> tuple[int, dict]:
    """One non-streamed chat completion: (status code, JSON body)."""
    import httpx

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=GRAMMAR_LIMIT_S)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"raw": response.text[:200]}


def _timed_chat(url: str, model: str) -> float:
    """Seconds for one unrelated 4-token chat request; raises unless it is a 200."""
    started = time.monotonic()
    status, body = _chat(url, model)
    if status != 200:
        raise RuntimeError(f"the unrelated request got HTTP {status}: {body}")
    return time.monotonic() - started


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def schema_bomb(server: Replica, model: str, num_properties: int = BOMB_PROPERTIES, clients: int = BOMB_CLIENTS,
                timed_requests: int = TIMED_REQUESTS) -> dict:
    """`timed_requests` rounds of `clients` bombs sent at once (one each, as #38 reported them) with one unrelated
    request timed from the moment they go out, after as many timed without them; bomb status codes, the latency ratio, the
    server's RSS before and after. (A flood, clients re-sending as fast as answers come, is another matter: it
    takes the event loop's JSON parsing from everyone, as it would from any server without a rate limit.)"""
    import httpx

    mib = 1024**2
    schema = wide_schema(num_properties)
    bomb = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Name a bee."}],
                       "response_format": _schema_format(schema)}).encode()  # encoded once: the client stays light
    _timed_chat(server.url, model)  # warm-up: the first request pays for lazy initialisation
    rss_before = rss_bytes(server.proc.pid)
    cpu_before = cpu_seconds(server.proc.pid)
    baseline = [_timed_chat(server.url, model) for _ in range(timed_requests)]
    cpu_baseline = cpu_seconds(server.proc.pid) - cpu_before  # the timed requests' own CPU, subtracted below
    statuses: list[int] = []
    codes: set[str] = set()
    lock = threading.Lock()

    def attack(go: threading.Barrier) -> None:
        with httpx.Client(timeout=GRAMMAR_LIMIT_S) as client:
            go.wait()
            response = client.post(f"{server.url}/v1/chat/completions", content=bomb,
                                   headers={"Content-Type": "application/json"})
            with lock:
                statuses.append(response.status_code)
                try:
                    codes.add(str(response.json()["error"]["code"]))
                except (ValueError, KeyError, TypeError):
                    codes.add(str(response.status_code))

    under_attack = []
    cpu_before = cpu_seconds(server.proc.pid)
    for _ in range(timed_requests):  # each round: the bombs and one timed request go out together
        go = threading.Barrier(clients + 1)
        threads = [threading.Thread(target=attack, args=(go,), daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        go.wait()
        under_attack.append(_timed_chat(server.url, model))
        for t in threads:
            t.join(GRAMMAR_LIMIT_S)
    cpu_bombs = cpu_seconds(server.proc.pid) - cpu_before - cpu_baseline
    base, attacked = _median(baseline), _median(under_attack)
    return {"bombs": len(statuses), "schema_bytes": len(json.dumps(schema).encode()),
            "bomb_statuses": dict(sorted((str(c), statuses.count(c)) for c in set(statuses))),
            "bomb_error_codes": sorted(codes), "baseline_s": round(base, 3), "under_attack_s": round(attacked, 3),
            "latency_ratio": round(attacked / base, 2), "rss_before_mib": round(rss_before / mib),
            "rss_after_mib": round(rss_bytes(server.proc.pid) / mib),
            "server_cpu_per_bomb_ms": round(1000 * cpu_bombs / max(len(statuses), 1), 1)}


def grammar_fails(server: Replica, model: str) -> dict:
    """A schema that does not compile and one that fails at its first token: status code and seconds of each."""
    blown = {"type": "object", "properties": {"a": {"type": "string", "pattern": BLOWN_PATTERN}}, "required": ["a"]}
    cases = {"ref_loop": {"$ref": "#"}, "blown_pattern": blown}
    result: dict = {}
    for name, schema in cases.items():
        started = time.monotonic()
        status, body = _chat(server.url, model, max_tokens=32, response_format=_schema_format(schema))
        result[name] = {"status": status, "seconds": round(time.monotonic() - started, 3),
                        "message": str((body.get("error") or {}).get("message", ""))[:80]}
    return result


def stop_in_json(server: Replica, model: str) -> dict:
    """A stop string that occurs inside the only answer a json_schema allows: does the answer parse, and why it
    finished, per stop string."""
    schema = {"type": "object", "properties": {"word": {"enum": ["bee, wasp"]}}, "required": ["word"]}
    cases = []
    for stop in (",", '"}'):
        status, body = _chat(server.url, model, max_tokens=24, content="A word?", stop=[stop],
                             response_format=_schema_format(schema))
        choice = (body.get("choices") or [{}])[0]
        content = (choice.get("message") or {}).get("content") or ""
        try:
            parsed = json.loads(content) == {"word": "bee, wasp"}
        except ValueError:
            parsed = False
        cases.append({"stop": stop, "status": status, "parses": parsed,
                      "finish_reason": choice.get("finish_reason"), "content": content[:60]})
    return {"cases": cases}


def run_grammar(scenarios, *, model: str, home: str | None, workdir: Path) -> list[dict]:
    """The grammar scenarios against one `cacheblend-rag serve` with its defaults; one result per scenario."""
    from cacheblend_rag import settings
    from cacheblend_rag.models.loader import model_folder
    from cacheblend_rag.serve.command import served_name

    if model == TINY_RANDOM:
        model = str(tiny_random_model(workdir / TINY_RANDOM, home))
    model_folder(model, home)  # converted once, into the home the server links to
    server_home = workdir / "home-grammar"
    server_home.mkdir()
    (server_home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    served = served_name(model)
    results = []
    with Replica(server_home, [], model=model, name="grammar") as server:
        for name in scenarios:
            started = time.monotonic()
            figures = {"schema_bomb": schema_bomb, "grammar_fails": grammar_fails,
                       "stop_in_json": stop_in_json}[name](server, served)
            results.append({"scenario": name, **figures})
            logger.warning("scenario %s: %.0f s", name, time.monotonic() - started)
    return results


def format_grammar(results: list[dict]) -> str:
    """The markdown table of the grammar scenarios: one row per case."""
    lines = ["| scenario | case | status | figures |", "|---|---|---|---|"]
    for r in results:
        if r["scenario"] == "schema_bomb":
            statuses = ", ".join(f"{n}× {c}" for c, n in r["bomb_statuses"].items())
            lines.append(f"| schema_bomb | {BOMB_CLIENTS} clients × {r['schema_bytes'] // 1000} KB schema, "
                         f"{r['bombs']} sent | {statuses} ({', '.join(r['bomb_error_codes'])}) | unrelated "
                         f"request {r['under_attack_s']:.3f} s vs {r['baseline_s']:.3f} s baseline = "
                         f"**{r['latency_ratio']:.2f}×** (target ≤ 2×); server CPU per bomb "
                         f"{r['server_cpu_per_bomb_ms']:.0f} ms; RSS {r['rss_before_mib']} → "
                         f"{r['rss_after_mib']} MiB |")
        elif r["scenario"] == "grammar_fails":
            for case in ("ref_loop", "blown_pattern"):
                row = r[case]
                lines.append(f"| grammar_fails | {case} | {row['status']} | answered in {row['seconds']:.3f} s: "
                             f"{row['message']} |")
        else:
            for row in r["cases"]:
                lines.append(f"| stop_in_json | stop=`{row['stop']}` | {row['status']} | parses as JSON: "
                             f"{'yes' if row['parses'] else 'no'}, finish_reason={row['finish_reason']} |")
    return "\n".join(lines)


# ---- privacy scenarios: what client B of a shared server learns about client A's requests ------------------------

KEY_A, KEY_B, METRICS_KEY = "faults-client-a", "faults-client-b", "faults-operator"
MEMO = ("Board memo: the Lyon plant closes on 30 June; its 212 staff move to the Grenoble site, announced to them "
        "on 2 June.")


def _keyed_chat(url: str, model: str, key: str, **extra) -> tuple[int, dict]:
    """One non-streamed 2-token chat completion under an API key: (status code, JSON body)."""
    import httpx

    body = {"model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Which site?"}], **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=GRAMMAR_LIMIT_S)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"raw": response.text[:200]}


def document_oracle(server: Replica, model: str) -> dict:
    """A sends MEMO; B asks for MEMO's chunk id and an edited memo's: B's two answers, and whether they differ."""
    from cacheblend_rag.ingest.chunks import chunk_id

    sent, _ = _keyed_chat(server.url, model, KEY_A, documents=[MEMO])
    answers = {}
    for name, text in (("sent_memo", MEMO), ("edited_memo", MEMO.replace("212", "213"))):
        cid = chunk_id(text)
        status, body = _keyed_chat(server.url, model, KEY_B, chunk_ids=[cid])
        answers[name] = {"status": status,
                         "message": str((body.get("error") or {}).get("message", "")).replace(cid, "<id>")[:80]}
    return {"a_status": sent, **answers, "oracle": answers["sent_memo"] != answers["edited_memo"]}


def _cached_tokens(url: str, key: str) -> tuple[int, float | None]:
    """(status of GET /metrics under `key`, cacheblend_cached_prompt_tokens_total or None when unreadable)."""
    import httpx

    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    match = re.search(r"^cacheblend_cached_prompt_tokens_total (\S+)$", response.text, re.MULTILINE)
    return response.status_code, float(match.group(1)) if response.status_code == 200 and match else None


def metrics_oracle(server: Replica, model: str) -> dict:
    """A sends a chat; B guesses it (exact, then wrong) and reads /metrics around each guess with its own key; the
    operator's key reads the same counter. B's status codes, and the counter's rise per guess as each key saw it."""
    prompt = f"{MEMO} Who was told, and when? (metrics probe)"
    _keyed_chat(server.url, model, KEY_A, messages=[{"role": "user", "content": prompt}])
    result: dict = {}
    for guess, content in (("exact", prompt), ("wrong", prompt.replace("212", "213"))):
        before = {key: _cached_tokens(server.url, key) for key in (KEY_B, METRICS_KEY)}
        _keyed_chat(server.url, model, KEY_B, messages=[{"role": "user", "content": content}])
        after = {key: _cached_tokens(server.url, key) for key in (KEY_B, METRICS_KEY)}
        for who, key in (("client", KEY_B), ("operator", METRICS_KEY)):
            (status, was), (_, now) = before[key], after[key]
            result[f"{who}_{guess}"] = {"status": status,
                                        "rise": None if was is None or now is None else now - was}
    client_rises = (result["client_exact"]["rise"], result["client_wrong"]["rise"])
    result["oracle"] = None not in client_rises and client_rises[0] != client_rises[1]
    return result


def run_privacy(scenarios, *, model: str, home: str | None, workdir: Path) -> list[dict]:
    """The privacy scenarios against one `cacheblend-rag serve` with keys A and B, --hide-cache-usage and
    --metrics-key; one result per scenario."""
    from cacheblend_rag import settings
    from cacheblend_rag.models.loader import model_folder
    from cacheblend_rag.serve.command import served_name

    if model == TINY_RANDOM:
        model = str(tiny_random_model(workdir / TINY_RANDOM, home))
    model_folder(model, home)
    server_home = workdir / "home-privacy"
    server_home.mkdir()
    (server_home / "models").symlink_to(settings.models_dir(), target_is_directory=True)
    results = []
    with Replica(server_home, [], "--api-key", KEY_A, "--api-key", KEY_B, "--hide-cache-usage", "--metrics-key",
                 METRICS_KEY, model=model, name="privacy") as server:
        for name in scenarios:
            started = time.monotonic()
            figures = {"document_oracle": document_oracle, "metrics_oracle": metrics_oracle}[name](
                server, served_name(model))
            results.append({"scenario": name, **figures})
            logger.warning("scenario %s: %.0f s", name, time.monotonic() - started)
    return results


def format_privacy(results: list[dict]) -> str:
    """The markdown table of the privacy scenarios: one row per probe."""
    lines = ["| scenario | probe | what client B saw | oracle |", "|---|---|---|---|"]
    for r in results:
        oracle = "**yes**" if r["oracle"] else "no"
        if r["scenario"] == "document_oracle":
            for case in ("sent_memo", "edited_memo"):
                row = r[case]
                lines.append(f"| document_oracle | B sends the chunk id of {case.replace('_', ' ')} | "
                             f"{row['status']}: {row['message']} | {oracle} |")
        else:
            for guess in ("exact", "wrong"):
                client, operator = r[f"client_{guess}"], r[f"operator_{guess}"]
                lines.append(f"| metrics_oracle | B's {guess} guess, /metrics read around it | {client['status']}"
                             f" (rise {client['rise']}); the operator's key: {operator['status']}, cached tokens "
                             f"+{operator['rise']} | {oracle} |")
    return "\n".join(lines)


def run(items: list[tuple[str, list[str]]], *, model: str, home: str | None, scenarios=SCENARIOS,
        num_requests: int = 24, clients: int = 4, max_tokens: int = 8, seed: int = 0,
        workdir: str | None = None) -> dict:
    """Every scenario (the cluster's, then the grammar ones on their own server), the references, the summaries."""
    from cacheblend_rag import settings

    models = settings.models_dir()
    cluster_scenarios = [n for n in scenarios if n in CLUSTER_SCENARIOS]
    grammar_scenarios = [n for n in scenarios if n in GRAMMAR_SCENARIOS]
    privacy_scenarios = [n for n in scenarios if n in PRIVACY_SCENARIOS]
    runs: list[Scenario] = []
    refs: dict = {}
    grammar: list[dict] = []
    privacy: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cacheblend-faults-", dir=workdir) as tmp:
        if cluster_scenarios:
            cluster = Cluster(Path(tmp), model, home)
            try:
                for name in cluster_scenarios:
                    started = time.monotonic()
                    runs.append(run_scenario(name, cluster, items, num_requests, clients, max_tokens, models, seed))
                    logger.warning("scenario %s: %.0f s", name, time.monotonic() - started)
                refs = references(cluster, items, runs, max_tokens, models)
            finally:
                cluster.stop()
        if grammar_scenarios:
            grammar = run_grammar(grammar_scenarios, model=model, home=home, workdir=Path(tmp))
        if privacy_scenarios:
            privacy = run_privacy(privacy_scenarios, model=model, home=home, workdir=Path(tmp))
    results = [summarize(s, refs) for s in runs]
    return {"results": results, "grammar": grammar, "privacy": privacy, "requests": num_requests, "clients": clients,
            "max_tokens": max_tokens, "questions": len(items), "chunks": len(items[0][1]) if items else 0}

"""KV-cache events on the wire (`--kv-events-config`): vLLM's format, so that what consumes
vLLM's events (llm-d's KV-cache indexer, SMG) consumes ours.

Every scheduler step that changed the radix cache publishes one batch on a ZMQ PUB socket as
three frames: the topic (bytes, as configured), the batch's sequence number (8 bytes,
big-endian, from 0, per publisher) and the msgpack payload, arrays throughout (msgspec's
`array_like` layout that vLLM uses):

    KVEventBatch      [ts (float, Unix seconds), [event, ...], dp_rank]
    BlockStored       ["BlockStored", [block hash, ...], parent block hash | None, [token id, ...],
                       block_size, lora_id (None), medium ("GPU"), lora_name (None)]
    BlockRemoved      ["BlockRemoved", [block hash, ...], medium ("GPU")]
    AllBlocksCleared  ["AllBlocksCleared"]

Block hashes are unsigned 64-bit chained hashes (kvcache/events.py says how to compute them).
Medium is "GPU" on every device: it names the engine's own KV cache, the tier vLLM and llm-d
call GPU (as opposed to an offloaded copy).

Replay: with `replay_endpoint`, a ROUTER socket answers a request frame holding a start
sequence number (8 bytes, big-endian; from a REQ, or a DEALER that sends an empty delimiter
first) with every buffered batch from there on, [seq, payload] each, then [-1 (8 bytes,
signed), b""]. The last `buffer_steps` batches are kept.

With --dp, replica r publishes on the endpoint's port + r (ipc://: the path + "_dp<r>"), and
its replay endpoint likewise; every batch carries its dp_rank. Sockets bind when the endpoint
has a wildcard host (`*`, `::`) or is ipc://, else connect (an indexer that binds, as vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgpack
import zmq

from minisgl.logging_setup import get_logger

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """The `--kv-events-config` JSON object. vLLM's fields (a vLLM config works unchanged),
    plus `hash_seed` (the block hash's seed, kvcache/events.py)."""

    publisher: str = "zmq"  # "zmq", or "null": no events
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: batches queued per subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    hash_seed: str = ""
    enable_kv_cache_events: bool = True  # vLLM's switch; false turns the events off

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _bad(name: str, why: str) -> ValueError:
    return ValueError(f"--kv-events-config: {name}: {why}")


def _check_endpoint(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
        raise _bad(name, f"must be a tcp://HOST:PORT or ipc://PATH address, got {value!r}")
    if value.startswith("tcp://"):
        port = value.rsplit(":", 1)[-1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(name, f"needs a port in [1, 65535], got {value!r}")


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The config, None when events are off; a ValueError naming the field otherwise."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--kv-events-config: not valid JSON ({e}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--kv-events-config: must be a JSON object, got {text!r}")
    fields = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    for name in raw:
        if name not in fields:
            raise _bad(name, f"unknown field (known: {', '.join(fields)})")
    for name in ("topic", "hash_seed"):
        if name in raw and not isinstance(raw[name], str):
            raise _bad(name, f"must be a string, got {raw[name]!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        v = raw.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(name, f"must be an integer >= 1, got {v!r}")
    if not isinstance(raw.get("enable_kv_cache_events", True), bool):
        raise _bad("enable_kv_cache_events", f"must be true or false, got {raw['enable_kv_cache_events']!r}")
    if raw.get("publisher", "zmq") not in ("zmq", "null"):
        raise _bad("publisher", f'must be "zmq" or "null", got {raw["publisher"]!r}')
    endpoint = raw.get("endpoint", KVEventsConfig.endpoint)
    _check_endpoint("endpoint", endpoint)
    _check_endpoint("replay_endpoint", raw.get("replay_endpoint"), optional=True)
    if raw.get("replay_endpoint") == endpoint:
        raise _bad("replay_endpoint", "must differ from endpoint")
    cfg = KVEventsConfig(**raw)
    return cfg if cfg.enabled else None


def endpoint_for(endpoint: str, dp_rank: int) -> str:
    """Replica `dp_rank`'s endpoint: the port + dp_rank (tcp), the path + "_dp<rank>" (ipc)."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{dp_rank}"
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + dp_rank}"


def check_replicas(cfg: KVEventsConfig, dp: int) -> None:
    """With --dp, replica r takes the port + r (endpoint_for): each range must fit below 65536
    and the publish and replay ranges must not meet, else a replica's bind fails mid-start."""
    named = [("endpoint", cfg.endpoint)] + ([("replay_endpoint", cfg.replay_endpoint)] if cfg.replay_endpoint else [])
    for name, value in named:
        if value.startswith("tcp://") and int(value.rsplit(":", 1)[-1]) + dp - 1 > 65535:
            raise _bad(name, f"with --dp {dp} the replicas use ports up to {value} + {dp - 1}, past 65535")
    if cfg.replay_endpoint is not None:
        pubs = {endpoint_for(cfg.endpoint, r) for r in range(dp)}
        clash = sorted(pubs & {endpoint_for(cfg.replay_endpoint, r) for r in range(dp)})
        if clash:
            raise _bad(
                "replay_endpoint",
                f"with --dp {dp} replica r publishes on the endpoint's port + r and replays on the replay port "
                f"+ r; both use {clash[0]}: put the two ports at least {dp} apart",
            )


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def wire_event(event: tuple[Any, ...], block_size: int) -> list[Any]:
    """A cache change (kvcache/events.py's tuples) as vLLM's array-encoded event."""
    kind = event[0]
    if kind == "stored":
        _, hashes, parent, tokens = event
        return ["BlockStored", hashes, parent, tokens, block_size, None, MEDIUM, None]
    if kind == "removed":
        return ["BlockRemoved", event[1], MEDIUM]
    if kind == "cleared":
        return ["AllBlocksCleared"]
    raise ValueError(f"unknown cache event {kind!r}")


def encode_batch(events: list[tuple[Any, ...]], block_size: int, dp_rank: int, ts: float | None = None) -> bytes:
    """One KVEventBatch payload."""
    batch = [time.time() if ts is None else ts, [wire_event(e, block_size) for e in events], dp_rank]
    return msgpack.packb(batch, use_bin_type=True)


log = get_logger("minisgl.kv_events")


class KVEventPublisher:
    """The PUB socket (and the replay ROUTER), served by a thread of their own: the scheduler
    hands each batch over an inproc socket and never waits on a subscriber. The sockets are
    bound or connected here, so a taken port fails the scheduler's start."""

    def __init__(self, cfg: KVEventsConfig, block_size: int, dp_rank: int = 0) -> None:
        self.block_size, self.dp_rank = block_size, dp_rank
        self.endpoint = endpoint_for(cfg.endpoint, dp_rank)
        self.replay_endpoint = None if cfg.replay_endpoint is None else endpoint_for(cfg.replay_endpoint, dp_rank)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        inproc = f"inproc://kv-events-{id(self)}"
        self._feed_in = self._ctx.socket(zmq.PULL)
        self._feed_in.bind(inproc)
        self._feed = self._ctx.socket(zmq.PUSH)
        self._feed.setsockopt(zmq.SNDHWM, cfg.max_queue_size)
        self._feed.setsockopt(zmq.LINGER, 0)
        self._feed.connect(inproc)
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = count()
        self.dropped = 0  # batches refused because the publisher thread fell behind
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple[Any, ...]]) -> None:
        """Queues one batch (nothing when `events` is empty). Never blocks the scheduler: a batch
        the thread has no room for is dropped and counted (subscribers see the sequence gap)."""
        if not events:
            return
        try:
            self._feed.send(encode_batch(events, self.block_size, self.dp_rank), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped % 1000 == 1:  # the first, then every 1000th: loud, not a flood
                log.warning("KV events: %d batch(es) dropped so far (the publisher thread fell behind; "
                            "subscribers see a gap in the sequence numbers and can replay)", self.dropped)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._feed_in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if self._feed_in in ready:
                    payload = self._feed_in.recv()
                    seq = next(self._seq)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
            except zmq.ContextTerminated:  # close(): the sockets are this thread's to close
                for sock in (self._pub, self._replay, self._feed_in):
                    if sock is not None:
                        sock.close(0)
                return

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not [identity, delimiter, start seq]: nothing sensible to answer
        ident, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))

    def close(self) -> None:
        self._feed.close(0)
        self._ctx.term()  # the thread's poll raises ContextTerminated and it closes its sockets
        self._thread.join(2.0)

"""KV-cache events (`--kv-events-config`): the config's errors, the block hash, and the events
of a scheduler under random traffic received by a real subscriber (pyzmq SUB + msgpack, the
replay socket for what it missed), from which the cached prefixes are rebuilt and compared
with the radix cache itself."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from kv_events_harness import receive, replay

from minisgl import LLM, SamplingParams
from minisgl.kvcache.events import CacheEvents
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.message.kv_events import (
    KVEventPublisher,
    check_replicas,
    endpoint_for,
    parse_kv_events_config,
    wire_event,
)
from minisgl.scheduler.config import scheduler_config
from minisgl.scheduler.scheduler import Scheduler

SEED = "42"
TOPIC = b"kv@pod@tiny"  # the publisher's topic in the 500-request test


def reference_hash(parent: int, tokens: list[int]) -> int:
    """llm-d's token processor, written out: low 64 bits of sha256(canonical CBOR([parent,
    tokens, null])), for tokens and parents of the sizes used here (CBOR heads by hand)."""

    def uint(v: int) -> bytes:
        for info, size in ((None, 0), (24, 1), (25, 2), (26, 4), (27, 8)):
            if info is None and v < 24:
                return bytes([v])
            if info is not None and v < 1 << (8 * size):
                return bytes([info]) + v.to_bytes(size, "big")
        raise AssertionError(v)

    body = b"\x83" + uint(parent) + bytes([0x80 | len(tokens)]) + b"".join(uint(t) for t in tokens) + b"\xf6"
    return int.from_bytes(hashlib.sha256(body).digest()[-8:], "big")


def reference_root(seed: str) -> int:
    return int.from_bytes(hashlib.sha256(bytes([0x60 | len(seed)]) + seed.encode()).digest()[-8:], "big")


def test_block_hashes_chain_as_llm_d_computes_them() -> None:
    ev = CacheEvents(3, SEED)
    assert ev.root == reference_root(SEED)
    tokens = [1, 23, 24, 255, 256, 65535, 65536, 151000, 7]
    hashes = ev.block_hashes(None, tokens + [5, 6])  # a trailing partial block has no hash
    want, h = [], ev.root
    for i in range(0, 9, 3):
        h = reference_hash(h, tokens[i : i + 3])
        want.append(h)
    assert hashes == want
    assert ev.block_hashes(want[0], tokens[3:]) == want[1:]  # a run continues from its parent
    assert CacheEvents(3, "").root != ev.root  # the seed matters


@pytest.mark.parametrize(
    "text, field",
    [
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
        ('{"endpoint": "tcp://*:99999"}', "endpoint"),
        ('{"replay_endpoint": 5558}', "replay_endpoint"),
        ('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}', "replay_endpoint"),
        ('{"topic": 3}', "topic"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"hwm": true}', "hwm"),
        ('{"hash_seed": 42}', "hash_seed"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"endpiont": "tcp://*:5557"}', "endpiont"),
    ],
)
def test_bad_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"--kv-events-config: .*{field}" if "JSON" not in field else field):
        parse_kv_events_config(text)


def test_config_defaults_and_off() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert cfg is not None and (cfg.endpoint, cfg.topic, cfg.replay_endpoint) == ("tcp://*:5557", "kv", None)
    assert parse_kv_events_config('{"publisher": "null"}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert endpoint_for("tcp://*:5557", 2) == "tcp://*:5559" and endpoint_for("ipc:///tmp/e", 1) == "ipc:///tmp/e_dp1"


def test_replica_ports_checked_against_dp() -> None:
    def check(text: str, dp: int) -> None:
        cfg = parse_kv_events_config(text)
        assert cfg is not None
        check_replicas(cfg, dp)

    check('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}', 1)
    check('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"}', 2)
    check('{"endpoint": "ipc:///tmp/kv", "replay_endpoint": "ipc:///tmp/kv_replay"}', 4)
    with pytest.raises(ValueError, match=r"--kv-events-config: replay_endpoint: .*tcp://\*:5558.* at least 2 apart"):
        check('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}', 2)
    with pytest.raises(ValueError, match="--kv-events-config: endpoint: .*past 65535"):
        check('{"endpoint": "tcp://*:65535"}', 2)


def test_bad_config_is_a_startup_error(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "minisgl.serve",
        "--device",
        "cpu",
        "--model",
        str(tiny_model_path("llama3")),
        "--kv-events-config",
        '{"publisher": "zmq", "endpoint": "udp://x:1"}',
    ]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--kv-events-config: endpoint:" in out.stderr, out.stderr[-2000:]


class Mirror:
    """A consumer's view, from events alone: live block hash -> (parent hash, its tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, event: list) -> None:
        if event[0] == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = event
            assert (lora_id, medium, lora_name) == (None, "GPU", None)
            assert len(tokens) == block_size * len(hashes)
            for i, h in enumerate(hashes):
                assert h not in self.blocks, "a block stored twice"
                self.blocks[h] = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
                parent = h
        elif event[0] == "BlockRemoved":
            for h in event[1]:
                del self.blocks[h]
        else:
            assert event == ["AllBlocksCleared"]
            self.blocks.clear()

    def prefixes(self, root: int) -> dict[tuple[int, ...], int]:
        """Each live block's whole prefix (following parents), and that its hash is the
        reference hash of it."""
        out = {}
        for h in self.blocks:
            chain, cur = [], h
            while cur is not None:
                parent, tokens = self.blocks[cur]  # KeyError: a block outlived its parent
                chain.append(tokens)
                cur = parent
            prefix = tuple(t for tokens in reversed(chain) for t in tokens)
            out[prefix] = h
        for prefix, h in out.items():
            want = root
            for i in range(0, len(prefix), len(self.blocks[h][1])):
                want = reference_hash(want, list(prefix[i : i + len(self.blocks[h][1])]))
            assert want == h
        return out


def test_radix_cache_events_mirror_the_tree() -> None:
    """Inserts that split edges, locks, evictions and a reset: after each, the events rebuild
    exactly the cached prefixes (no engine: the cache alone)."""
    rng = random.Random(5)
    ev = CacheEvents(2, SEED)
    cache = RadixCache(2, ev)
    mirror, next_page, locked = Mirror(), 1, []
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for step in range(400):
        op = rng.random()
        if op < 0.6:
            ids = rng.choice(stems)[: rng.randrange(0, 13)] + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            ids = ids[: len(ids) // 2 * 2]
            pages = list(range(next_page, next_page + len(ids) // 2))
            next_page += len(pages)
            if ids:
                cache.insert(ids, pages)
            if rng.random() < 0.3:
                m = cache.match_prefix(ids)
                cache.lock(m.handle)
                locked.append(m.handle)
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.97:
            cache.evict(rng.randrange(1, 6))
        elif not locked:
            cache.reset()
        for event in ev.drain():
            mirror.apply(wire_event(event, 2))
        assert set(mirror.prefixes(ev.root)) == set(cache.cached_prefixes()), step
        cache.check_integrity()


def test_events_of_500_requests_rebuild_the_radix_cache(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    page, pool = 4, 48  # 192 token slots: the prompts below evict each other all the time
    llm = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32", page_size=page, num_pages=pool)
    events = CacheEvents(page, SEED)
    opts = {"max_prefill_tokens": 128, "mixed_chunk_tokens": 128}
    sched = Scheduler(llm.engine, scheduler_config(opts, llm.engine.attn.name, "cpu"), None, events)
    cfg = parse_kv_events_config(
        f'{{"endpoint": "ipc://{tmp_path}/kv", "replay_endpoint": "ipc://{tmp_path}/replay", '
        f'"topic": "{TOPIC.decode()}", "hash_seed": "{SEED}"}}'
    )
    publisher = KVEventPublisher(cfg, page, dp_rank=0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    got: dict[int, list] = {}
    rng = random.Random(36)
    stems = [[rng.randrange(100, 5000) for _ in range(24)] for _ in range(6)]
    pending, flushes = 500, [350, 250, 120]  # flush when this many are still to come
    finished: list = []

    def step() -> None:
        finished.extend(r for r in sched.step() if r.finished)
        publisher.publish(events.drain())

    try:
        while pending or sched.has_work:
            for _ in range(rng.choice([1, 2, 4, 8])):
                if pending:
                    own = [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 6))]
                    prompt = rng.choice(stems)[: rng.randrange(1, 25)] + own
                    params = SamplingParams(max_tokens=rng.randint(1, 3), temperature=0.0, ignore_eos=True)
                    sched.add(llm._make_request(prompt, params))
                    pending -= 1
            if flushes and pending <= flushes[0]:
                flushes.pop(0)
                while flushes == [120] and sched.has_work:  # the second flush: once idle, it must succeed
                    step()
                held, before = sched.cache.protected_pages, sched.cache.cached_pages
                refused = sched.flush_cache()  # refused exactly while requests hold cached pages
                assert (refused is None) == (held == 0) and (refused is None or len(flushes) != 1)
                assert sched.cache.cached_pages == (before if refused else 0)
            step()
            if pending <= 400 and not sub.get(zmq.LAST_ENDPOINT):  # joins late: replay brings the start
                sub.connect(publisher.endpoint)
            receive(sub, got, TOPIC, quiet_ms=0)
        publisher.publish(events.drain())
        time.sleep(0.2)
        receive(sub, got, TOPIC, quiet_ms=500)
        assert got and min(got) > 0, "the subscriber should have missed the first batches"
        got.update(replay(publisher.replay_endpoint))
    finally:
        sub.close()
        publisher.close()
    assert len(finished) == 500 and sorted(got) == list(range(len(got))), "a batch is missing"
    mirror, kinds = Mirror(), set()
    for seq in sorted(got):
        ts, batch, dp_rank = got[seq]
        assert dp_rank == 0 and abs(ts - time.time()) < 600 and batch
        for event in batch:
            kinds.add(event[0])
            mirror.apply(event)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    cached = sched.cache.cached_prefixes()
    assert len(cached) > 20 and set(mirror.prefixes(events.root)) == set(cached)
    sched.check_integrity()

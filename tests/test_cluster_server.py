"""One server as the cluster schedulers see it (issue 36), through their own clients: llm-d's
vLLM-profile gauges read with prometheus_client's parser, SMG's /v1/loads and /flush_cache,
`cached_tokens` and `priority` through the openai client, and KV-cache events through a pyzmq
subscriber, checked against the server's radix cache as the server itself reports it (each
probe's cached_tokens)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from kv_events_harness import receive, replay
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server, metric, wait_for

NAME, PAGE, PAGES = "tiny", 4, 64
USABLE = PAGES - 1  # page 0 is the dummy page (padding tokens write there)


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_events")


@pytest.fixture(scope="module")
def server(
    tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory, events_dir: Path
) -> Server:
    events = f'{{"endpoint": "ipc://{events_dir}/pub", "replay_endpoint": "ipc://{events_dir}/replay", "topic": "kv"}}'
    s = Server(
        "--model",
        str(tiny_model_path("llama3")),
        "--served-model-name",
        NAME,
        "--num-tokenizers",
        "0",
        "--page-size",
        str(PAGE),
        "--num-pages",
        str(PAGES),
        "--scheduling-policy",
        "priority",
        "--kv-events-config",
        events,
        cwd=tmp_path_factory.mktemp("cluster_server"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 5000) for _ in range(n)]


def _families(http: httpx.Client) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def test_vllm_profile_gauges(http: httpx.Client, client: openai.OpenAI) -> None:
    # The replica's first report (sent as its loop starts) reaches the API server on its own channel;
    # the port opens only once it is in (launcher._first_reports), so the first scrape has samples.
    fams = _families(http)
    assert {n for n in fams if n.startswith("vllm:")} == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    } and not any(n.startswith("sglang") for n in fams)
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels == {"engine": "0", "block_size": str(PAGE), "num_gpu_blocks": str(USABLE)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        (s,) = fams[name].samples
        assert fams[name].type == "gauge" and s.labels == {"engine": "0", "model_name": NAME}
    # While a request decodes: running 1, and the usage is the share of pages requests hold.
    stream = client.completions.create(
        model=NAME, prompt=_ids(random.Random(1), 30), max_tokens=150, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))

    def busy() -> bool:
        fams = _families(http)
        return fams["vllm:num_requests_running"].samples[0].value == 1

    assert wait_for(busy, 30)
    usage = _families(http)["vllm:kv_cache_usage_perc"].samples[0].value
    total = metric(http, "minisgl_kv_slots_total")
    # The one running request holds its own pages (a random prompt: nothing cached): 31 to
    # 180 tokens of them, a page ahead at most.
    assert -(-31 // PAGE) * PAGE / total <= usage <= (-(-180 // PAGE) + 1) * PAGE / total
    stream.close()  # aborts it


def test_smg_worker_contract(http: httpx.Client) -> None:
    assert http.get("/v1/models").json()["data"][0]["owned_by"] == "sglang"
    body = http.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert body["dp_rank_count"] == 1 and body["timestamp"]
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == PAGE * USABLE
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(load)
    assert http.get("/v1/loads").json()["loads"][0].keys() == load.keys()  # "all" by default
    err = http.get("/v1/loads", params={"include": "core,gpu"}).json()["error"]
    assert err["param"] == "include" and "gpu" in err["message"]
    info = http.get("/server_info").json()
    assert (info["served_model_name"], info["page_size"], info["dp_size"]) == (NAME, PAGE, 1)
    assert http.get("/model_info").json()["is_generation"] is True


def test_cached_tokens(client: openai.OpenAI) -> None:
    prompt = _ids(random.Random(2), 23)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (23 - 1) // PAGE * PAGE  # whole pages, one to compute
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt + [7], max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 23 // PAGE * PAGE
    messages = [{"role": "user", "content": "the same question, twice over"}]
    chat = [client.chat.completions.create(model=NAME, messages=messages, max_tokens=2) for _ in range(2)]
    n = chat[1].usage.prompt_tokens
    assert chat[1].usage.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE > 0
    streamed = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE
    answers = [client.responses.create(model=NAME, input="asked of the Responses API", max_output_tokens=2)
               for _ in range(2)]
    n = answers[1].usage.input_tokens
    # (the first shares the template's head with the chat requests above)
    assert answers[0].usage.input_tokens_details.cached_tokens < answers[1].usage.input_tokens_details.cached_tokens
    assert answers[1].usage.input_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE


def test_flush_cache(http: httpx.Client, client: openai.OpenAI) -> None:
    prompt = _ids(random.Random(3), 21)
    client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # flushed
    # A request reading the cached prompt holds its pages: the flush is refused, saying why.
    stream = client.completions.create(
        model=NAME, prompt=prompt + [9, 9], max_tokens=150, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    r = http.post("/flush_cache")
    err = r.json()["error"]
    assert r.status_code == 409 and err["code"] == "cache_in_use" and "in use by 1 running request" in err["message"]
    stream.close()
    assert wait_for(lambda: http.post("/flush_cache").status_code == 200, 30)
    assert http.get("/flush_cache").status_code == 405


def test_priority_overtakes_a_burst(server: Server, http: httpx.Client) -> None:
    """Six priority-5 requests fill the KV pool (three run, three wait); a priority-0 request sent
    then finishes before any of the waiting ones has produced a token, and before any running
    one has finished: a low one is retracted to let it in at the next step."""
    rng = random.Random(4)
    first_token: dict[int, float] = {}

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as oai:

            async def low(i: int) -> None:
                stream = await oai.completions.create(
                    model=NAME,
                    prompt=_ids(rng, 8),
                    max_tokens=100,
                    stream=True,
                    extra_body={"ignore_eos": True, "priority": 5},
                )
                async for _ in stream:
                    first_token.setdefault(i, time.monotonic())

            lows = [asyncio.create_task(low(i)) for i in range(6)]
            while True:  # three running (each has streamed a token), the others waiting
                w = http.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"]
                if w >= 2 and len(first_token) + w == 6:
                    break
                await asyncio.sleep(0.02)
            waiting = {i for i in range(6) if i not in first_token}
            urgent = await oai.completions.create(
                model=NAME, prompt=_ids(rng, 30), max_tokens=4, extra_body={"ignore_eos": True, "priority": 0}
            )
            assert urgent.usage.completion_tokens == 4 and not any(t.done() for t in lows)
            late = [i for i in waiting if i in first_token]
            assert len(waiting) >= 2 and not late, (waiting, late)
            for task in lows:  # their clients leave: the server aborts them
                task.cancel()
            await asyncio.gather(*lows, return_exceptions=True)

    asyncio.run(run())
    assert wait_for(lambda: http.get("/v1/loads").json()["loads"][0]["num_total_reqs"] == 0, 30)


def test_kv_events_match_the_radix_cache(http: httpx.Client, client: openai.OpenAI, events_dir: Path) -> None:
    """Every batch since the start (the replay socket, then the live stream) rebuilds the cached
    blocks; for each probe, the longest run of its whole pages among them is what the server
    then reports as its cached_tokens."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"ipc://{events_dir}/pub")
    time.sleep(0.3)
    got = replay(f"ipc://{events_dir}/replay")
    blocks: dict[int, tuple] = {}  # hash -> its whole prefix
    applied = -1

    def apply() -> None:
        nonlocal applied
        receive(sub, got, b"kv")  # a request's batch is published before its reply leaves
        assert sorted(got) == list(range(len(got))), "a batch is missing"
        for seq in range(applied + 1, len(got)):
            ts, batch, dp_rank = got[seq]
            assert dp_rank == 0
            for ev in batch:
                if ev[0] == "BlockStored":
                    prefix = () if ev[2] is None else blocks[ev[2]]
                    for i, h in enumerate(ev[1]):
                        prefix = prefix + tuple(ev[3][i * PAGE : (i + 1) * PAGE])
                        blocks[h] = prefix
                elif ev[0] == "BlockRemoved":
                    for h in ev[1]:
                        del blocks[h]
                else:
                    blocks.clear()
        applied = len(got) - 1

    rng = random.Random(5)
    stems = [_ids(rng, 40) for _ in range(3)]
    cached, hits = set(), 0
    for i in range(24):
        prompt = rng.choice(stems)[: rng.randrange(4, 41)] + _ids(rng, rng.randrange(1, 4))
        if i in (6, 18):  # most of the pool's 252 slots: the cached stems are evicted
            prompt = _ids(rng, 200)
        apply()
        cached = set(blocks.values())
        want = 0
        while want + PAGE <= len(prompt) - 1 and tuple(prompt[: want + PAGE]) in cached:
            want += PAGE
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=rng.randint(1, 3))
        assert out.usage.prompt_tokens_details.cached_tokens == want, i
        hits += want > 0
        if i == 12:
            assert http.post("/flush_cache").status_code == 200
    apply()
    sub.close(0)
    assert hits >= 8
    kinds = {ev[0] for b in got.values() for ev in b[1]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds


def test_the_port_waits_for_every_replicas_first_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """launcher._first_reports: it returns once every replica (dp rank) has reported, not before; at
    once when a child has died; and past its timeout with a warning naming the missing ranks."""
    import asyncio
    import types

    from minisgl.launch import launcher
    from minisgl.message import StatsMsg

    def report(rank: int) -> StatsMsg:
        return StatsMsg(0, 0, 0, 16, 0, 0, dp_rank=rank)

    async def scenario(replicas: int, arrivals: list[int], failed: list[str]) -> float:
        latest: dict[int, StatsMsg] = {}
        frontend = types.SimpleNamespace(metrics=types.SimpleNamespace(replicas=types.SimpleNamespace(latest=latest)))

        async def arrive() -> None:
            for rank in arrivals:
                await asyncio.sleep(0.05)
                latest[rank] = report(rank)

        feeder = asyncio.create_task(arrive())
        loop = asyncio.get_running_loop()
        start = loop.time()
        await launcher._first_reports(frontend, replicas, failed)
        waited = loop.time() - start
        assert len(latest) >= replicas or failed or waited >= launcher.FIRST_REPORT_TIMEOUT_S
        feeder.cancel()
        return waited

    assert 0.09 <= asyncio.run(scenario(2, [1, 0], [])) < 1.0  # both ranks: after the second report
    assert asyncio.run(scenario(2, [], ["scheduler died"])) < 0.05
    monkeypatch.setattr(launcher, "FIRST_REPORT_TIMEOUT_S", 0.2)
    said: list[str] = []
    monkeypatch.setattr(launcher.log, "warning", lambda msg, *args: said.append(msg % args))
    assert 0.2 <= asyncio.run(scenario(2, [1], [])) < 1.0
    assert len(said) == 1 and "dp ranks [1] of 2" in said[0]

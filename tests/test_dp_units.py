"""Data parallelism without processes: the dispatcher's policy, device placement, the DP
controller, per-replica metrics, and the sglang-router body shim."""

from __future__ import annotations

import json
import random

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from minisgl.core.sampling_params import SamplingParams
from minisgl.dp.controller import Controller
from minisgl.dp.dispatch import Dispatcher, PrefixTable, block_hashes
from minisgl.launch.args import ServerArgs
from minisgl.launch.cli import parse_args
from minisgl.message import AbortMsg, DetokInit, StatsMsg, UserMsg, decode, encode
from minisgl.message.addresses import Addresses
from minisgl.models import source
from minisgl.server.replica_metrics import ReplicaStats
from minisgl.server.router_compat import RouterFieldsShim, strip_neutral_fields


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


# ---- placement ----


@pytest.mark.parametrize("dp,tp,base", [(2, 1, 0), (2, 2, 0), (3, 2, 1), (4, 1, 3)])
def test_replica_r_rank_t_runs_on_gpu_base_plus_r_tp_plus_t(dp: int, tp: int, base: int) -> None:
    args = ServerArgs(device="cuda", dp=dp, tp=tp, base_gpu_id=base)
    got = {(r, t): args.engine_config(tp_rank=t, dp_rank=r).torch_device for r in range(dp) for t in range(tp)}
    want = {(r, t): torch.device("cuda", base + r * tp + t) for r in range(dp) for t in range(tp)}
    assert got == want
    assert len(set(got.values())) == dp * tp  # no two ranks share a GPU


def test_placement_flags_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    # No --model: parsing resolves the built-in model (a fetch on a machine without it); not tested here.
    monkeypatch.setattr(source, "default_model_path", lambda: None)
    args = parse_args(["--device", "cuda", "--dp", "2", "--tp", "2", "--base-gpu-id", "4", "--served-model-name", "m"])
    assert (args.dp, args.tp, args.base_gpu_id) == (2, 2, 4)
    assert args.engine_config(tp_rank=1, dp_rank=1).torch_device == torch.device("cuda", 7)
    assert parse_args(["--device", "cpu", "--dp-size", "3", "--served-model-name", "m"]).dp == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dp": 0}, "--dp must be >= 1"),
        ({"dp": 2, "tp": 2, "nnodes": 2, "dist_init_addr": "h:1"}, "sglang-router"),
        ({"base_gpu_id": -1}, "--base-gpu-id must be >= 0"),
        ({"device": "cuda:1", "dp": 2}, "give --device cuda and --base-gpu-id"),
        ({"device": "cuda:1", "base_gpu_id": 2}, "names one GPU"),
        ({"load_balance_method": "fastest"}, "--load-balance-method"),
    ],
)
def test_bad_dp_flags_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_replica_addresses() -> None:
    one = Addresses.ipc("/tmp/x", 1)
    assert one.for_replica(0) is one and one.stats is None and one.replicas == []
    two = Addresses.ipc("/tmp/x", 1, dp=2)
    r1 = two.for_replica(1)
    assert r1.scheduler == two.replicas[1] != two.scheduler
    assert r1.stats == two.scheduler  # load reports go to the DP controller
    assert len(set(two.replicas) | {two.scheduler, two.api, two.detokenizer}) == 5


# ---- dispatcher ----


def test_prefix_affinity_sends_a_shared_prefix_where_it_was_sent_before() -> None:
    rng = random.Random(0)
    d = Dispatcher(3, "prefix")
    shared = _prompt(rng, 200)
    first = d.pick(shared + _prompt(rng, 10))
    for r in range(3):  # idle replicas: every later request with the prefix follows the first
        d.on_report(r, 0, d.loads[r].sent)
    for _ in range(5):
        assert d.pick(shared + _prompt(rng, 10)) == first
        d.on_report(first, 0, d.loads[first].sent)
    # An unrelated prompt goes to the least loaded replica, not the affine one.
    d.on_report(first, 5000, d.loads[first].sent)
    assert d.pick(_prompt(rng, 50)) != first


def test_prefix_affinity_yields_to_load_when_the_gap_exceeds_the_prefix() -> None:
    rng = random.Random(1)
    d = Dispatcher(2, "prefix")
    shared = _prompt(rng, 96)  # 6 blocks of 16
    home = d.pick(shared + _prompt(rng, 4))
    other = 1 - home
    # Busier than the other replica by less than the 96 tokens it holds: it still wins ...
    d.on_report(home, 90, d.loads[home].sent)
    d.on_report(other, 0, d.loads[other].sent)
    assert d.pick(shared + _prompt(rng, 4)) == home
    # ... by more: the other one prefills the prefix itself.
    d.on_report(home, 200, d.loads[home].sent)
    assert d.pick(shared + _prompt(rng, 4)) == other
    # Both hold it now: the less loaded wins.
    d.on_report(other, 150, d.loads[other].sent)
    assert d.pick(shared + _prompt(rng, 4)) == other
    d.on_report(other, 250, d.loads[other].sent)
    assert d.pick(shared + _prompt(rng, 4)) == home


@pytest.mark.parametrize("method", ["prefix", "load"])
def test_a_burst_between_two_reports_spreads_evenly(method: str) -> None:
    """No report arrives during the burst: the requests sent count as load until one does."""
    rng = random.Random(2)
    d = Dispatcher(4, method)
    picks = [d.pick(_prompt(rng, 64)) for _ in range(64)]
    assert [picks.count(r) for r in range(4)] == [16] * 4
    # A report covering some of them replaces exactly those with the replica's own number.
    d.on_report(0, 10, received=10)
    assert d.loads[0].tokens == 10 + 6 * 64
    d.on_report(0, 0, received=16)
    assert d.loads[0].tokens == 0


def test_round_robin_and_bad_methods() -> None:
    d = Dispatcher(3, "round_robin")
    assert [d.pick([1, 2, 3]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="method must be one of"):
        Dispatcher(2, "random")
    with pytest.raises(ValueError, match="num_replicas"):
        Dispatcher(0)


def test_block_hashes_are_page_aligned_prefix_chains() -> None:
    ids = list(range(100))
    d = Dispatcher(2, "prefix", page_size=6)
    assert d.block == 18  # 16 rounded up to whole pages of 6
    h = block_hashes(ids, 16)
    assert len(h) == 6  # full blocks only
    assert block_hashes(ids[:40], 16) == h[:2]
    assert block_hashes([0] + ids[1:], 16)[0] == h[0] and block_hashes([7] + ids[1:], 16)[0] != h[0]
    assert block_hashes(ids[:15], 16) == []


def test_prefix_table_is_bounded_lru() -> None:
    t = PrefixTable(max_blocks=4)
    t.add([1, 2, 3])
    t.add([1, 9])  # refreshes 1
    t.add([7])
    assert len(t) == 4 and t.match([1, 9]) == 2 and t.match([2]) == 0  # 2 was least recent
    assert t.match([1, 3]) == 2 and t.match([5, 1]) == 0  # leading blocks only


# ---- controller ----


class _Sock:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes, copy: bool = True) -> None:
        self.frames.append(frame)


def test_controller_routes_requests_broadcasts_aborts_and_forwards_reports() -> None:
    replicas, api = [_Sock(), _Sock()], _Sock()
    c = Controller(Dispatcher(2, "round_robin"), replicas, api)
    init = DetokInit(3)
    frames = [encode(UserMsg(u, [1, 2, 3], SamplingParams(max_tokens=4), 7, init)) for u in range(3)]
    for f in frames:
        c.handle(f)
    assert replicas[0].frames == [frames[0], frames[2]] and replicas[1].frames == [frames[1]]  # forwarded as is
    c.handle(encode(AbortMsg(1, "stop")))
    assert [decode(f) for f in replicas[0].frames[-1:] + replicas[1].frames[-1:]] == [AbortMsg(1, "stop")] * 2
    report = encode(StatsMsg(1, 0, 10, 100, 3, 0, dp_rank=1, load_tokens=77, received=1))
    c.handle(report)
    assert api.frames == [report] and c.dispatcher.loads[1].tokens == 77


# ---- metrics and the router shim ----


def test_replica_stats_total_and_per_replica_series() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    stats = ReplicaStats()
    stats.update(StatsMsg(2, 1, 50, 100, 400, 100, dp_rank=0, load_tokens=300, received=9))
    stats.update(StatsMsg(1, 0, 20, 100, 100, 0, dp_rank=1, load_tokens=90, received=4))
    stats.update(StatsMsg(3, 0, 60, 100, 500, 150, dp_rank=0, load_tokens=310, received=10))  # newer
    t = stats.total()
    sums = (t.running, t.queued, t.kv_used, t.kv_total, t.prompt_tokens, t.cache_hit_tokens, t.load_tokens)
    assert sums == (4, 0, 80, 200, 600, 150, 400)
    reg = CollectorRegistry()
    reg.register(stats)
    text = generate_latest(reg).decode()
    assert 'minisgl_replica_num_requests_running{dp_rank="0"} 3.0' in text
    assert 'minisgl_replica_prefix_cache_hit_tokens_total{dp_rank="0"} 150.0' in text
    assert 'minisgl_replica_prefix_cache_hit_rate{dp_rank="1"} 0.0' in text
    assert 'minisgl_replica_load_tokens{dp_rank="1"} 90.0' in text


def test_state_slot_and_snapshot_gauges_sum_over_replicas() -> None:
    """A hybrid model's state slots and prefix-cache snapshots reach /metrics, read back through
    the Prometheus parser, summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    from minisgl.server.metrics import Metrics

    m = Metrics()
    m.on_stats(StatsMsg(1, 0, 10, 100, 0, 0, dp_rank=0, state_used=1, state_total=4, state_snapshots=3,
                        state_snapshots_total=4))
    m.on_stats(StatsMsg(2, 0, 10, 100, 0, 0, dp_rank=1, state_used=2, state_total=4, state_snapshots=1,
                        state_snapshots_total=4))
    got = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert got["minisgl_state_slots_used"] == 3 and got["minisgl_state_slots_total"] == 8
    assert got["minisgl_state_snapshots"] == 4 and got["minisgl_state_snapshots_total"] == 8


def test_router_neutral_fields_are_dropped_only_at_their_neutral_value() -> None:
    body = {"prompt": "x", "no_stop_trim": False, "return_hidden_states": False, "ignore_eos": False}
    assert strip_neutral_fields("/v1/completions", body) == {"prompt": "x", "ignore_eos": False}
    assert strip_neutral_fields("/v1/completions", {"no_stop_trim": True}) == {"no_stop_trim": True}
    assert strip_neutral_fields("/v1/completions", {"return_hidden_states": 0}) == {"return_hidden_states": 0}
    gen = {"text": "x", "model": None, "log_metrics": True, "return_entropy": False, "background": True}
    assert strip_neutral_fields("/generate", gen) == {"text": "x", "background": True}
    chat = {"messages": [], "separate_reasoning": True, "continue_final_message": True}
    assert strip_neutral_fields("/v1/chat/completions", chat) == {"messages": [], "continue_final_message": True}
    assert strip_neutral_fields("/v1/models", {"no_stop_trim": False}) == {"no_stop_trim": False}
    assert strip_neutral_fields("/generate", [1, 2]) == [1, 2]


def test_router_shim_rewrites_the_body_the_app_sees() -> None:
    app = FastAPI()

    @app.post("/generate")
    async def echo(request: Request) -> dict:
        return {"raw": (await request.body()).decode(), "length": request.headers["content-length"]}

    app.add_middleware(RouterFieldsShim)
    client = TestClient(app)
    r = client.post("/generate", json={"text": "hi", "model": None, "no_logs": False, "stream": True})
    assert json.loads(r.json()["raw"]) == {"text": "hi", "stream": True}
    assert int(r.json()["length"]) == len(r.json()["raw"].encode())
    for raw in (b"{not json", b'{"text": "hi", "no_logs": true}'):  # untouched: the API reports or refuses it
        r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.json()["raw"] == raw.decode()

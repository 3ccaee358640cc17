"""Tensor parallelism on the CPU: two processes over gloo give exactly the TP=1 tokens."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe_int4"])
def test_tp2_equals_tp1(tiny_model_path, tmp_path, name: str) -> None:
    """qwen3_5_moe_int4: a GPTQ Qwen3.5-MoE checkpoint (group 8, so each rank's K shards of the
    experts, shared expert and attention fall on groups) with 16-bit Gated DeltaNet layers."""
    if name == "qwen3_5_moe_int4":
        import quant4_checkpoints as ck

        path = str(ck.write_quant4(tiny_model_path("qwen3_5_moe"), tmp_path / "q", tmp_path / "deq", "gptq", 8)[0])
    else:
        path = str(tiny_model_path(name))
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(300, 317)), [42]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM(path, device="cpu", dtype="float32")
    want = [o["token_ids"] for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(path, device="cpu", dtype="float32", tp_size=2)
    try:
        got = [o["token_ids"] for o in two.generate(prompts, params, use_tqdm=False)]
        # Seeded sampling is identical on every rank, so ranks never diverge.
        sampled = two.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, seed=3), use_tqdm=False)
        again = one.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, seed=3), use_tqdm=False)
    finally:
        two.shutdown()
    assert got == want
    assert [o["token_ids"] for o in sampled] == [o["token_ids"] for o in again]
    with pytest.raises(RuntimeError, match="shut down"):
        two.generate(prompts, params, use_tqdm=False)


def test_ranks_agree_on_the_smallest_value() -> None:
    """The KV pool size every rank uses: the minimum over ranks (tests/gloo_min_worker.py)."""
    from rank_scripts import run_ranks

    outs = run_ranks("gloo_min_worker.py", 2, timeout=120)
    assert [f"rank {r}: 993" in o for r, o in enumerate(outs)] == [True, True], outs


def test_nccl_load_of_a_wrong_library_fails_every_time() -> None:
    """A library lacking NCCL's symbols leaves the bindings unloaded (no null entry points)."""
    import ctypes.util

    from minisgl import _C

    assert (_C.NCCL_FLOAT16, _C.NCCL_FLOAT32, _C.NCCL_BFLOAT16) == (6, 7, 9)  # nccl.h's ncclDataType_t
    libc = ctypes.util.find_library("c") or "libc.so.6"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="libnccl lacks ncclGetVersion"):
            _C.nccl_load(libc)
    with pytest.raises(RuntimeError, match="not loaded"):
        _C.nccl_version()


def test_tp_workers_stop_when_the_llm_is_collected(tiny_model_path) -> None:
    import gc

    two = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32", tp_size=2)
    workers = list(two._workers)
    assert workers and all(p.is_alive() for p in workers)
    del two
    gc.collect()
    for p in workers:
        p.join(timeout=30)
    assert not any(p.is_alive() for p in workers)
    # The process group was torn down: a new TP LLM in this process works.
    again = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32", tp_size=2)
    try:
        assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    finally:
        again.shutdown()


def test_tp_must_divide_heads(tiny_model_path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tiny_model_path("llama3")), device="cpu", tp_size=3)


def test_server_tp2_equals_offline_tp1(tiny_model_path, tmp_path) -> None:
    import httpx
    from server_harness import Server, child_pids

    path = str(tiny_model_path("llama3"))
    want = LLM(path, device="cpu", dtype="float32").generate(
        ["Hello there", "The quick brown fox"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    server = Server("--model", path, "--tp", "2", "--dtype", "float32", cwd=tmp_path)
    try:
        pids = child_pids(server.proc.pid)
        assert len(pids) >= 4  # scheduler ranks 0 and 1, detokenizer, tokenizer
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for prompt, ref in zip(["Hello there", "The quick brown fox"], want):
                r = http.post("/v1/completions", json={
                    "model": http.get("/v1/models").json()["data"][0]["id"], "prompt": prompt,
                    "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                })
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == ref["text"]
    finally:
        assert server.stop() == 0

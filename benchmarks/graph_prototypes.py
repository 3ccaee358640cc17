"""The two CUDA-graph designs for prefill / extend / mixed steps, as prototypes over an Engine
(benchmarks/graph_designs.py measures them). Each runs one step given as host lists and
returns fp32 logits of each request's last token, like `Engine.forward`.

(a) WholeGraph: the whole forward in one graph per total-token bucket. Every index the step
    needs lives in one static int64 buffer (one host-to-device copy per step); the extend
    kernel runs in tile-map mode (grid = the bucket's tile capacity, unused tiles exit), so no
    launch depends on the step's lengths. `decode_kernel=True`: the decode rows of a mixed
    step (placed first) go through the paged decode kernel over min(bucket, max decodes) rows
    in the same graph, and tiles cover the other requests only.
(b) Piecewise: per bucket, one graph per piece between attention calls (embed .. layer 0's
    qkv+rope; o_proj .. next layer's qkv+rope; ...; last o_proj .. LM head), 37 graphs for 36
    layers, with the KV store and the attention kernel (tile-map mode, exact tile count)
    launched eagerly between them: vLLM's / SGLang's piecewise graphs.

On the CPU there is no capture: a "graph" is its function, run on replay (shape logic only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl import ops
from minisgl.core.batch import ForwardBatch
from minisgl.engine.engine import Engine
from minisgl.ops import _checks


@dataclass
class Step:
    """One step: requests (table row, cached prefix, new token ids); decodes come first."""

    rows: list[int]
    prefix: list[int]
    new: list[list[int]]
    num_decodes: int = 0  # the first num_decodes requests bring one token each

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new)


class Graph:
    """torch.cuda.CUDAGraph on CUDA; on the CPU, the function itself (run on replay)."""

    def __init__(self, fn, device: torch.device, pool, stream) -> None:  # noqa: ANN001
        self.fn, self.graph = fn, None
        if device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                fn()

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


def _seg(n: int) -> int:
    return -(-n // 4) * 4  # segments start 32-byte aligned: Triton specializes on alignment


class StaticMeta:
    """One static int64 device buffer per design; a bucket's fields sit at fixed offsets in it.
    int64 fields: input_ids, positions, tok_rows [T], sample_rows [B]; int32 fields (stored as
    int64, narrowed inside the graph): req_rows, prefix_lens, seq_lens [B], cu [B+1],
    tiles [C, 2], dec_rows, dec_seq [D]."""

    def __init__(self, eng: Engine, max_reqs: int, max_decodes: int, block_m: int) -> None:
        self.eng, self.max_reqs, self.max_decodes, self.block_m = eng, max_reqs, max_decodes, block_m
        self.buf: torch.Tensor | None = None

    def caps(self, bucket: int, decode_kernel: bool) -> tuple[int, int, int]:
        b = min(bucket, self.max_reqs)
        return b, ops.extend_tile_capacity(bucket, b, self.block_m), min(bucket, self.max_decodes) * decode_kernel

    def size(self, bucket: int, decode_kernel: bool) -> int:
        b, c, d = self.caps(bucket, decode_kernel)
        return 3 * _seg(bucket) + _seg(b) + 4 * _seg(b + 1) + _seg(2 * c) + 2 * _seg(d)

    def allocate(self, buckets: list[int], decode_kernel: bool) -> None:
        n = max(self.size(t, decode_kernel) for t in buckets)
        self.buf = torch.zeros(n, dtype=torch.int64, device=self.eng.device)

    def host(self, step: Step, bucket: int, decode_kernel: bool) -> list[int]:
        """The bucket's layout filled for `step` (padding tokens: padding row, position 0, so
        their K/V go to the dummy slot; padding requests: no tokens, sample row 0)."""
        b_cap, c_cap, d_cap = self.caps(bucket, decode_kernel)
        pad_row, n, b = self.eng.table.padding_row, step.num_tokens, len(step.rows)
        if n > bucket or b > b_cap:
            raise ValueError(f"{n} tokens / {b} requests do not fit bucket {bucket} ({b_cap} requests)")
        ext = [len(t) for t in step.new]
        cu = [0]
        for e in ext:
            cu.append(cu[-1] + e)

        def pad(xs: list[int], size: int, fill: int) -> list[int]:
            return xs + [fill] * (_seg(size) - len(xs))

        ids = pad([x for t in step.new for x in t], bucket, 0)
        pos = pad([p + j for p, e in zip(step.prefix, ext) for j in range(e)], bucket, 0)
        tok_rows = pad([r for r, e in zip(step.rows, ext) for _ in range(e)], bucket, pad_row)
        sample = pad([c - 1 for c in cu[1:]], b_cap, 0)
        rows = pad(step.rows, b_cap + 1, pad_row)
        prefix = pad(step.prefix, b_cap + 1, 0)
        seq = pad([p + e for p, e in zip(step.prefix, ext)], b_cap + 1, 0)
        cu = pad(cu, b_cap + 1, n)
        nd = step.num_decodes if decode_kernel else 0
        tile_ext = [0] * nd + ext[nd:]
        tiles = ops.extend_tile_map(step.prefix, tile_ext, self.block_m, c_cap)
        tiles = pad(tiles, 2 * c_cap, 0)
        dec_rows = pad(step.rows[:nd], d_cap, pad_row)
        dec_seq = pad([p + 1 for p in step.prefix[:nd]], d_cap, 1)
        return ids + pos + tok_rows + sample + rows + prefix + seq + cu + tiles + dec_rows + dec_seq

    def upload(self, host: list[int]) -> None:
        src = torch.tensor(host, dtype=torch.int64, pin_memory=self.eng.device.type == "cuda")
        self.buf[: len(host)].copy_(src, non_blocking=True)

    def batch(self, bucket: int, decode_kernel: bool) -> ForwardBatch:
        """The bucket's ForwardBatch over views of the buffer (int32 fields: one narrowing copy)."""
        b_cap, c_cap, d_cap = self.caps(bucket, decode_kernel)
        m, t = self.buf, _seg(bucket)
        ids, pos, tok_rows = m[:bucket], m[t : t + bucket], m[2 * t : 2 * t + bucket]
        o = 3 * t
        sample = m[o : o + b_cap]
        o += _seg(b_cap)
        s = _seg(b_cap + 1)
        i32 = m[o : self.size(bucket, decode_kernel)].to(torch.int32)
        rows, prefix, seq, cu = (i32[k * s : k * s + b_cap + (k == 3)] for k in range(4))
        o = 4 * s
        tiles = i32[o : o + 2 * c_cap].view(c_cap, 2)
        o += _seg(2 * c_cap)
        dec_rows, dec_seq = i32[o : o + d_cap], i32[o + _seg(d_cap) : o + _seg(d_cap) + d_cap]
        eng = self.eng
        return ForwardBatch(
            mode="extend", input_ids=ids, positions=pos, out_slots=eng.table.req_to_slot[tok_rows, pos],
            req_rows=rows, seq_lens=seq, prefix_lens=prefix, cu_seqlens_q=cu, sample_rows=sample,
            req_to_slot=eng.table.req_to_slot, seq_lens_cpu=[], prefix_lens_cpu=[],
            max_seq_len=eng.max_model_len, max_extend_len=bucket,
            attn_metadata={"tiles": tiles, "dec_rows": dec_rows, "dec_seq": dec_seq},
        )


def attention(eng: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """KV store, then (decode kernel over the decode rows, then) tile-map extend attention."""
    kc, vc, md = eng.pool.k_cache(layer), eng.pool.v_cache(layer), batch.attn_metadata
    ops.store_kv(kc, vc, k, v, batch.out_slots)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = md["dec_rows"].shape[0]
    if d:
        ops.paged_decode_attention(q[:d], kc, vc, batch.req_to_slot, md["dec_rows"], md["dec_seq"], eng.attn.scale,
                                   eng.max_model_len, out=out[:d])
    return ops.extend_attention(q, kc, vc, batch.req_to_slot, batch.req_rows, batch.prefix_lens, batch.seq_lens,
                                batch.cu_seqlens_q, batch.max_extend_len, eng.attn.scale, out=out,
                                tiles=md["tiles"])


class _Backend:
    """An AttentionBackend for the whole-graph prototype (the model calls `forward`)."""

    name = "prototype"

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def forward(self, q, k, v, layer: int, batch: ForwardBatch) -> torch.Tensor:  # noqa: ANN001
        return attention(self.eng, q, k, v, layer, batch)


class WholeGraph:
    def __init__(self, eng: Engine, meta: StaticMeta, logits: torch.Tensor, decode_kernel: bool) -> None:
        self.eng, self.meta, self.logits, self.decode_kernel = eng, meta, logits, decode_kernel
        self.graphs: dict[int, Graph] = {}

    def _forward(self, bucket: int) -> None:
        with _checks.trusted():
            batch = self.meta.batch(bucket, self.decode_kernel)
            self.eng.model(batch, _Backend(self.eng), logits_out=self.logits[: batch.sample_rows.shape[0]])

    @torch.inference_mode()
    def capture(self, bucket: int, warmup: Step, pool, stream) -> None:  # noqa: ANN001
        self.meta.upload(self.meta.host(warmup, bucket, self.decode_kernel))
        fn = lambda: self._forward(bucket)  # noqa: E731
        for _ in range(2):  # compiles (Triton) and cuBLAS choices happen outside capture
            fn()
        self.graphs[bucket] = Graph(fn, self.eng.device, pool, stream)

    @torch.inference_mode()
    def run(self, step: Step, bucket: int) -> torch.Tensor:
        self.meta.upload(self.meta.host(step, bucket, self.decode_kernel))
        self.graphs[bucket].replay()
        return self.logits[: len(step.rows)]


class Piecewise:
    """Static activations (max bucket rows): residual [T, H], qkv [T, W], attention out [T, Hq*D]."""

    def __init__(self, eng: Engine, meta: StaticMeta, logits: torch.Tensor, max_bucket: int) -> None:
        self.eng, self.meta, self.logits = eng, meta, logits
        m = eng.model
        attn0 = m.model.layers[0].self_attn
        self.q_size, self.kv_size = attn0.num_heads * attn0.head_dim, attn0.num_kv_heads * attn0.head_dim
        hidden, width = m.model.embed_tokens.weight.shape[1], attn0.qkv_proj.weight.shape[0]
        dt, dev = eng.dtype, eng.device
        self.res = torch.empty(max_bucket, hidden, dtype=dt, device=dev)
        self.qkv = torch.empty(max_bucket, width, dtype=dt, device=dev)
        self.o = torch.empty(max_bucket, self.q_size, dtype=dt, device=dev)
        self.pieces: dict[int, list[Graph]] = {}
        self.batches: dict[int, ForwardBatch] = {}

    def _qkv_rope(self, layer, h: torch.Tensor, batch: ForwardBatch) -> None:  # noqa: ANN001
        a, t = layer.self_attn, h.shape[0]
        qkv = self.qkv[:t]
        torch.matmul(h, a.qkv_proj.weight.t(), out=qkv)  # straight into the static buffer
        if a.qkv_proj.bias is not None:
            qkv += a.qkv_proj.bias
        q, k, _ = self._split(qkv, a)
        if a.qk_norm:
            a.rope.forward_with_qk_norm(batch.positions, q, k, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        else:
            a.rope(batch.positions, q, k)

    def _split(self, qkv: torch.Tensor, a) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        t, d, qs, ks = qkv.shape[0], a.head_dim, self.q_size, self.kv_size
        return (qkv[:, :qs].view(t, -1, d), qkv[:, qs : qs + ks].view(t, -1, d), qkv[:, qs + ks :].view(t, -1, d))

    def _piece(self, i: int, bucket: int) -> None:
        """Piece i: (layer i-1's o_proj .. MLP, then) layer i's norm, qkv and rope; i = L: the head."""
        layers, batch = self.eng.model.model.layers, self.batches[bucket]
        res = self.res[:bucket]
        with _checks.trusted():
            if i == 0:
                res.copy_(self.eng.model.model.embed_tokens(batch.input_ids))
                h = layers[0].input_layernorm(res)
            else:
                prev = layers[i - 1]
                h, _ = prev.post_attention_layernorm.forward_with_residual(prev.self_attn.o_proj(self.o[:bucket]), res)
                h = prev.mlp(h)
                if i == len(layers):
                    h = self.eng.model.model.norm.forward_with_residual(h, res)[0]
                    out = self.logits[: batch.sample_rows.shape[0]]
                    out.copy_(self.eng.model.lm_head(h[batch.sample_rows]))
                    return
                h, _ = layers[i].input_layernorm.forward_with_residual(h, res)
            self._qkv_rope(layers[i], h, batch)

    def _attend(self, i: int, bucket: int, n: int, num_tiles: int) -> None:
        """Layer i's attention, eager, on the step's n real tokens and its exact tile list."""
        batch = self.batches[bucket]
        a = self.eng.model.model.layers[i].self_attn
        q, k, v = self._split(self.qkv[:n], a)
        md = dict(batch.attn_metadata, tiles=batch.attn_metadata["tiles"][:num_tiles])
        part = ForwardBatch(**{**batch.__dict__, "out_slots": batch.out_slots[:n], "attn_metadata": md})
        with _checks.trusted():
            attention(self.eng, q, k, v, i, part, out=self.o[:n].view(n, -1, a.head_dim))

    def _step(self, bucket: int, n: int, num_tiles: int) -> None:
        pieces = self.pieces.get(bucket)
        layers = len(self.eng.model.model.layers)
        for i in range(layers + 1):
            if pieces:
                pieces[i].replay()
            else:
                self._piece(i, bucket)
            if i < layers:
                self._attend(i, bucket, n, num_tiles)

    @torch.inference_mode()
    def capture(self, bucket: int, warmup: Step, pool, stream) -> None:  # noqa: ANN001
        self.meta.upload(self.meta.host(warmup, bucket, False))
        # The batch (its narrowing copy and out-slot gather) is eager here: part of the step.
        self.batches[bucket] = self.meta.batch(bucket, False)
        n, num_tiles = warmup.num_tokens, len(ops.extend_tile_map(warmup.prefix, [len(t) for t in warmup.new],
                                                                  self.meta.block_m)) // 2
        for _ in range(2):
            self._step(bucket, n, num_tiles)
        layers = len(self.eng.model.model.layers)
        self.pieces[bucket] = [Graph(lambda i=i: self._piece(i, bucket), self.eng.device, pool, stream)
                               for i in range(layers + 1)]

    @torch.inference_mode()
    def run(self, step: Step, bucket: int) -> torch.Tensor:
        host = self.meta.host(step, bucket, False)
        self.meta.upload(host)
        self.batches[bucket] = self.meta.batch(bucket, False)  # eager: int32 narrowing, slot gather
        num_tiles = len(ops.extend_tile_map(step.prefix, [len(t) for t in step.new], self.meta.block_m)) // 2
        self._step(bucket, step.num_tokens, num_tiles)
        return self.logits[: len(step.rows)]

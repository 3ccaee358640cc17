"""MTP drafting (`--speculative-algorithm mtp`): the multi-token-prediction head a Qwen3-Next or
Qwen3.5 checkpoint ships (models/qwen3_next_mtp.py) drafts for the model it came with.

It runs as EAGLE-3's head does (speculative/eagle3.py says how): after every target forward
(`after_forward`) the head runs over the same positions and slots in its own one-layer KV pool
(the target's pages), position t taking the target's final normed hidden state at t and the
token that followed t, and leaves each request's first draft token and the head's output at
its last valid position in per-row buffers; `propose` continues the chain k - 1 steps on the
head's own outputs, each step replaying a graph per decode batch size (spec/draft_steps.py).
The target's verify step keeps the Gated DeltaNet states of rejected drafts out of its pool
(Qwen3NextForCausalLM.commit_verify); the head itself has full attention only.
"""

from __future__ import annotations

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool, RequestTable
from minisgl.ops import _checks
from minisgl.speculative.draft_steps import DraftSteps
from minisgl.speculative.drafter import Drafter, DraftRequest, DraftTarget, TargetStep


class MtpDrafter(Drafter):
    name = "mtp"
    has_model = True
    needs_next_ids = True
    aux_layers = ()  # the target's final normed hidden states

    def __init__(self, target: DraftTarget) -> None:
        from minisgl.models.qwen3_next_mtp import MtpHead
        from minisgl.models.weights import fill_dummy, iter_safetensors

        tc = target.model_config
        if tc.linear_attn is None:
            raise ValueError(f"--speculative-algorithm mtp drafts with the MTP head of Qwen3-Next and Qwen3.5 "
                             f"checkpoints; {tc.architecture} has none (use ngram, draft or eagle3)")
        if target.checkpoint is None and not target.dummy_weights:
            raise ValueError("--speculative-algorithm mtp loads the MTP head from the model's safetensors folder; "
                             "a GGUF file has none")
        self.target = target
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(target.dtype)
        try:
            with torch.device(target.device):
                self.head = MtpHead(tc, target.embed_tokens, target.lm_head, target.tp, target.comm,
                                    target.max_model_len, target.device)
                rows = target.max_requests + 1
                # Per request-table row: the next chain step's input token and hidden state.
                self.next_token = torch.zeros(rows, dtype=torch.int64)
                self.next_hidden = torch.zeros(rows, tc.hidden_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if target.dummy_weights:
            fill_dummy(self.head, target.seed + 1)
        else:
            self.head.load_weights(iter_safetensors(target.checkpoint))
        self.head.eval()
        attn = self.head.attention
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None
        self.steps = DraftSteps(target, self.next_token, self._step)

    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token_for(1, self.num_kv_heads, self.target.model_config.head_dim, self.target.dtype)

    def allocate_kv(self, num_pages: int, page_size: int, table: RequestTable) -> None:
        from minisgl.attention.select import make_backend

        t = self.target
        mc = t.model_config
        self.pool = KVPool(1, num_pages, page_size, self.num_kv_heads, mc.head_dim, t.dtype, t.device)
        self.attn = make_backend(t.attention_backend, self.pool, self.num_q_heads, mc.attention_scale, t.device)
        self.steps.table = table

    @torch.inference_mode()
    def after_forward(self, step: TargetStep) -> None:
        """`step.batch` may be a graph's padded batch; its first last_rows.numel() requests are
        the step's (as EAGLE-3's)."""
        assert step.next_ids is not None and step.aux is not None
        self.attn.prepare(step.batch)
        with _checks.trusted():
            out = self.head(step.batch, self.attn, step.next_ids, step.aux)
        rows = step.batch.req_rows[: step.last_rows.numel()].long()
        last = out[step.last_rows]
        self.next_token[rows] = self.head.draft_tokens(last)
        self.next_hidden[rows] = last

    def _step(self, batch: ForwardBatch) -> None:
        """One chain step (graph-safe): input token and hidden state from the per-row buffers,
        the next ones written back there."""
        rows = batch.req_rows.long()
        self.attn.prepare(batch)
        with _checks.trusted():
            out = self.head(batch, self.attn, batch.input_ids, self.next_hidden[rows])
        self.next_token[rows] = self.head.draft_tokens(out)
        self.next_hidden[rows] = out

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        self.steps.enable_cuda_graphs(batch_sizes, runner_cls)

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        # The first draft comes from the target's last forward (after_forward); step s writes
        # draft s at position length - 2 + s (the head's positions trail the tokens by one).
        return self.steps.chain(reqs, first_step=1, offset=-2)

"""The engine's step primitives: a batch from its indices, the forward (a captured graph's
replay or eager), sampling, and the verify forward with acceptance.

Part of Engine (engine.py mixes it in and builds every attribute used here). It is apart from
the face (steps.py), which turns a scheduler's step description into calls of these, because
tests, benchmarks and prompt scoring call them directly, on batches they build themselves.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.core.batch import ForwardBatch
from minisgl.ops import _checks
from minisgl.sampling.logits_plan import LogitsPlan, StepOutput, sample_with_plan
from minisgl.sampling.sampler import SamplingTensors, sample_per_row
from minisgl.sampling.verify_plan import VerifyPlan


class ForwardCalls:
    def build_batch(
        self, mode: str, rows: list[int], prefix_lens: list[int], new_tokens: list[list[int] | None] | None,
        use_graphs: bool = True, extra_logit_rows: list[int] | None = None, all_rows: bool = False,
    ) -> ForwardBatch:
        """A batch for requests at table rows `rows`, each with `prefix_lens[i]` tokens already
        in the KV cache and `new_tokens[i]` to run now. The slots of the new tokens must
        already be written to the request table. A request's input None means one token, its
        last sampled one, read on the device from `token_buffer` (so step N+1 can launch
        before the host has read step N's tokens): all of a decode step (`new_tokens=None`),
        or the leading requests of a "mixed" step (decodes riding along with an extend).
        The step is checked here, once; its indices go to the device in one copy, into a
        captured graph's buffers when one fits (`use_graphs`). `extra_logit_rows` (indices into
        the new tokens): logits are computed there too, after the B sampled rows (prompt
        logprobs; such a step runs eagerly: a graph keeps the sampled rows only). `all_rows`:
        every position's logits (a verify step: a verify graph where one fits)."""
        return self.steps.build(mode, rows, prefix_lens, new_tokens, use_graphs, extra_logit_rows, all_rows)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_positions: bool = False) -> torch.Tensor:
        """fp32 logits of each request's last new token [B, vocab] (every token's: [T, vocab]),
        from the step's captured graph when it has one (a graph keeps the sampled rows only, so
        every position's logits come from an eager run, except from a graph built with
        `all_rows`, whose sample rows are every token; `batch.logit_rows` when set: [B + E, vocab])."""
        if batch.all_rows and not all_positions:
            raise ValueError("a batch built with all_rows (a verify step) gives every position's logits")
        if batch.graph is not None and batch.logit_rows is None and all_positions == batch.all_rows:
            logits = self.graphs.replay(batch)
            if self.model.model.aux_layers is not None:  # the graph's residual stream [T of the layout, n H]
                self.model.model.aux_hidden = self.graphs.extras[batch.graph]
            return logits
        return self.forward_eager(batch, all_positions)

    def forward_eager(
        self, batch: ForwardBatch, all_positions: bool = False, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model on `batch`, layer by layer. The batch was checked when it was built: the
        ops skip their per-call argument checks here. A graph's step (built last) runs over
        the graph's padded buffers, and the padding rows are cut off."""
        rows = None
        if batch.graph is not None:
            rows = batch.num_tokens if all_positions else batch.batch_size
            batch = self.graphs.views(batch.graph, self.graphs.buffer)
        with _checks.trusted():
            self.attn.prepare(batch)
            out = self.model(batch, self.attn, all_positions=all_positions, logits_out=logits_out)
            if self.drafter is not None and self.drafter.mirrors_in_forward:
                self.drafter.mirror(batch)  # a draft model's K/V over the same positions
        return out if rows is None else out[:rows]

    @torch.inference_mode()
    def warm_up_sampling(self) -> None:
        """Compiles the sampling kernels now rather than at the first request that samples (their
        specialization depends on the vocabulary and the 16-byte-aligned inputs only), and,
        when speculating, the acceptance kernel (the first verify step would take seconds)."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        logits = torch.randn(2, self.model_config.vocab_size, generator=gen, device=self.device)
        st = SamplingTensors.build([0.8, 1.0], [20, -1], [0.9, 1.0], [0.05, 0.0], [1, 2], [0, 0], self.device)
        self.sample(logits, st)
        ops.greedy(logits)  # an all-greedy step's kernels
        if self.drafter is not None:
            self._warm_up_acceptance()

    @torch.inference_mode()
    def _warm_up_acceptance(self) -> None:
        """Once per specialization the acceptance kernel can meet: Triton specializes the
        drafts' row stride (the step's longest draft) on == 1 and on multiples of 16."""
        spec = self.cfg.spec
        dev, vocab = self.device, self.model_config.vocab_size
        top = max((k for _, k in spec.table), default=spec.num_draft_tokens)  # the longest K
        if top == 0:
            return
        gen = torch.Generator(device=dev).manual_seed(0)
        for k in sorted({1, min(2, top), *(16 * i for i in range(1, top // 16 + 1))}):
            st = SamplingTensors.build([0.0, 0.8], [-1, 20], [1.0, 0.9], [0.0, 0.05], [1, 2], [0, 0], dev)
            logits = torch.randn(2 * (k + 1), vocab, generator=gen, device=dev)
            cu = torch.tensor([0, k + 1, 2 * (k + 1)], dtype=torch.int32, device=dev)
            drafts = torch.randint(0, vocab, (2, k), generator=gen, device=dev)
            ops.spec_accept(logits, cu, drafts, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logprobs of the chosen tokens under the raw logits)."""
        if self.cfg.deterministic:
            return sample_per_row(logits, st)
        if st.all_greedy:  # no randomness: two short passes instead of the sampling kernel
            return ops.greedy(logits)
        return ops.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)

    @torch.inference_mode()
    def run_batch(self, batch: ForwardBatch, st: SamplingTensors, plan: LogitsPlan | None = None) -> StepOutput:
        """Forward + (penalties, bias, grammar mask, logprob alternatives as `plan` says) + sample;
        the sampled tokens also go to `token_buffer` (the next decode's inputs). A prefill
        chunk's row samples too; the scheduler drops that token. The plan's mask runs on the host
        once the forward is launched; under CUDA graphs the logits are the graph's output
        buffer, so it changes them outside the graph."""
        logits = self.forward(batch)
        if plan is None:
            out = StepOutput(*self.sample(logits, st))
        else:
            out = sample_with_plan(logits, st, plan, self.penalties, self.sample)
        self.token_buffer[batch.req_rows.long()] = out.tokens
        return out

    @torch.inference_mode()
    def verify(
        self, batch: ForwardBatch, drafts: torch.Tensor, st: SamplingTensors, plan: VerifyPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Speculative verify: `batch` is an extend of 1 + k_b tokens per request (its last
        token, then its drafts int64 [B, K >= k_b]), built with all_rows. Forward every
        position, accept on the device (ops.spec_accept). Returns (tokens [B, K + 1], logprobs [B, K + 1],
        num_accepted [B]): request b's new tokens are tokens[b, :num_accepted[b] + 1]; the
        last of them goes to `token_buffer` (a plain decode may follow). `plan`: penalties, logit
        bias, min_tokens and alternatives at every row (sampling/verify_plan.py); then the fourth
        value is (top ids, top logprobs) of its top rows, else None."""
        logits = self.forward(batch, all_positions=True)
        kept, tops = plan.apply(logits, self.penalties) if plan is not None else (None, None)
        tokens, logprobs, num_acc = ops.spec_accept(
            logits, batch.cu_seqlens_q, drafts, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps
        )
        if self.state_pool is not None:  # the recurrent states advance over the accepted tokens only
            self.model.commit_verify(batch, num_acc)
        if plan is not None:
            plan.finish(tokens, logprobs, num_acc, kept, self.penalties)
        self.token_buffer[batch.req_rows.long()] = tokens.gather(1, num_acc.long()[:, None]).squeeze(1)
        return tokens, logprobs, num_acc, tops

"""The face's call for an embedding model's step (the types are face.py's PoolStep).

Part of Engine (engine.py mixes it in). An embedding request is a prompt that wants its pooled
final hidden state instead of tokens: the scheduler runs its chunks through the same prefill
admission and KV cache as a generation's (a long prompt in several chunks, attention over the
earlier ones' K/V) and frees the KV after the last. The step runs eagerly: a captured graph
ends in the LM head's logits, and an embedding server captures none, so the graphs of
generation are untouched by construction.

Per request and chunk, the pooled row is what its pooling needs of that chunk (fp32):
  last: the chunk's last token's hidden state (the prompt's last chunk gives the embedding);
  mean: the sum over the chunk's tokens (the scheduler adds the chunks and divides by the length);
  cls:  the chunk's first token's hidden state (the prompt's first chunk gives the embedding).
"""

from __future__ import annotations

import torch

from minisgl.engine.face import PoolStep
from minisgl.ops import _checks


class PoolCalls:
    @torch.inference_mode()
    def pool_step(self, p: PoolStep) -> torch.Tensor:
        """fp32 [B, hidden] on the host: request i's pooled row for this chunk (see above)."""
        batch = self.build_batch("extend", [r.row for r in p.reqs], p.prefix_lens, p.new_tokens, use_graphs=False)
        with _checks.trusted():
            self.attn.prepare(batch)
            hidden = self.model.model(batch, self.attn)  # [T, hidden]
        dev, b = hidden.device, len(p.reqs)
        out = torch.empty(b, hidden.shape[1], dtype=torch.float32, device=dev)
        for mode in set(p.pooling):
            rows = torch.tensor([i for i, m in enumerate(p.pooling) if m == mode], dtype=torch.int64, device=dev)
            if mode == "last":
                out[rows] = hidden[batch.sample_rows[rows]].float()
            elif mode == "cls":
                out[rows] = hidden[batch.cu_seqlens_q[:-1].long()[rows]].float()
            elif mode == "mean":
                lengths = torch.tensor([len(t) for t in p.new_tokens], device=dev)
                segment = torch.repeat_interleave(torch.arange(b, device=dev), lengths)
                sums = torch.zeros_like(out).index_add_(0, segment, hidden.float())
                out[rows] = sums[rows]
            else:
                raise ValueError(f"unknown pooling {mode!r}")
        return out.cpu()

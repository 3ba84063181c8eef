"""A small causal transformer LM in PyTorch, on the same synthetic text as ``pathways_ray.demo.lm``.

Shared by the PyTorch examples, their tests and ``benchmarks/trainer_overhead.py``.
Batches are a pure function of (seed, step), so any number of workers can cut
the same global batch into shards, and a single process can replay it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pathways_ray.demo.lm import MarkovText

__all__ = ["TPLM", "TinyLM", "global_batch", "lm_loss", "shard_rows", "tensor_parallel_plan",
           "train_step"]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, seq: int = 32, d_model: int = 64, heads: int = 4,
                 layers: int = 2, d_ff: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.1)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.0, batch_first=True,
                                       norm_first=True, activation="gelu")
            for _ in range(layers))
        self.out = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.out(x)


class _Block(nn.Module):
    """Pre-norm attention + MLP of plain ``nn.Linear``s, so tensor parallelism can split
    them: heads follow the local width of ``wq`` (all heads in one process, a share of
    them under ``ColwiseParallel``)."""

    def __init__(self, d_model: int, heads: int, d_ff: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False)
                                              for _ in range(4))
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(nn.functional.gelu(self.w1(self.ln2(x))))


class TPLM(nn.Module):
    """``TinyLM``'s shape, built for tensor parallelism (``tensor_parallel_plan``)."""

    def __init__(self, vocab: int = 64, seq: int = 32, d_model: int = 64, heads: int = 4,
                 layers: int = 2, d_ff: int = 256):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.1)
        self.blocks = nn.ModuleList(_Block(d_model, heads, d_ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def tensor_parallel_plan(model: TPLM) -> dict:
    """Megatron-style: q, k, v and the MLP's first layer split by columns (heads, hidden
    units), the attention output and the MLP's second layer by rows; one all-reduce
    after each. Embeddings, norms and the head stay whole (replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        for name in ("wq", "wk", "wv", "w1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("wo", "w2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch`` (int64 [B, seq + 1])."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1))


def global_batch(text: MarkovText, *, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
    """The global batch of ``step``: the same on every worker and in a single process."""
    rng = np.random.default_rng([seed, step])
    return torch.from_numpy(text.batch(rng, batch, seq + 1)).long()


def shard_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Worker ``rank``'s contiguous share of a global batch."""
    if len(batch) % world:
        raise ValueError(f"a global batch of {len(batch)} rows does not split over {world} "
                         f"workers; make the batch a multiple of {world}")
    per = len(batch) // world
    return batch[rank * per:(rank + 1) * per]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One optimizer step on this worker's ``batch``; returns the loss of the global
    batch (the mean over the process group's workers, when there is a group)."""
    import torch.distributed as dist

    loss = lm_loss(model, batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return mean.item()

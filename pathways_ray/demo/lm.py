"""A small decoder-only transformer language model and synthetic text, in plain JAX.

Used by the main job (``pathways-ray demo``) and the parity tests. Nothing is
downloaded: the text comes from a fixed random Markov chain over the
vocabulary, so the loss has a known floor (the chain's entropy rate) and
falls visibly within a few dozen steps.

Sharding within a slice follows the usual data x model layout: the batch is
split over ``data``; attention heads and the MLP hidden dimension over
``model`` (column-parallel in, row-parallel out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LMConfig", "MarkovText", "init_params", "loss_fn", "param_specs", "sgd_update"]


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 64
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    lr: float = 0.05

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def init_params(cfg: LMConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale or 1.0 / np.sqrt(shape[0])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {"embed": w(cfg.vocab, cfg.d_model, scale=0.5),
              "pos": w(cfg.seq, cfg.d_model, scale=0.1),
              "out": w(cfg.d_model, cfg.vocab)}
    for i in range(cfg.layers):
        params[f"l{i}"] = {
            "ln1": np.ones(cfg.d_model, np.float32), "ln2": np.ones(cfg.d_model, np.float32),
            "wq": w(cfg.d_model, cfg.d_model), "wk": w(cfg.d_model, cfg.d_model),
            "wv": w(cfg.d_model, cfg.d_model), "wo": w(cfg.d_model, cfg.d_model),
            "w1": w(cfg.d_model, cfg.d_ff), "w2": w(cfg.d_ff, cfg.d_model),
        }
    return params


def param_specs(cfg: LMConfig) -> dict:
    """PartitionSpec per parameter (tensor parallel over ``model``)."""
    from jax.sharding import PartitionSpec as P

    specs = {"embed": P(), "pos": P(), "out": P()}
    for i in range(cfg.layers):
        specs[f"l{i}"] = {"ln1": P(), "ln2": P(),
                          "wq": P(None, "model"), "wk": P(None, "model"),
                          "wv": P(None, "model"), "wo": P("model", None),
                          "w1": P(None, "model"), "w2": P("model", None)}
    return specs


def _layer_norm(x, g):
    import jax.numpy as jnp

    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * g


def forward(params: dict, tokens, cfg: LMConfig):
    import jax
    import jax.numpy as jnp

    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg.layers):
        p = params[f"l{i}"]
        h = _layer_norm(x, p["ln1"])
        q, k, v = (jnp.reshape(h @ p[n], (b, t, cfg.heads, cfg.head_dim)) for n in
                   ("wq", "wk", "wv"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, cfg.d_model)
        x = x + o @ p["wo"]
        h = _layer_norm(x, p["ln2"])
        x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
    return x @ params["out"]


def loss_fn(params: dict, batch, cfg: LMConfig):
    """Mean next-token cross entropy; ``batch`` is int32 [B, seq + 1]."""
    import jax
    import jax.numpy as jnp

    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def sgd_update(params: dict, grads: dict, lr: float) -> dict:
    import jax

    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


class MarkovText:
    """Token sequences from a fixed sparse random Markov chain (each token has 4 likely
    successors), so there is something real to learn."""

    def __init__(self, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        probs = np.full((vocab, vocab), 0.02 / vocab)
        for a in range(vocab):
            nxt = rng.choice(vocab, size=4, replace=False)
            probs[a, nxt] += rng.dirichlet(np.ones(4)) * 0.98
        self.probs = probs / probs.sum(1, keepdims=True)
        self.cum = np.cumsum(self.probs, axis=1)
        self.vocab = vocab

    @property
    def entropy_rate(self) -> float:
        """Loss floor in nats (stationary entropy of the chain)."""
        w, v = np.linalg.eig(self.probs.T)
        pi = np.real(v[:, np.argmin(np.abs(w - 1))])
        pi = pi / pi.sum()
        return float(-(pi[:, None] * self.probs * np.log(self.probs)).sum())

    def batch(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        out = np.empty((batch, length), np.int32)
        out[:, 0] = rng.integers(0, self.vocab, batch)
        for t in range(1, length):
            u = rng.random(batch)[:, None]
            out[:, t] = (u > self.cum[out[:, t - 1]]).sum(1)
        return np.minimum(out, self.vocab - 1)

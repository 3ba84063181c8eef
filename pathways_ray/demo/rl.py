"""A reinforcement-learning loop for the demo LM: sample rollouts, score them, learn.

The policy is the demo transformer (``demo.lm``). The reward needs no model:
a rollout scores the mean log-likelihood of its transitions under the Markov
chain that generates the demo's text (``MarkovText``), so a policy that learns
to write like the chain earns more. For the default chain a uniform policy
scores about -7.6 nats a move; always taking the chain's likeliest move scores
-0.76 on average over tokens (``greedy_reward``).

Two programs, for two slices (MPMD):

- ``sample_fn(params, key)`` -> ``(tokens, rewards, next_key)``: ``rows``
  rollouts of ``cfg.seq + 1`` tokens, first token uniform, each next token
  drawn from the policy (temperature 1); the reward of each move;
- ``learn_fn(params, tokens, rewards)`` -> ``(params, mean_reward)``: one
  policy-gradient step (REINFORCE, per-move advantages against the batch's
  mean reward at that position, normalized).

``RLLoop`` places them on two slices of a client: the learner trains with a
data x model layout on one, the sampler generates with a model-parallel layout
on the other, and after every update the weights move learner -> sampler,
resharded worker to worker (``client.reshard``), never through the client.
Sampling and learning overlap: the sampler draws the next rollouts with the
weights of one update before, while the learner takes its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pathways_ray.demo.lm import LMConfig, MarkovText, forward

__all__ = ["RLConfig", "RLLoop", "chain_logprobs", "greedy_reward", "learn_fn", "sample_fn"]


@dataclass(frozen=True)
class RLConfig:
    model: LMConfig = LMConfig()
    rows: int = 32  # rollouts per iteration
    lr: float = 0.02
    clip: float = 1.0  # global gradient norm


def chain_logprobs(cfg: RLConfig, seed: int = 0) -> np.ndarray:
    """log P(next | current) of the demo's Markov chain, float32 [vocab, vocab]."""
    return np.log(MarkovText(cfg.model.vocab, seed).probs).astype(np.float32)


def greedy_reward(cfg: RLConfig, seed: int = 0) -> float:
    """The mean reward of always taking the chain's likeliest move, over tokens."""
    return float(chain_logprobs(cfg, seed).max(1).mean())


def sample_fn(cfg: RLConfig, logp_chain: np.ndarray):
    """The sampler's program: ``(params, key) -> (tokens, rewards, next_key)``.

    ``key`` is a raw ``uint32[2]`` key (``jax.random.PRNGKey``) that the program
    advances, so the loop sends nothing per iteration."""
    import jax
    import jax.numpy as jnp

    m = cfg.model
    length = m.seq + 1

    def sample(params, key):
        key, first_key, step_key = jax.random.split(key, 3)
        tokens = jnp.zeros((cfg.rows, length), jnp.int32)
        tokens = tokens.at[:, 0].set(jax.random.randint(first_key, (cfg.rows,), 0, m.vocab))

        def body(t, carry):
            tokens, k = carry
            k, sub = jax.random.split(k)
            # causal model: positions >= t do not reach position t - 1's logits
            logits = forward(params, tokens[:, :m.seq], m)
            nxt = jax.random.categorical(sub, jax.lax.dynamic_index_in_dim(
                logits, t - 1, axis=1, keepdims=False))
            return tokens.at[:, t].set(nxt.astype(jnp.int32)), k

        tokens, _ = jax.lax.fori_loop(1, length, body, (tokens, step_key))
        rewards = jnp.asarray(logp_chain)[tokens[:, :-1], tokens[:, 1:]]
        return tokens, rewards, key

    return sample


def learn_fn(cfg: RLConfig):
    """The learner's program: ``(params, tokens, rewards) -> (params, mean_reward)``."""
    import jax
    import jax.numpy as jnp

    m = cfg.model

    def loss(params, tokens, rewards):
        logits = forward(params, tokens[:, :-1], m)
        logp = jax.nn.log_softmax(logits, axis=-1)
        taken = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        adv = rewards - rewards.mean(0, keepdims=True)
        return -(jax.lax.stop_gradient(adv) * taken).mean()

    def learn(params, tokens, rewards):
        grads = jax.grad(loss)(params, tokens, rewards)
        norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, cfg.clip / (norm + 1e-6))
        params = jax.tree.map(lambda p, g: p - cfg.lr * scale * g, params, grads)
        return params, rewards.mean()

    return learn


class RLLoop:
    """The learner on slice ``learner``, the sampler on slice ``sampler``, of ``client``.

    ``step()`` runs one iteration and returns the mean reward of the rollouts it
    learned from (a ``RemoteArray`` scalar on the learner). Per iteration the
    client sends commands only: the key lives on the sampler, rollouts and
    weights move slice to slice.
    """

    def __init__(self, client, cfg: RLConfig = RLConfig(), *, learner: str | int = 0,
                 sampler: str | int = 1, learner_mesh: tuple[int, int] = (2, 2),
                 sampler_mesh: tuple[int, int] | None = None, seed: int = 0):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from pathways_ray.demo.lm import init_params, param_specs

        self.client, self.cfg = client, cfg
        self.learner, self.sampler = client.slice(learner).name, client.slice(sampler).name
        if sampler_mesh is None:  # model parallel only
            sampler_mesh = (1, client.slice(sampler).chips)
        lmesh = client.mesh(learner_mesh, ("data", "model"))
        smesh = client.mesh(sampler_mesh, ("data", "model"))
        specs = param_specs(cfg.model)

        def shardings(mesh):
            return jax.tree.map(lambda p: NamedSharding(mesh, p), specs,
                                is_leaf=lambda x: isinstance(x, P))

        self.learner_shardings, self.sampler_shardings = shardings(lmesh), shardings(smesh)
        self._rows = NamedSharding(lmesh, P("data"))
        self.params = client.device_put(init_params(cfg.model, seed), self.learner_shardings,
                                        slice=self.learner)
        self.sampler_params = self._sync_weights()
        self._key = client.device_put(np.asarray(jax.random.PRNGKey(seed)),
                                      NamedSharding(smesh, P()), slice=self.sampler)
        rows, one = NamedSharding(smesh, P("data")), NamedSharding(smesh, P())
        self._sample = client.jit(sample_fn(cfg, chain_logprobs(cfg, seed)),
                                  out_shardings=(rows, rows, one))
        self._learn = client.jit(learn_fn(cfg),
                                 out_shardings=(self.learner_shardings, NamedSharding(lmesh, P())))
        self.weight_bytes = sum(a.nbytes for a in jax.tree.leaves(self.params))
        self._rollout = self._draw()

    def _draw(self):
        tokens, rewards, self._key = self._sample(self.sampler_params, self._key)
        return tokens, rewards

    def _sync_weights(self):
        """The learner's weights in the sampler's layout, on the sampler: worker to
        worker, every array in one transfer."""
        return self.client.reshard(self.params, self.sampler_shardings, slice=self.sampler)

    def step(self):
        """One iteration; returns the learned-from rollouts' mean reward (a RemoteArray)."""
        tokens, rewards = self._rollout
        self._rollout = self._draw()  # next rollouts, with the weights of one update ago
        tokens, rewards = self.client.reshard((tokens, rewards), self._rows, slice=self.learner)
        self.params, mean_reward = self._learn(self.params, tokens, rewards)
        self.sampler_params = self._sync_weights()
        return mean_reward

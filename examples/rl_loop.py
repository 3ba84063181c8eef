"""Reinforcement learning across two slices: a learner trains, a sampler generates.

    python examples/rl_loop.py                    # 2 local emulated v6e 2x2 slices
    ray job submit --working-dir . -- python examples/rl_loop.py --iterations 40  # a cluster

MPMD inside one controller (``pathways_ray.demo.rl.RLLoop``): the learner
slice trains the demo transformer with a data x model layout; the sampler
slice generates rollouts with a model-parallel layout; the reward is each
move's log-likelihood under the Markov chain behind the demo's text, so it
needs no model download and its best value is known. After every update the
weights move learner -> sampler, resharded worker to worker; the sampler
draws the next rollouts with the weights of one update before, while the
learner takes its step. The script prints the client's own byte counters to
show that neither the weights nor the rollouts pass through it, and writes a
reward curve.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pathways_ray
from pathways_ray.demo.rl import RLConfig, RLLoop, greedy_reward


def plot(rewards: list[float], reference: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(rewards) + 1), rewards, label="mean reward of the rollouts learned from")
    ax.axhline(reference, ls="--", color="gray",
               label=f"the chain's likeliest moves ({reference:.2f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("log-likelihood per move (nats)")
    ax.set_title("pathways-ray RL loop: learner and sampler on two slices")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.resolve()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--rows", type=int, default=32, help="rollouts per iteration")
    ap.add_argument("--out", default="pathways-ray-rl", help="where the reward curve goes")
    args = ap.parse_args()
    if args.iterations < 1:
        raise SystemExit(f"--iterations={args.iterations}: give 1 or more")
    cfg = RLConfig(rows=args.rows, lr=0.05)
    with pathways_ray.cluster_or_local(num_slices=2, accelerator="v6e", topology="2x2",
                                       log_to_driver=False):
        client = pathways_ray.connect(["v6e-2x2", "v6e-2x2"])
        try:
            loop = RLLoop(client, cfg, learner=0, sampler=1)
            print(f"learner {loop.learner} (data x model 2x2), sampler {loop.sampler} "
                  f"(model parallel 1x4); {loop.weight_bytes:,} bytes of weights a sync",
                  flush=True)
            sent = dict(client.counters)
            rewards, t0 = [], time.perf_counter()
            for i in range(args.iterations):
                rewards.append(float(loop.step().fetch(timeout_s=600)))
                if i % 10 == 0 or i == args.iterations - 1:
                    print(f"iteration {i:3d}  mean reward {rewards[-1]:.3f}", flush=True)
            took = time.perf_counter() - t0
            moved = args.iterations * loop.weight_bytes
            put = client.counters["put_bytes"] - sent["put_bytes"]
            fetched = client.counters["fetched_bytes"] - sent["fetched_bytes"]
        finally:
            client.close()
    print(f"{args.iterations / took:.2f} iterations/s; weights moved learner -> sampler: "
          f"{moved:,} bytes; through the client: {put:,} bytes sent, {fetched:,} bytes "
          f"fetched (the rewards)")
    print(f"reward curve: {plot(rewards, greedy_reward(cfg), Path(args.out) / 'reward.png')}")
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} after {args.iterations} iterations")


if __name__ == "__main__":
    main()

"""Losing a slice mid-run and growing back, inside one controller.

    python benchmarks/elastic_recovery.py [--steps 120] [--kill-at 20] [--runs 10]
        [--optimizers sgd,adamw] [--chaos 0] [--freeze]

Three emulated v6e 2x2 slices train the demo LM data parallel
(``pathways_ray.elastic.data_parallel.DataParallelTrainer``), once with plain SGD
(``lr=``) and once with AdamW on a warm-up/cosine schedule after global-norm
clipping (optimizer state twice the parameters), side by side. Before step
``--kill-at`` one host is killed for real (``LocalFleet.remove_host``); ten steps
later it is restored. Prints, from one run of each on one fleet:

- failure -> the first step completed on N-1 slices, from the moment the kill
  starts (the host dies while training goes on, as a VM does);
- host back -> the first step on N slices again, and the longest step while the
  replacement was reserved and warmed up (the survivors' stall);
- the CPU-seconds the new host's processes used to come back, against how busy
  steady training keeps the machine's cores (the emulated hosts share them: a
  new host competes with the training for the cores it starts on);
- steps recomputed, and the largest loss difference from single-process optax on
  the same global batches;
- the steady step time before the failure, on N-1 and after growing back.

``--freeze`` freezes the host (SIGSTOP) instead: the failure -> next step time
then includes the step deadline that detects it ($PATHWAYS_RAY_STEP_TIMEOUT_S,
10 s by default); at the restore the frozen host is killed and replaced.

Then Ray Train's path for the same failure on the same fleet and model
(``--ray-train``, on by default): ``JaxTrainer`` in multi-controller mode,
elastic (``num_workers=(4, 12)``), a checkpoint every step (its best case: no
step lost), the same host killed at the same step; it restarts the worker group
on 2 slices from the last checkpoint. Printed: failure -> next completed step,
and the ratio to the single controller's.

``--runs N`` (default 10): N more short runs with AdamW, each killing a host after
step 4 of a fresh client while it trains on: the median, min and max of failure ->
next step from the moment the kill starts (the issue's target: a median of 2 s or
less).

``--chaos K`` then repeats K kill/restore cycles at random steps and counts the
runs that finished with every step (the chaos loop of the elastic issue; not in CI).

Snapshot overhead, for each optimizer: the same training with host-memory snapshots off, every step
and every ``DEFAULT_SNAPSHOT_EVERY`` steps, in alternating blocks of
``--overhead-steps`` steps on the same fleet; prints each mean step time and its
overhead over "off" (the mean, not the median: a snapshot every 10 steps costs
one step in ten).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import psutil

from pathways_ray import LocalFleet, connect
from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs
from pathways_ray.elastic.data_parallel import DataParallelTrainer

BATCH = 24
OPTIMIZERS = ("sgd", "adamw")


def _optimizer(name: str, steps: int):
    from pathways_ray.elastic.optim import SGD, adamw_warmup_cosine

    return SGD(0.2) if name == "sgd" else adamw_warmup_cosine(1e-2, steps, clip_norm=1.0)


def _trainer(client, cfg, optimizer, **kw):
    return DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg), init_params(cfg),
                               param_specs(cfg), mesh_shape=(2, 2), optimizer=optimizer, **kw)


def reference_losses(cfg, optimizer, batches) -> np.ndarray:
    """Single-process optax (or SGD) on the whole global batch, step by step."""
    from pathways_ray.elastic.optim import single_process

    return np.array(single_process(lambda p, b: loss_fn(p, b, cfg), init_params(cfg),
                                   optimizer, batches)[0])


def state_bytes(trainer) -> dict:
    import jax

    st = trainer.state[trainer.live[0]]
    return {k: sum(a.nbytes for a in jax.tree.leaves(v)) for k, v in st.items()}


def run_once(fleet, cfg, batches, kill_at: int, restore_after: int, expected=None,
             freeze: bool = False, optimizer=None):
    """One run with a kill and a restore; returns its measurements."""
    events, victim, losses, host_cpu = [], None, [], []
    client = connect()

    def on_event(ev) -> None:
        events.append(ev)
        if ev.kind == "slice_added":  # before its first step: what coming back cost
            host_cpu.append(fleet.host_cpu_s(victim, 0))
    try:
        trainer = _trainer(client, cfg, optimizer, min_slices=2, grow=True,
                           grow_check_s=0.5, on_elastic_event=on_event)
        victim = trainer.live[1]
        step_s, t_back, back_s = [], None, None
        recover_s, cpu = None, {}
        for i, batch in enumerate(batches):
            if i in (2, kill_at):  # the machine's CPU use in steady training, 3 slices
                cpu[i] = psutil.cpu_times()
            if i == kill_at:  # the host dies while training goes on, as a VM does
                t_fail, killer = _kill_during_training(fleet, victim, freeze)
            if i == kill_at + restore_after:
                killer.join(timeout=60)
                if freeze:
                    fleet.freeze_host(victim, 0, frozen=False)
                    try:
                        fleet.remove_host(victim, 0)
                    except Exception:  # noqa: BLE001 - its raylet may have exited on waking
                        pass
                fleet.restore_host(victim, 0)
                t_back = time.monotonic()
            t0 = time.monotonic()
            losses.append(trainer.step(batch).mean_loss())
            step_s.append(time.monotonic() - t0)
            if recover_s is None and i >= kill_at and len(trainer.live) == 2:
                recover_s = time.monotonic() - t_fail  # the first step done on 2 slices
            if t_back is not None and back_s is None and len(trainer.live) == 3:
                back_s = time.monotonic() - t_back
        grow_steps = step_s[kill_at + restore_after:] if t_back else []
        kinds = [e.kind for e in events]
        at = {e.kind: e.at for e in events}  # wall clock: the last event of each kind
        wall_back = time.time() - (time.monotonic() - t_back) if t_back else None
        out = {
            "recover_s": recover_s,
            "back_s": back_s,
            "stall_s": max(grow_steps) if grow_steps else None,
            # host back -> replacement reserved, its workers up in a JAX world; -> warm
            "reserved_s": at["slice_joining"] - wall_back if "slice_joining" in at else None,
            "warm_s": (at["slice_added"] - at["slice_joining"]
                       if {"slice_joining", "slice_added"} <= at.keys() else None),
            "host_cpu_s": host_cpu[0] if host_cpu else None,
            "busy": _busy(cpu.get(2), cpu.get(kill_at)),
            "recomputed": kinds.count("step_retried"),
            "before_s": statistics.median(step_s[2:kill_at]),
            "degraded_s": statistics.median(step_s[kill_at + 1:kill_at + restore_after]),
            "after_s": statistics.median(step_s[-5:]),
            "live": len(trainer.live),
            "steps": len(losses),
            "state_bytes": state_bytes(trainer),
            "optimizer_step": trainer.optimizer_step(),
        }
        if expected is not None:
            out["max_rel_diff"] = float(np.max(np.abs(np.array(losses) - expected)
                                               / np.abs(expected)))
        return out, losses
    finally:
        client.close()
        if victim is not None and kill_at <= len(losses) <= kill_at + restore_after:
            try:  # the run ended before the host came back: bring it back for the next
                fleet.restore_host(victim, 0)
            except Exception:  # noqa: BLE001 - it may never have been killed
                pass


def _busy(before, after) -> float | None:
    """The fraction of the machine's cores busy between two ``psutil.cpu_times()``."""
    if before is None or after is None:
        return None
    spent = {k: getattr(after, k) - getattr(before, k) for k in after._fields}
    idle = spent["idle"] + spent.get("iowait", 0.0)
    return 1.0 - idle / max(sum(spent.values()), 1e-9)


def _kill_during_training(fleet, victim: str, freeze: bool):
    """Start killing (or freezing) the victim's host in the background; returns when
    it started and the thread (``remove_host`` returns once Ray marks the node dead,
    while the trainer's next steps run)."""
    import threading

    t0 = time.monotonic()
    thread = threading.Thread(target=fleet.freeze_host if freeze else fleet.remove_host,
                              args=(victim, 0), daemon=True)
    thread.start()
    return t0, thread


def recovery_runs(fleet, cfg, batches, optimizer, runs: int) -> list[tuple[float, float]]:
    """``runs`` short runs, each killing slice 1's host after step 4 of a fresh client
    while training goes on: from the moment the kill starts to the slice_lost event
    (the trainer sees SliceLost) and to the first step done on the 2 survivors."""
    out = []
    for _ in range(runs):
        wait_all_free(3)
        client = connect()
        victim, killer, events = None, None, []
        try:
            trainer = _trainer(client, cfg, optimizer, min_slices=2,
                               on_elastic_event=events.append)
            victim = trainer.live[1]
            for b in batches[:4]:
                trainer.step(b).mean_loss()
            wall = time.time()
            t0, killer = _kill_during_training(fleet, victim, freeze=False)
            for b in batches[4:]:
                trainer.step(b).mean_loss()
                if len(trainer.live) == 2:
                    lost = next(e.at for e in events if e.kind == "slice_lost") - wall
                    out.append((lost, time.monotonic() - t0))
                    break
        finally:
            client.close()
            if killer is not None:
                killer.join(timeout=60)
                fleet.restore_host(victim, 0)
    return out


def snapshot_overhead(cfg, batches, steps: int, optimizer, rounds: int = 3) -> dict:
    """Mean step time with snapshots off, every step and at the default interval."""
    from pathways_ray.elastic.elastic_policy import DEFAULT_SNAPSHOT_EVERY

    modes = {"off": None, "every step": 1, f"every {DEFAULT_SNAPSHOT_EVERY}":
             DEFAULT_SNAPSHOT_EVERY}
    times: dict[str, list[float]] = {k: [] for k in modes}
    with connect() as client:
        trainers = {k: _trainer(client, cfg, optimizer, snapshot_every=v)
                    for k, v in modes.items()}
        for t in trainers.values():  # compiled and warm
            for b in batches[:3]:
                t.step(b).mean_loss()
        for _ in range(rounds):
            for k, t in trainers.items():
                for b in batches[:steps]:
                    t0 = time.monotonic()
                    t.step(b).mean_loss()
                    times[k].append(time.monotonic() - t0)
                if t._snapshot is not None:  # the last copy is part of this mode's cost
                    t0 = time.monotonic()
                    t._snapshot.wait()
                    times[k][-1] += time.monotonic() - t0
        from pathways_ray.elastic import snapshot

        kept = snapshot.latest_step(client)
    mean = {k: statistics.mean(v) for k, v in times.items()}
    return {"mean_s": mean, "kept_step": kept,
            "overhead": {k: mean[k] / mean["off"] - 1 for k in modes if k != "off"}}


def wait_all_free(n: int, timeout_s: float = 120) -> None:
    """Until ``n`` slices are free again (a run's slices are released after it)."""
    from pathways_ray.clusters.cluster import cluster_slices

    deadline = time.monotonic() + timeout_s
    while sum(v.idle for v in cluster_slices()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} free slices after {timeout_s} s: "
                               f"{[(v.name, v.state) for v in cluster_slices()]}")
        time.sleep(0.5)


def _ray_train_loop(config: dict) -> None:
    """Multi-controller data x model parallel training of the demo LM, restartable: a
    checkpoint every step; rank 0 logs (time, step, world size) after each step."""
    import json
    import os
    import tempfile

    import jax
    import ray.train
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray.demo.lm import sgd_update

    cfg = LMConfig(lr=0.2)  # Ray Train's best case: SGD, no optimizer state to save
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 2), ("data", "model"))
    shard = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg),
                         is_leaf=lambda x: isinstance(x, P))
    host, treedef = jax.tree.flatten(init_params(cfg))
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = np.load(os.path.join(d, "state.npz"))
            start = int(saved["step"])
            host = [saved[f"p{i}"] for i in range(len(host))]

    def put(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    params = jax.tree.map(put, jax.tree.unflatten(treedef, host), shard)
    batch_sharding = NamedSharding(mesh, P("data"))

    def step(p, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch, cfg)
        return sgd_update(p, grads, cfg.lr), loss

    step = jax.jit(step, out_shardings=(shard, NamedSharding(mesh, P())))
    ctx = ray.train.get_context()
    for i in range(start, len(config["batches"])):
        params, loss = step(params, put(np.asarray(config["batches"][i]), batch_sharding))
        loss = float(loss)
        gathered = multihost_utils.process_allgather(params, tiled=True)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                np.savez(os.path.join(d, "state.npz"), step=i + 1,
                         **{f"p{k}": v for k, v in enumerate(jax.tree.leaves(gathered))})
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": i + 1, "loss": loss}, checkpoint=checkpoint)
        if ctx.get_world_rank() == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"t": time.time(), "step": i + 1,
                                    "world": ctx.get_world_size()}) + "\n")


def ray_train_recovery(fleet, batches, kill_at: int, victim: str) -> dict:
    """Ray Train's restart from checkpoint for a host killed before step ``kill_at``."""
    import json
    import tempfile
    import threading
    from pathlib import Path

    from pathways_ray.trainers import (
        FailureConfig,
        JaxTrainer,
        RunConfig,
        ScalingConfig,
    )

    tmp = Path(tempfile.mkdtemp(prefix="belastic-rt-"))
    log = tmp / "steps.jsonl"
    killed: dict = {}

    def lines():
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def killer():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if any(x["step"] >= kill_at for x in lines()):
                killed["t"] = time.time()  # the kill starts, as above
                fleet.remove_host(victim, 0)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    trainer = JaxTrainer(
        _ray_train_loop,
        train_loop_config={"batches": [b.tolist() for b in batches], "log": str(log)},
        scaling_config=ScalingConfig(use_tpu=True, accelerator_type="TPU-V6E",
                                     topology="2x2", num_workers=(4, 12),
                                     resources_per_worker={"TPU": 1}),
        run_config=RunConfig(name="belastic-rt", storage_path=str(tmp / "runs"),
                             failure_config=FailureConfig(max_failures=3)))
    t0 = time.time()
    trainer.fit()
    thread.join(timeout=5)
    fleet.restore_host(victim, 0)
    steps = lines()
    after = [x for x in steps if "t" in killed and x["t"] > killed["t"]]
    return {"start_s": steps[0]["t"] - t0 if steps else None,
            "recover_s": after[0]["t"] - killed["t"] if after else None,
            "world_after": after[0]["world"] if after else None,
            "resumed_at": after[0]["step"] if after else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120,
                    help="steps a run (grow back takes ~55 steps here; --chaos runs use 60)")
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--restore-after", type=int, default=10)
    ap.add_argument("--optimizers", default="sgd,adamw",
                    help="the runs to compare, comma-separated: sgd, adamw (default both)")
    ap.add_argument("--runs", type=int, default=10,
                    help="short AdamW runs for the failure -> next step median (0: skip)")
    ap.add_argument("--chaos", type=int, default=0, help="extra runs killing at random steps")
    ap.add_argument("--freeze", action="store_true", help="freeze the host instead of killing")
    ap.add_argument("--overhead-steps", type=int, default=20,
                    help="steps per block of the snapshot overhead measurement (0: skip)")
    ap.add_argument("--ray-train", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure Ray Train's restart from checkpoint (default on)")
    args = ap.parse_args()
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if not names or set(names) - set(OPTIMIZERS):
        ap.error(f"--optimizers={args.optimizers!r}: pick from {', '.join(OPTIMIZERS)}")
    from pathways_ray.cli.main import handle_sigterm_as_interrupt

    handle_sigterm_as_interrupt()  # a killed benchmark stops its fleet
    cfg = LMConfig()
    rng, text = np.random.default_rng(0), MarkovText(cfg.vocab)
    batches = [text.batch(rng, BATCH, cfg.seq + 1) for _ in range(args.steps)]
    opts = {n: _optimizer(n, args.steps) for n in names}
    with LocalFleet(num_slices=3, accelerator="v6e", topology="2x2", name="belastic",
                    log_to_driver=False) as fleet:
        ms = {}
        for n, opt in opts.items():
            wait_all_free(3)
            ms[n], _ = run_once(fleet, cfg, batches, args.kill_at, args.restore_after,
                                reference_losses(cfg, opt, batches), freeze=args.freeze,
                                optimizer=opt)
        print(f"3 x v6e 2x2, demo LM, global batch {BATCH}, {args.steps} steps, one host "
              f"{'frozen' if args.freeze else 'killed'} before step {args.kill_at}, back "
              f"{args.restore_after} steps later")

        def row(label, fmt, key):
            cells = []
            for n in names:
                v = key(ms[n]) if callable(key) else ms[n][key]
                cells.append(f"{'-' if v is None else format(v, fmt):>12}")
            print(f"  {label:<42}" + "".join(cells))

        print(f"  {'':<42}" + "".join(f"{n:>12}" for n in names))
        row("state on each slice (KiB)", ".0f", lambda m: sum(m["state_bytes"].values()) / 1024)
        row("failure (kill starts) -> next step (s)", ".2f", "recover_s")
        row("host back -> training on 3 slices (s)", ".2f", "back_s")
        row("  of which reserved, 4 workers up (s)", ".2f", "reserved_s")
        row("  of which programs loaded, warm (s)", ".2f", "warm_s")
        row("  the new host's processes used (CPU-s)", ".1f", "host_cpu_s")
        row("  cores busy in steady training (%)", ".0f",
            lambda m: None if m["busy"] is None else 100 * m["busy"])
        row("longest step while growing back (s)", ".2f", "stall_s")
        row("steps recomputed", "d", "recomputed")
        row("losses vs single-process (max rel)", ".1e", "max_rel_diff")
        row("optimizer's step count at the end", "d", "optimizer_step")
        row("steps run", "d", "steps")
        row("step: 3 slices (s)", ".3f", "before_s")
        row("step: 2 slices (s)", ".3f", "degraded_s")
        row("step: grown back (s)", ".3f", "after_s")
        for n in names:
            if ms[n]["back_s"] is None:
                print(f"  {n}: did not grow back within the run (raise --steps)")
        if args.runs and "adamw" in opts:
            runs = recovery_runs(fleet, cfg, batches, opts["adamw"], args.runs)
            lost, times = [r[0] for r in runs], [r[1] for r in runs]
            print(f"AdamW, {len(times)} runs, a host killed after step 4 of a fresh client: "
                  f"failure (kill starts) -> next step median {statistics.median(times):.2f} s "
                  f"(min {min(times):.2f}, max {max(times):.2f}; target <= 2 s); of which "
                  f"kill starts -> the trainer sees SliceLost median "
                  f"{statistics.median(lost):.2f} s, slice lost -> next step "
                  f"{statistics.median(t - x for x, t in runs):.2f} s")
        if args.overhead_steps:
            for n, opt in opts.items():
                wait_all_free(3)
                o = snapshot_overhead(cfg, batches, args.overhead_steps, opt)
                print(f"Host-memory snapshots, {n} ({sum(ms[n]['state_bytes'].values()) / 1024:.0f}"
                      f" KiB of state; 3 slices, mean of {3 * args.overhead_steps} steps each, "
                      f"alternating blocks):")
                for k, v in o["mean_s"].items():
                    extra = (f"  overhead {100 * o['overhead'][k]:+5.1f}%"
                             if k in o["overhead"] else "")
                    print(f"  {k:<12} {v:.3f} s/step{extra}")
        if args.ray_train:
            wait_all_free(3)
            rt = ray_train_recovery(fleet, batches[:args.kill_at + 6], args.kill_at,
                                    "v6e-2x2-1")
            print("Ray Train (JaxTrainer multi-controller, num_workers=(4, 12), SGD, a "
                  "checkpoint every step), the same host killed at the same step:")
            if rt["recover_s"] is None:
                print("  no step completed after the kill")
            else:
                first = ms[names[0]]["recover_s"]
                print(f"  failure -> next step done ({rt['world_after']} workers, resumed at "
                      f"step {rt['resumed_at']})  {rt['recover_s']:7.2f} s")
                print(f"  ratio Ray Train / single controller ({names[0]})  "
                      f"{rt['recover_s'] / first:7.1f}x")
        survived = 0
        pick = np.random.default_rng(1)
        short = min(60, args.steps)  # a chaos run asks only that every step completes
        for k in range(args.chaos):
            kill_at = int(pick.integers(3, short - args.restore_after - 5))
            try:
                wait_all_free(3)
                r, _ = run_once(fleet, cfg, batches[:short], kill_at, args.restore_after,
                                freeze=args.freeze, optimizer=opts[names[-1]])
                ok = r["steps"] == short
            except Exception as e:  # noqa: BLE001 - counted, and shown
                print(f"  chaos run {k}: killed before step {kill_at}: {type(e).__name__}: {e}")
                ok = False
            survived += ok
        if args.chaos:
            print(f"  chaos: {survived} of {args.chaos} runs finished every step")


if __name__ == "__main__":
    main()

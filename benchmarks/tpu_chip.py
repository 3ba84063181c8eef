"""The chip path on a real TPU chip, without Ray: what a chip worker does, checked
where it matters.

    python benchmarks/tpu_chip.py [--steps 20] [--json PATH]

On one TPU chip (no Ray: one process holds the chip), each program is exported by
``export_program`` for "tpu" and run by the chip's ``Executor`` (Load, Put, Run,
Free) two ways: called directly, and through the chip worker's stream (each batch
pickled and framed, as the controller sends it, over a unix socket into a thread
that runs the executor: the stream less TCP and acks). Checks:
- the demo LM's train step: 20 steps with losses bitwise equal to ``jax.jit`` of
  the same function on the same chip;
- a step with a Pallas TPU kernel: runs on the chip, equal to ``jax.jit``;
- dispatch: a chained bf16 matmul step at ~0.25, 1 and 4 ms, one batch (Run + Free)
  per step through the stream, against direct ``jax.jit``: the ratio of steps/s
  (target >= 0.95 at ~1 ms);
- the persistent compilation cache: the same program compiled in a second
  process is a cache hit.
Where there is no TPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

PLATFORM = "tpu"  # what programs are exported for; --on-cpu checks this script itself

CACHE_CHILD = """
import sys, json
import jax, numpy as np
from pathways_ray.programs import compile_cache
counter = compile_cache.count_events(sys.argv[1], "tpu_chip")
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
sys.path.insert(0, sys.argv[2])
import tpu_chip
tpu_chip.PLATFORM = sys.argv[3]
if sys.argv[3] == "tpu" and jax.devices()[0].platform != "tpu":
    print("NO TPU here (JAX's devices are " + jax.devices()[0].platform + "): this check "
          "runs on a TPU host; nothing was measured", flush=True)
    sys.exit(0)
tpu_chip.compile_demo_once()
print("COUNTS", json.dumps(counter.counts.as_dict()), flush=True)
"""


def _versions() -> dict:
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    try:
        from importlib.metadata import version

        out["libtpu"] = version("libtpu")
    except Exception:  # noqa: BLE001 - the name differs across releases
        out["libtpu"] = "?"
    return out


class Chip:
    """One chip's ``Executor``, called directly or through a framed stream."""

    def __init__(self):
        from pathways_ray.chips.executor import Executor

        self.host: dict[int, np.ndarray] = {}
        self.executor = Executor(0, pieces=self._pieces)
        self._ids = iter(range(1, 1 << 40))
        self._sock = None

    def _pieces(self, buffer_id: int):
        data = self.host.pop(buffer_id)
        return [(tuple(slice(0, n) for n in data.shape), data)]

    def new_id(self) -> int:
        return next(self._ids)

    # ---- the stream: the chip worker's framing over a unix socket ---------------
    def open_stream(self) -> None:
        from pathways_ray.transport.channel import recv_msg

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours

        def serve() -> None:
            while True:
                try:
                    payload = recv_msg(theirs)
                except (ConnectionError, OSError):
                    return
                self.executor.run(pickle.loads(payload))

        threading.Thread(target=serve, daemon=True).start()

    def send(self, batch: list) -> None:
        from pathways_ray.transport.channel import dumps, send_msg

        if self._sock is None:
            self.executor.run(batch)
        else:
            send_msg(self._sock, dumps(batch))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ---- commands ---------------------------------------------------------------
    def put(self, x: np.ndarray, mesh) -> int:
        from pathways_ray.transport.commands import Put

        buffer_id = self.new_id()
        self.host[buffer_id] = np.ascontiguousarray(x)
        self.send([Put(buffer_id, tuple(x.shape), x.dtype.name, ((),) * x.ndim, mesh)])
        return buffer_id

    def fetch(self, buffer_id: int, timeout_s: float = 120) -> np.ndarray:
        deadline = time.monotonic() + timeout_s
        while buffer_id not in self.executor.buffers:  # the stream's thread puts it there
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer {buffer_id} did not appear in {timeout_s} s")
            time.sleep(0.0005)
        return np.asarray(self.executor.local_shard(buffer_id))


def _demo():
    from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, sgd_update

    cfg = LMConfig()

    def train_step(params, batch):
        import jax

        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        return loss, sgd_update(params, grads, cfg.lr)

    return cfg, init_params(cfg), MarkovText(cfg.vocab), train_step


def _export(fn, args, name):
    import jax

    from pathways_ray.programs.program import export_program
    from pathways_ray.programs.sharding import MeshShape

    mesh = MeshShape(("chips",), (1,))
    leaves, treedef = jax.tree.flatten(args)
    flat = lambda *xs: fn(*jax.tree.unflatten(treedef, xs))  # noqa: E731
    program, out_tree = export_program(
        flat, mesh, [((),) * np.ndim(x) for x in leaves], None,
        [(np.shape(x), np.asarray(x).dtype) for x in leaves],
        [f"arg{i}" for i in range(len(leaves))], static_name=name, platform=PLATFORM)
    return program, out_tree, mesh


def compile_demo_once() -> None:
    """Load and compile the demo step on the chip (the second process's half)."""
    from pathways_ray.transport.commands import Compile, Load

    cfg, params, text, step = _demo()
    batch = text.batch(np.random.default_rng(0), 8, cfg.seq + 1)
    program, _, mesh = _export(step, (params, batch), "demo_step")
    chip = Chip()
    status = chip.new_id()
    sigs = tuple((s.shape, s.dtype, s.spec) for s in program.in_sigs)
    chip.send([Load(program.fingerprint, program.blob),
               Compile(program.fingerprint, sigs, status, mesh)])
    chip.fetch(status)


def run_steps(chip: Chip, fn, params, batches, name: str) -> list[float]:
    """``fn(params, batch) -> (loss, params)`` through the chip, one batch per step."""
    import jax

    from pathways_ray.transport.commands import Free, Load, Run

    program, out_tree, mesh = _export(fn, (params, batches[0]), name)
    leaves = jax.tree.leaves(params)
    ids = [chip.put(np.asarray(x), mesh) for x in leaves]
    chip.send([Load(program.fingerprint, program.blob)])
    losses = []
    for batch in batches:
        b = chip.put(batch, mesh)
        outs = [chip.new_id() for _ in program.out_sigs]
        chip.send([Run(program.fingerprint, (*ids, b), tuple(outs)), Free((*ids, b))])
        loss_id, ids = outs[0], outs[1:]
        losses.append(float(chip.fetch(loss_id)))
        chip.send([Free((loss_id,))])
    return losses


def direct_steps(fn, params, batches) -> list[float]:
    import jax

    from pathways_ray.programs.program import _pallas_interpreted

    step = jax.jit(fn)
    losses = []
    with _pallas_interpreted(PLATFORM == "cpu"):  # --on-cpu: as the export traces it
        for batch in batches:
            loss, params = step(params, batch)
            losses.append(float(loss))
    return losses


def _pallas_step():
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.tanh(jnp.dot(x_ref[...], w_ref[...],
                                      preferred_element_type=jnp.float32))

    def step(params, batch):
        w = params["w"]
        blocks = pl.BlockSpec((128, 256), lambda i: (i, 0))
        h = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((batch.shape[0], 256),
                                                                  jnp.float32),
                           grid=(batch.shape[0] // 128,),
                           in_specs=[blocks, pl.BlockSpec((256, 256), lambda i: (0, 0))],
                           out_specs=blocks)(batch, w)
        loss = jnp.mean(h ** 2)
        return loss, {"w": w - 0.01 * jnp.mean(h) * jnp.ones_like(w)}

    rng = np.random.default_rng(1)
    params = {"w": (rng.normal(size=(256, 256)) / 16).astype(np.float32)}
    batches = [rng.normal(size=(512, 256)).astype(np.float32) for _ in range(5)]
    return step, params, batches


def dispatch_ratio(target_ms: float, seconds: float) -> dict:
    """Direct jit vs. the stream path on a chained bf16 matmul step near ``target_ms``."""
    import jax
    import jax.numpy as jnp

    from pathways_ray.transport.commands import Free, Load, Run

    n = 2048

    def make(k):
        def step(z):
            w = jnp.eye(n, dtype=z.dtype) * 0.5
            for _ in range(k):
                z = jnp.tanh(z @ w)
            return z
        return step

    z0 = np.ones((n, n), jnp.bfloat16)
    eight = jax.jit(make(8))  # one matmul alone is mostly the step's fixed cost
    z = eight(z0).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        z = eight(z)
    z.block_until_ready()
    per_matmul_ms = (time.perf_counter() - t0) * 1e3 / 20 / 8
    k = max(1, round(target_ms / per_matmul_ms))
    direct = jax.jit(make(k))
    z = direct(z0).block_until_ready()
    step_ms = None
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        z = direct(z)
        steps += 1
    z.block_until_ready()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    direct_rate = steps / (time.perf_counter() - t0)

    chip = Chip()
    chip.open_stream()
    program, _, mesh = _export(make(k), (z0,), f"chain_{k}")
    zid = chip.put(z0, mesh)
    chip.send([Load(program.fingerprint, program.blob)])
    nxt = chip.new_id()
    chip.send([Run(program.fingerprint, (zid,), (nxt,)), Free((zid,))])
    chip.fetch(nxt)
    zid = nxt
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        nxt = chip.new_id()
        chip.send([Run(program.fingerprint, (zid,), (nxt,)), Free((zid,))])
        zid = nxt
        steps += 1
    chip.fetch(zid)
    chip.executor.ready([zid])
    stream_rate = steps / (time.perf_counter() - t0)
    chip.close()
    return {"target_ms": target_ms, "matmuls": k, "step_ms": round(step_ms, 3),
            "direct_steps_s": round(direct_rate, 1), "stream_steps_s": round(stream_rate, 1),
            "ratio": round(stream_rate / direct_rate, 3)}


def compile_cache_check() -> list[dict] | None:
    """Counts of two processes compiling the demo step on the chip in turn (None, and a
    line saying so, where there is no TPU)."""
    with tempfile.TemporaryDirectory() as cache:
        counts = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", CACHE_CHILD, cache,
                                  os.path.dirname(os.path.abspath(__file__)), PLATFORM],
                                 capture_output=True, text=True, timeout=600)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("COUNTS")),
                        None)
            if line is None:
                if "NO TPU" in out.stdout:
                    print(out.stdout.strip().splitlines()[-1])
                    return None
                raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
            counts.append(json.loads(line.removeprefix("COUNTS")))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=3.0, help="per dispatch measurement")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--on-cpu", action="store_true",
                    help="run on CPU anyway, exporting for cpu (checks this script, not a chip)")
    args = ap.parse_args()

    global PLATFORM
    if args.on_cpu:
        PLATFORM = "cpu"
    # First, while this process has not opened the chip (one process at a time may):
    # the same program compiled in two processes, the second a persistent-cache hit.
    counts = compile_cache_check()
    if counts is None:
        return

    import jax

    report: dict = {"versions": _versions(), "device": jax.devices()[0].device_kind,
                    "date": time.strftime("%Y-%m-%d"), "compile_cache": counts}
    print(f"{report['device']}: {report['versions']}")

    cfg, params, text, step = _demo()
    rng = np.random.default_rng(0)
    batches = [text.batch(rng, 8, cfg.seq + 1) for _ in range(args.steps)]
    want = direct_steps(step, params, batches)
    for mode in ("direct", "stream"):
        chip = Chip()
        if mode == "stream":
            chip.open_stream()
        got = run_steps(chip, step, params, batches, "demo_step")
        chip.close()
        report[f"demo_{mode}_bitwise"] = got == want
        print(f"demo LM, {args.steps} steps through the executor ({mode}): losses "
              f"{'bitwise equal to' if got == want else 'DIFFER from'} jax.jit "
              f"({got[0]:.6f} -> {got[-1]:.6f})")
    report["demo_losses"] = want

    pstep, pparams, pbatches = _pallas_step()
    want = direct_steps(pstep, pparams, pbatches)
    chip = Chip()
    chip.open_stream()
    got = run_steps(chip, pstep, pparams, pbatches, "pallas_step")
    chip.close()
    report["pallas_bitwise"] = got == want
    print(f"Pallas step, {len(pbatches)} steps through the stream: losses "
          f"{'bitwise equal to' if got == want else 'DIFFER from'} jax.jit ({got[-1]:.6f})")

    report["dispatch"] = [dispatch_ratio(ms, args.seconds) for ms in (0.25, 1.0, 4.0)]
    for d in report["dispatch"]:
        print(f"dispatch at {d['step_ms']:.2f} ms steps ({d['matmuls']} matmuls): "
              f"stream {d['stream_steps_s']} steps/s vs jit {d['direct_steps_s']}: "
              f"ratio {d['ratio']}")

    print(f"compile cache: first process {counts[0]}, second {counts[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

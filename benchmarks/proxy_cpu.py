"""Where the CPU of a small op through the IFRT proxy goes: per process, and per thread
of the proxy, on one emulated v6e 2x2 slice (4 chips).

    python benchmarks/proxy_cpu.py [--puts 1000] [--steps 300]

A plain JAX script (``JAX_PLATFORMS=proxy``, pathwaysutils) runs two bursts against a
warm ``ProxyServer`` in this process: ``--puts`` ``device_put`` of 1 KiB over the 4
chips, then ``--steps`` train steps fed a host batch each (``proxy_ops.py``'s step: a
512x128 and a 512x16 float32 batch put, one jit), each burst ended by one wait. Around
each burst every process's CPU time is read from /proc, and every thread's of this
one. Prints wall ms per op and CPU ms per op by process (the JAX client, the proxy,
the controller, the chip workers, Ray's daemons) and by proxy thread.

On this machine every process shares the same cores, so in a burst the wall time per
op is about the sum of the CPU column over the cores; on a fleet the client, the proxy
and each chip's host run apart, and the busiest of them sets the pace.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy_ops import _env  # noqa: E402

CLIENT = """
import sys, time
import numpy as np
import jax, jax.numpy as jnp
import pathwaysutils
pathwaysutils.initialize()
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data"))
puts, steps = int(sys.argv[1]), int(sys.argv[2])
small = np.ones(256, np.float32)
rng = np.random.default_rng(0)
batches = [(rng.standard_normal((512, 128), np.float32),
            rng.standard_normal((512, 16), np.float32)) for _ in range(8)]

@jax.jit
def step(w, x, y):
    loss = lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2)
    l, g = jax.value_and_grad(loss)(w)
    return l, w - 0.1 * g

w = jax.device_put(np.zeros((128, 16), np.float32), rows)
for x, y in batches[:2]:  # compiles, first transfers
    l, w = step(w, jax.device_put(x, rows), jax.device_put(y, rows))
jax.block_until_ready([w, jax.device_put(small, rows)])

def burst(name, n, run):
    time.sleep(1)
    print("START", name, n, flush=True)
    run(n)
    print("END", name, flush=True)
    sys.stdin.readline()  # the measurement is read before the next burst

burst("put 1 KiB", puts, lambda n: jax.block_until_ready(
    [jax.device_put(small, rows) for _ in range(n)][-1]))

def host_steps(n):
    global w
    for i in range(n):
        x, y = batches[i % 8]
        l, w = step(w, jax.device_put(x, rows), jax.device_put(y, rows))
    jax.block_until_ready(w)

burst("step, host batch", steps, host_steps)
"""


def _process_cpu() -> dict[int, tuple[float, str]]:
    """CPU seconds and a short name of every process."""
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            t = p.cpu_times()
            cmd = p.info["cmdline"] or [p.info["name"] or "?"]
            out[p.pid] = (t.user + t.system, os.path.basename(cmd[0]).split()[0])
        except psutil.Error:
            continue
    return out


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name (Python's, else the OS's)."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.Counter()
    task = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(task):
        try:
            fields = open(f"{task}/{tid}/stat").read().rsplit(")", 1)[1].split()
            comm = open(f"{task}/{tid}/comm").read().strip()
        except OSError:
            continue
        name = names.get(tid, comm)
        name = name.rstrip("0123456789").rstrip("_-") or name  # a pool's threads together
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _label(pid: int, name: str, client_pid: int) -> str:
    if pid == os.getpid():
        return "proxy (this process)"
    if pid == client_pid:
        return "JAX client (jaxlib)"
    return name


def measure(args) -> list[tuple[str, int, float, dict, dict]]:
    from pathways_ray import LocalFleet
    from pathways_ray.proxy.server import ProxyServer

    results = []
    with LocalFleet(num_slices=1, accelerator="v6e", topology="2x2", name="bproxycpu",
                    log_to_driver=False):
        with ProxyServer(["v6e-2x2"], warm=True) as server:
            env = _env({**server.exports, "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "120"})
            proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(args.puts),
                                     str(args.steps)], env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            # Reading the client's lines has no timeout of its own: a stuck client is
            # killed, which ends the loop below.
            watchdog = threading.Timer(args.timeout_s, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:
                    if line.startswith("START"):
                        _, name_n = line.split(" ", 1)
                        name, n = name_n.rsplit(" ", 1)
                        before, threads, t0 = _process_cpu(), _thread_cpu(), time.perf_counter()
                    elif line.startswith("END"):
                        wall = time.perf_counter() - t0
                        after, threads_after = _process_cpu(), _thread_cpu()
                        by_proc: dict[str, float] = collections.Counter()
                        for pid, (cpu, pname) in after.items():
                            if pid in before:
                                by_proc[_label(pid, pname, proc.pid)] += cpu - before[pid][0]
                        by_thread = {k: v - threads.get(k, 0.0) for k, v in threads_after.items()}
                        results.append((name, int(n), wall, by_proc, by_thread))
                        proc.stdin.write("\n")
                        proc.stdin.flush()
                if proc.wait(timeout=120) != 0:
                    raise SystemExit(f"the client failed ({proc.returncode}), or ran past "
                                     f"--timeout-s={args.timeout_s:.0f} and was killed")
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    proc.kill()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puts", type=int, default=1000, help="device_puts in the first burst")
    ap.add_argument("--steps", type=int, default=300, help="host-batch steps in the second")
    ap.add_argument("--timeout-s", type=float, default=600,
                    help="kill the client after this many seconds (a stuck proxy)")
    args = ap.parse_args()
    for name, n, wall, by_proc, by_thread in measure(args):
        total = sum(by_proc.values())
        print(f"\n{name}: {wall * 1e3 / n:.2f} ms per op wall, {total * 1e3 / n:.2f} ms of CPU "
              f"per op in all ({os.cpu_count()} cores)")
        print("  CPU ms per op, by process:")
        for k, v in collections.Counter(by_proc).most_common(8):
            print(f"    {v * 1e3 / n:7.2f}  {k}")
        print("  CPU ms per op, by thread of the proxy:")
        for k, v in collections.Counter(by_thread).most_common(8):
            print(f"    {v * 1e3 / n:7.2f}  {k}")


if __name__ == "__main__":
    main()

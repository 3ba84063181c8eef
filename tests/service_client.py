"""A client of a shared service, run as its own process by tests/test_service.py.

Leases one slice, says what it found there, then trains a tiny model step after
step until a line arrives on stdin; then closes. Prints one line per event:
``LEASED <lease> <slice> buffers=<n> programs=<n>``, ``STEP <i> <loss>``,
``CLOSED``, or ``REVOKED <message>`` / ``ERROR <type> <message>``.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np


def main() -> int:
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pathways_ray as pr

    service, shape = sys.argv[1], sys.argv[2]
    pr.Fleet.attach()  # RAY_ADDRESS and the token come from the environment
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    try:
        client = pr.connect(service=service, slices={shape: 1})
        info = client.slices[0]
        found = client.stats()[info.name]["workers"]
        print(f"LEASED {client.lease} {info.name} buffers={sum(w['buffers'] for w in found)} "
              f"programs={sum(w['programs'] for w in found)}", flush=True)
        mesh = client.mesh((info.chips,), ("data",))
        rng = np.random.default_rng(0)
        x = client.device_put(rng.normal(size=(64, 8)).astype(np.float32),
                              NamedSharding(mesh, P("data")))
        y = client.device_put(rng.normal(size=(64,)).astype(np.float32),
                              NamedSharding(mesh, P("data")))
        w = client.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P()))

        @client.jit
        def step(w, x, y):
            grad = 2 * x.T @ (x @ w - y) / x.shape[0]
            return w - 0.05 * grad, jnp.mean((x @ w - y) ** 2)

        i = 0
        while not stop.is_set():
            w, loss = step(w, x, y)
            print(f"STEP {i} {float(loss.fetch()):.5f}", flush=True)
            i += 1
            time.sleep(0.05)
        client.close()
        print("CLOSED", flush=True)
        return 0
    except pr.LeaseRevoked as e:
        print(f"REVOKED {e}", flush=True)
        return 3
    except pr.PathwaysError as e:
        print(f"ERROR {type(e).__name__} {e}", flush=True)
        return 4


if __name__ == "__main__":
    sys.exit(main())

"""Plain JAX scripts that ``test_proxy`` runs as a user would: no ``pathways_ray`` import,
only environment variables and ``pathwaysutils.initialize()``. Each runs the same on 4
local CPU devices (``JAX_PLATFORMS=cpu``), the reference its results are compared with.
"""

PREAMBLE = """
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
PROXY = os.environ.get("JAX_PLATFORMS") == "proxy"
if PROXY:
    import pathwaysutils
    pathwaysutils.initialize()
devices = jax.devices()
# Slice 0's four chips, and slice 1's (locally: the same four CPU devices).
mesh0 = Mesh(np.array(devices[:4]), ("data",))
mesh1 = Mesh(np.array(devices[4:8] if PROXY else devices[:4]), ("data",))
rng = np.random.default_rng(0)
X = rng.normal(size=(64, 16)).astype(np.float32)
Y = rng.normal(size=(64, 4)).astype(np.float32)
params = {"w": rng.normal(size=(16, 4)).astype(np.float32) * 0.1, "b": np.zeros(4, np.float32)}

def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

@jax.jit
def step(p, x, y):
    l, g = jax.value_and_grad(loss_fn)(p, x, y)
    return l, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

@jax.jit
def other(z):
    return jnp.sin(z) * 1.01 + 0.1

p = jax.device_put(params, NamedSharding(mesh0, P()))
x = jax.device_put(X, NamedSharding(mesh0, P("data")))
y = jax.device_put(Y, NamedSharding(mesh0, P("data")))
z = jax.device_put(np.arange(32, dtype=np.float32), NamedSharding(mesh1, P("data")))
"""

# 20 train steps on slice 0 while another program runs on slice 1; then a 4 MiB array
# made on slice 0 is device_put to slice 1 and summed there.
TRAIN = PREAMBLE + """
losses = []
for i in range(20):
    l, p = step(p, x, y)
    z = other(z)
    losses.append(float(l))
big = jax.jit(lambda: jnp.arange(1 << 20, dtype=jnp.float32).reshape(1024, 1024),
              out_shardings=NamedSharding(mesh0, P("data")))()
moved = jax.device_put(big, NamedSharding(mesh1, P("data")))
print("RESULT", json.dumps({
    "n": len(devices), "slices": [d.slice_index for d in devices] if PROXY else [],
    "losses": losses, "z": np.asarray(z).tolist(), "w": np.asarray(p["w"]).tolist(),
    "step_on": sorted({d.id for d in p["w"].sharding.device_set}),
    "z_on": sorted({d.id for d in z.sharding.device_set}),
    "moved_on": sorted({d.id for d in moved.sharding.device_set}),
    "total": float(jax.jit(jnp.sum)(moved))}), flush=True)
"""

# Trains until a host of slice 0 dies under it; reports what the user sees.
LOSS = PREAMBLE + """
from pathwaysutils.elastic import elastic
import time
# Arrays in the hosts' memory of each slice: slice 0's go with its host, slice 1's stay.
x_host = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
z_host = jax.device_put(z, z.sharding.with_memory_kind("pinned_host"))
from jax.experimental import colocated_python as cp
plus_one = cp.colocated_python(lambda a: a + 1)
cpu_ones = [jax.device_put(np.ones(4, np.float32), NamedSharding(
    Mesh(np.array(cp.colocated_cpu_devices(m.devices.flat)), ("x",)), P("x")))
    for m in (mesh0, mesh1)]
np.asarray(plus_one(cpu_ones[0]))  # (slice 0's sidecar is up when its host goes)
print("SLICE0", devices[0].slice_name, flush=True)
error = None
for i in range(100000):
    try:
        l, p = step(p, x, y)
        print("STEP", i, float(l), flush=True)
    except jax.errors.JaxRuntimeError as e:
        error = e
        break
    time.sleep(0.05)
out = {"error": str(error), "type": type(error).__name__,
       "slice_down": elastic.is_error_due_to_slice_down(error)}
try:
    np.asarray(x)
except jax.errors.JaxRuntimeError as e:
    out["read_lost"] = str(e)
try:
    np.asarray(x_host)
except jax.errors.JaxRuntimeError as e:
    out["read_host_lost"] = str(e)
out["z_host"] = float(np.asarray(z_host).sum())
try:  # a mesh mixing the lost slice with the live one
    both = Mesh(np.array(devices[:8]), ("data",))
    np.asarray(jax.device_put(z, NamedSharding(both, P("data"))))
except jax.errors.JaxRuntimeError as e:
    out["mixed"] = str(e)
try:
    np.asarray(plus_one(cpu_ones[0]))
    out["colocated_lost"] = "no error"
except jax.errors.JaxRuntimeError as e:
    out["colocated_lost"] = str(e)
out["colocated_other"] = np.asarray(plus_one(cpu_ones[1])).tolist()
z = other(z)
out["other"] = np.asarray(z).tolist()
out["active"] = sorted(elastic.get_active_slice_indices())
print("RESULT", json.dumps(out), flush=True)
"""

# A host callback: refused by name, and the session goes on.
CALLBACK = PREAMBLE + """
try:  # a host callback (not served: jaxlib's proxy client refuses it itself)
    jax.jit(lambda a: jax.debug.print("a={a}", a=a) or a)(1.0).block_until_ready()
    print("CALLBACK", json.dumps({"error": None}))
except Exception as e:
    print("CALLBACK", json.dumps({"error": str(e), "type": type(e).__name__}))
try:  # a colocated Python function: its program is a cloudpickled custom call
    from jax.experimental import colocated_python
    cpus = colocated_python.colocated_cpu_devices(devices[:1])
    plus_one = colocated_python.colocated_python(lambda a: a + 1)
    np.asarray(plus_one(jax.device_put(np.arange(4.0), cpus[0])))
    print("COLOCATED", json.dumps({"error": None}))
except Exception as e:
    print("COLOCATED", json.dumps({"error": str(e), "type": type(e).__name__}))
z = other(z)  # the session goes on
print("OK", float(np.asarray(z).sum()), flush=True)
"""

# Arrays and programs across both slices (locally: 8 CPU devices): a hybrid mesh
# (slices x chips) as MaxText builds one, a program over it, the shards, assembling them
# back, copies to one slice and back, and a sum across slices.
ACROSS = """
import json, os
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
PROXY = os.environ.get("JAX_PLATFORMS") == "proxy"
if PROXY:
    import pathwaysutils
    pathwaysutils.initialize()
    from jax.experimental import mesh_utils
    devices = jax.devices()
    grid = mesh_utils.create_hybrid_device_mesh((1, 4), (2, 1), devices)
else:
    devices = jax.devices()
    grid = np.array(devices[:8]).reshape(2, 4)
mesh = Mesh(grid, ("slice", "chip"))
one = Mesh(np.array(devices[:4]), ("chip",))
rows = NamedSharding(mesh, P(("slice", "chip")))
x = jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100, rows)
y = jax.jit(lambda a: jnp.tanh(a) * 2 + 1, out_shardings=rows)(x)
total = float(jax.jit(lambda a: jnp.sum(a * a))(y))
parts = [np.asarray(s.data) for s in y.addressable_shards]
again = jax.make_array_from_single_device_arrays(y.shape, y.sharding,
                                                 [s.data for s in y.addressable_shards])
on0 = jax.device_put(y, NamedSharding(one, P("chip")))
back = jax.device_put(on0, NamedSharding(mesh, P("slice", "chip")))
w = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P(None, "chip")))
dp = jax.jit(lambda a, b: jnp.mean(a @ b))(y, w)
mem = jax.jit(lambda a: jnp.tanh(a) * 2 + 1, out_shardings=rows).lower(x).compile()
mem = mem.memory_analysis()
print("RESULT", json.dumps({
    "mem": [mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes],
    "slices": sorted({d.slice_index for d in mesh.devices.flat}) if PROXY else [0, 1],
    "y": np.asarray(y).tolist(), "total": total, "parts": [p.shape for p in parts],
    "again": np.asarray(again).tolist(), "on0": sorted(d.id for d in on0.devices()),
    "back": np.asarray(back).tolist(), "dp": float(dp)}), flush=True)
"""

# One slice's 4 chips (a session of one 2x2 slice): 10 train steps.
ONE_SLICE = """
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
if os.environ.get("JAX_PLATFORMS") == "proxy":
    if "PATHWAYS_RAY_PROXY_TOKEN" in os.environ:  # a guarded server: present its token
        from jax.extend import backend
        from jax.extend.backend import ifrt_proxy

        def client():
            options = ifrt_proxy.ClientConnectionOptions()
            options.connection_timeout_in_seconds = 120
            options.initialization_data = {
                "pathways_ray_token": os.environ["PATHWAYS_RAY_PROXY_TOKEN"].encode()}
            return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), options)

        backend.register_backend_factory("proxy", client, priority=-1)
    else:
        import pathwaysutils
        pathwaysutils.initialize()
devices = jax.devices()
mesh = Mesh(np.array(devices[:4]), ("data",))
rng = np.random.default_rng(1)
x = jax.device_put(rng.normal(size=(32, 8)).astype(np.float32), NamedSharding(mesh, P("data")))
y = jax.device_put(rng.normal(size=(32, 2)).astype(np.float32), NamedSharding(mesh, P("data")))
w = jax.device_put(rng.normal(size=(8, 2)).astype(np.float32) * 0.1, NamedSharding(mesh, P()))

@jax.jit
def step(w, x, y):
    l, g = jax.value_and_grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)
    return l, w - 0.2 * g
"""

TRAIN_ONE_SLICE = ONE_SLICE + """
losses = []
for i in range(10):
    l, w = step(w, x, y)
    losses.append(float(l))
print("RESULT", json.dumps({"n": len(devices), "losses": losses, "jax": jax.__version__}),
      flush=True)
"""

TOKEN_TRAIN = ONE_SLICE + """
losses = []
for i in range(5):
    l, w = step(w, x, y)
    losses.append(float(l))
print("RESULT", json.dumps({"n": len(devices), "losses": losses}), flush=True)
"""

# A program holding a 64 MiB constant (JAX >= 0.11 hoists constants over
# jax_embedded_constants_max_bytes into arguments; this keeps it in the program).
BIG_PROGRAM = """
import json, os
import numpy as np
import jax, jax.numpy as jnp
from jax._src.interpreters import mlir
if os.environ.get("JAX_PLATFORMS") == "proxy":
    import pathwaysutils
    pathwaysutils.initialize()
try:
    jax.config.update("jax_embedded_constants_max_bytes", 1 << 28)
except Exception:  # an older JAX embeds every constant
    pass
big = (np.arange(1 << 24) % 1000).astype(np.float32)
f = jax.jit(lambda s: (big * s).sum())
low = f.lower(jnp.float32(2.0))
size = len(mlir.module_to_bytecode(low.compiler_ir("stablehlo")))
print("RESULT", json.dumps({"program_bytes": size, "sum": float(f(jnp.float32(2.0)))}),
      flush=True)
"""


# pathwaysutils.elastic as its docs drive it: a data-parallel mesh over the active
# slices' chips (the global batch scaled by them), state kept on the host between
# steps, a ScaleUpSignalError at the first step boundary where a slice came back. It
# ends 5 steps after it is back on every slice, having run on fewer (or at MAX_STEPS).
# Locally (JAX_PLATFORMS=cpu, 8 devices) it replays ELASTIC_SCHEDULE, the active slice
# count of every step of a proxy run: the reference losses.
ELASTIC = """
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
PROXY = os.environ.get("JAX_PLATFORMS") == "proxy"
MAX_STEPS = int(os.environ.get("ELASTIC_STEPS", "3000"))
PAUSE_S = float(os.environ.get("ELASTIC_PAUSE_S", "0.05"))
BATCH = 48

def data(k, n):
    r = np.random.default_rng(1000 + k)
    x = r.normal(size=(BATCH, 16)).astype(np.float32)
    y = (np.tanh(x[:, :4]) * 0.5 + 0.1).astype(np.float32)
    return x[:n], y[:n]

def loss_fn(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

@jax.jit
def step(w, x, y):
    l, g = jax.value_and_grad(loss_fn)(w, x, y)
    return w - 0.5 * g, l

def one(w, k, devices, n):
    mesh = Mesh(np.array(devices), ("data",))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x, y = data(k, n)
    w, l = step(jax.device_put(w, rep), jax.device_put(x, rows), jax.device_put(y, rows))
    return np.asarray(w), float(l)

state = {"w": np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32) * 0.1}
losses, counts, attempts = [], [], [0]
if not PROXY:
    for k, c in enumerate(json.loads(os.environ["ELASTIC_SCHEDULE"])):
        state["w"], l = one(state["w"], k, jax.devices()[:4 * c],
                            BATCH * c // int(os.environ.get("ELASTIC_SLICES", "2")))
        losses.append(l)
    print("RESULT", json.dumps({"losses": losses}), flush=True)
    sys.exit(0)

import pathwaysutils
pathwaysutils.initialize()
from pathwaysutils.elastic import manager as elastic_manager
mgr = elastic_manager.Manager()
print("SLICE1", mgr.slice_to_devices[1][0].slice_name, flush=True)

def finished():
    back = len(counts) - 1 - next((i for i in range(len(counts) - 1, -1, -1)
                                   if counts[i] < mgr.total_slice_count), -1)
    return len(counts) >= MAX_STEPS or (min(counts, default=2) < mgr.total_slice_count
                                        and back >= 5)

@mgr.elastic_retry(minimum_slice_count=1, poll_interval=1)
def train():
    attempts[0] += 1
    active = sorted(mgr.active_slice_indices)
    devices = [d for i in active for d in mgr.slice_to_devices[i]]
    n = mgr.scale_by_active_slices(BATCH)
    print("ATTEMPT", attempts[0], len(active), time.time(), flush=True)
    while not finished():
        if mgr.available_inactive_slices:
            raise elastic_manager.ScaleUpSignalError("a slice came back")
        state["w"], l = one(state["w"], len(losses), devices, n)
        losses.append(l)
        counts.append(len(active))
        print("STEP", len(losses) - 1, len(active), time.time(), flush=True)
        time.sleep(PAUSE_S)

train()
print("RESULT", json.dumps({"losses": losses, "counts": counts,
                            "attempts": attempts[0]}), flush=True)
"""

# Steps of 2 host puts (NumPy arrays passed to a jit) + 1 program, queued without a sync
# until the end: jaxlib's client runs ahead of the server by thousands of requests.
BURST = """
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
import pathwaysutils
pathwaysutils.initialize()
n = int(sys.argv[1])

@jax.jit
def step(count, acc, x, y):
    return count + 1, acc + jnp.sum(x * y)

xs = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
count, acc = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
t0 = time.perf_counter()
for i in range(n):
    count, acc = step(count, acc, xs[i % 64], xs[(7 * i + 1) % 64])
queued_s = time.perf_counter() - t0
print("RESULT", json.dumps({"count": int(count), "acc": float(acc), "queued_s": queued_s,
                            "s": time.perf_counter() - t0}), flush=True)
"""

# Orbax with pathwaysutils' persistence (ENABLE_PATHWAYS_PERSISTENCE=1): the chips write
# and read the arrays themselves. A train state made on slice 0's chips is saved,
# restored onto slice 0 and onto slice 1; through the proxy, a write to a location the
# hosts cannot write and a read of an array not there fail by name, and the session goes
# on; so does a location outside what the server lets clients use. Locally (8 CPU
# devices) it is plain Orbax.
PERSIST = """
import datetime, json, os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
PROXY = os.environ.get("JAX_PLATFORMS") == "proxy"
if PROXY:
    import pathwaysutils
    pathwaysutils.initialize()
import orbax.checkpoint as ocp
path = sys.argv[1]
devices = jax.devices()
mesh0 = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
mesh1 = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "model"))

def made(shape, dtype, spec, seed):  # on the chips: none of its bytes from the client
    return jax.jit(lambda: jax.random.normal(jax.random.key(seed), shape).astype(dtype),
                   out_shardings=NamedSharding(mesh0, spec))()

state = {"w": made((1024, 1024), jnp.float32, P("data", "model"), 0),  # 4 MiB
         "h": made((256, 64), jnp.bfloat16, P(None, "data"), 1),
         "b": made((1024,), jnp.float32, P("model"), 2),
         "step": jax.jit(lambda: jnp.int32(7), out_shardings=NamedSharding(mesh0, P()))()}
with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, state)
    ckpt.wait_until_finished()

def like(mesh):
    return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec))
            for k, a in state.items()}

with ocp.StandardCheckpointer() as ckpt:
    same = ckpt.restore(path, like(mesh0))
    other = ckpt.restore(path, like(mesh1))
equal = jax.jit(lambda a, b: jnp.array_equal(a, b))
out = {"same": all(bool(equal(same[k], state[k])) for k in state),
       "other": all(bool(equal(jax.device_put(other[k], state[k].sharding), state[k]))
                    for k in state),
       "other_on": sorted({d.id for k in other for d in other[k].sharding.device_set}),
       "specs": {k: str(same[k].sharding.spec) for k in same},
       "sums": {k: float(jnp.sum(state[k].astype(jnp.float32))) for k in state},
       "files": sorted(os.listdir(path))}
if PROXY:
    from pathwaysutils.persistence import helper
    minute = datetime.timedelta(seconds=60)
    blocked = os.path.join(os.path.dirname(path), "a-file")
    open(blocked, "w").close()  # a directory there cannot be made
    for what, call in (
            ("outside", lambda: helper.write_arrays(
                "/etc/pathways-ray", ["w"], [state["w"]], minute).result(60)),
            ("unwritable", lambda: helper.write_arrays(
                os.path.join(blocked, "ckpt"), ["w"], [state["w"]], minute).result(60)),
            ("missing", lambda: helper.read_arrays(
                path, ["nothere"], [np.dtype("float32")], [(8,)],
                [NamedSharding(mesh0, P())], mesh0.devices, minute)[1].result(60))):
        try:
            call()
            out[what] = None
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
    out["after"] = float(jnp.sum(jax.jit(lambda a: a * 2)(state["b"])))  # the session goes on
print("RESULT", json.dumps(out), flush=True)
"""

# pathwaysutils' profile request (what its patched jax.profiler.start_trace sends,
# after checking that the directory is a gs:// bucket, which this machine has none of)
# and jax.profiler.stop_trace(): one trace of every chip of both slices.
PROFILE = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
import pathwaysutils
pathwaysutils.initialize()
from pathwaysutils import profiling
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
both = Mesh(np.array(jax.devices()[:8]), ("data",))
x = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(both, P("data")))
f = jax.jit(lambda a: jnp.tanh(a @ a.T).sum())
f(x).block_until_ready()
profiling._start_pathways_trace_from_profile_request(
    profiling._create_profile_request(sys.argv[1]))
profiling._original_start_trace(sys.argv[1])
for _ in range(3):
    y = f(x)
print("RESULT", json.dumps({"y": float(y)}), flush=True)
jax.profiler.stop_trace()
"""

# pathwaysutils.reshard between shardings and slices (IFRT's ReshardArrays, which local
# JAX's own client does not have: there it is jax.device_put, the reference), and back
# with pathwaysutils.experimental.reshard (a plugin program).
RESHARD = """
import json, os
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
PROXY = os.environ.get("JAX_PLATFORMS") == "proxy"
if PROXY:
    import pathwaysutils
    pathwaysutils.initialize()
from pathwaysutils import reshard
devices = jax.devices()
mesh0 = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
mesh1 = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "model"))
x = jax.jit(lambda: jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
            out_shardings=NamedSharding(mesh0, P("data", "model")))()
tree = {"x": x, "y": x * 2}
from pathwaysutils.experimental import reshard as sidechannel
targets = {"x": NamedSharding(mesh1, P("model", None)), "y": NamedSharding(mesh0, P(None, "data"))}
moved = (reshard.reshard if PROXY else jax.device_put)(tree, targets)
# The "sidechannel" reshard: a plugin program (reshardRequest) on Cloud Pathways.
again = (sidechannel.reshard if PROXY else jax.device_put)(moved, {"x": x.sharding,
                                                                   "y": x.sharding})
print("RESULT", json.dumps({
    "x": np.asarray(moved["x"]).tolist(), "y": np.asarray(moved["y"]).sum().item(),
    "x_on": sorted(d.id for d in moved["x"].sharding.device_set),
    "specs": [str(moved[k].sharding.spec) for k in ("x", "y")],
    "again": [np.asarray(again[k]).sum().item() for k in ("x", "y")],
    "again_on": sorted(d.id for d in again["x"].sharding.device_set)}), flush=True)
"""

# A profile started and never stopped: the client exits with it running.
PROFILE_LEFT = """
import json, sys
import jax
import pathwaysutils
pathwaysutils.initialize()
from pathwaysutils import profiling
profiling._start_pathways_trace_from_profile_request(
    profiling._create_profile_request(sys.argv[1]))
print("RESULT", json.dumps({"started": True}), flush=True)
"""

# Host memory (#47): puts into and out of a chip's host memory, a jit whose result is
# offloaded, offload inside a program and under remat (as MaxText's remat policies).
MEMORY = """
import json, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
mesh0 = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
mesh1 = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "model"))
dev0 = NamedSharding(mesh0, P("data", "model"))
host0 = dev0.with_memory_kind("pinned_host")
x_np = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
# A host buffer put straight into pinned host memory, read back, and moved to the chips.
xh = jax.device_put(x_np, host0)
back = np.asarray(xh)
xd = jax.device_put(xh, dev0)
xu = jax.device_put(xd, dev0.with_memory_kind("unpinned_host"))
# A jit whose result the program offloads to host memory, and one that reads it back.
y = jax.jit(lambda v: v * 2 + 1, out_shardings=host0)(xd)
z = jax.jit(lambda h: jax.device_put(h, dev0) * 3, in_shardings=host0, out_shardings=dev0)(y)
# Offload inside a program: the intermediate goes to pinned host and comes back.
def inner(v):
    h = jax.device_put(jnp.sin(v), host0)
    return jax.device_put(h, dev0) + v
w = jax.jit(inner)(xd)
# Activation offload under remat, as MaxText's remat_policy offloads: the gradient
# equals plain autodiff's.
from jax.ad_checkpoint import checkpoint_name
policy = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
    offload_src="device", offload_dst="pinned_host")
def layer(v, m):
    h = checkpoint_name(jnp.tanh(v @ m), "h")
    return jnp.sum(jnp.tanh(h @ m.T))
m = jax.device_put(np.linspace(-1, 1, 32 * 16, dtype=np.float32).reshape(32, 16),
                   NamedSharding(mesh0, P()))
g = jax.jit(jax.grad(jax.checkpoint(layer, policy=policy)))(xd / 2048, m)
# To the other slice's pinned host memory, and one device's.
far = jax.device_put(xh, NamedSharding(mesh1, P("model", None), memory_kind="pinned_host"))
one = jax.device_put(x_np[:4], jax.sharding.SingleDeviceSharding(devices[5],
                                                                memory_kind="pinned_host"))
print("RESULT", json.dumps({
    "memories": sorted(m.kind for m in devices[0].addressable_memories()),
    "default": devices[0].default_memory().kind,
    "kinds": [a.sharding.memory_kind for a in (xh, xd, xu, y, z, w, far, one)],
    "back": float(back.sum()), "xu": float(np.asarray(xu).sum()),
    "y": float(np.asarray(y).sum()), "z": float(np.asarray(z).sum()),
    "w": round(float(np.asarray(w).sum()), 2), "g": round(float(np.abs(np.asarray(g)).sum()), 3),
    "far": float(np.asarray(far).sum()), "far_on": sorted(d.id for d in far.sharding.device_set),
    "one": float(np.asarray(one).sum())}), flush=True)
"""

# jax.experimental.colocated_python: functions and an object on the TPU host of the
# devices given (each result says which host: its TPU_NAME); a function over both
# slices' hosts and one that raises fail by name, and the session goes on.
COLOCATED = PREAMBLE + """
from jax.experimental import colocated_python as cp
cpus = [cp.colocated_cpu_devices(mesh0.devices.flat), cp.colocated_cpu_devices(mesh1.devices.flat)]
where = [NamedSharding(Mesh(np.array(c), ("x",)), P("x")) for c in cpus]

@cp.colocated_python
def scale(x, scales):
    import os
    name = os.environ.get("TPU_NAME", "local").encode().ljust(32)
    host = jax.device_put(np.frombuffer(name, np.uint8), NamedSharding(x.sharding.mesh, P()))
    return {"z": x * 2 + jnp.sum(scales["a"]), "host": host}

@cp.colocated_python_class
class Counter:
    def __init__(self):
        self.seen = []
    def add(self, x):
        i = int(np.asarray(x)[0])  # the call's place in the order made
        if i == 1:
            import time
            time.sleep(1.0)  # (calls run at once would overtake this one)
        self.seen.append(i)
        return x * 0 + len(self.seen)

@cp.colocated_python_class
class Loader:  # a data loader: calls without arguments, each takes the next batch
    def __init__(self):
        self.n = 0
    def next(self):
        n = self.n
        if n == 1:
            import time
            time.sleep(1.0)  # a slow read (calls run at once would take the same batch)
        self.n = n + 1
        mesh = Mesh(np.array(jax.local_devices()[:4]), ("x",))
        return jax.device_put(np.full(4, n, np.float32), NamedSharding(mesh, P("x")))

@cp.colocated_python
def boom(x):
    raise ValueError("this shard is corrupt")

out, errors = {}, {}
for i in (0, 1):
    x = jax.device_put(np.arange(16, dtype=np.float32) * (i + 1), where[i])
    s = {"a": jax.device_put(np.ones(8, np.float32), where[i])}
    for call in range(2):  # the first call finds the output specs; the second has them
        r = scale(x, s)
        out[f"z{i}_{call}"] = np.asarray(r["z"]).tolist()
    out[f"host{i}"] = bytes(np.asarray(r["host"])).decode().strip()
    out[f"on{i}"] = sorted(d.id for d in r["z"].sharding.device_set)
    on_chips = jax.device_put(r["z"], NamedSharding(mesh0 if i == 0 else mesh1, P("data")))
    out[f"jit{i}"] = float(jax.jit(jnp.sum)(on_chips))
c = Counter()
x = jax.device_put(np.zeros(4, np.float32), where[1])
adds = [c.add(x + i) for i in range(5)]  # issued without a read between: run in order
out["counter"] = [np.asarray(a).tolist() for a in adds]
loader = Loader()
take = loader.next.specialize(devices=cpus[1])
batches = [take() for _ in range(4)]
out["batches"] = [np.asarray(b).tolist() for b in batches]
both = NamedSharding(Mesh(np.array(cpus[0] + cpus[1]), ("x",)), P("x"))
for name, run in (("both", lambda: scale(jax.device_put(np.ones(16, np.float32), both),
                                         {"a": jax.device_put(np.ones(8, np.float32), both)})),
                  ("boom", lambda: np.asarray(boom(jax.device_put(np.ones(4), where[0]))))):
    try:
        run()
        errors[name] = "no error"
    except Exception as e:
        errors[name] = str(e)
out["after"] = np.asarray(scale(x, {"a": x})["z"]).tolist()
print("RESULT", json.dumps({"out": out, "errors": errors}), flush=True)
"""

"""``pathways-ray doctor``'s facts: gathered on a host (``gather``), or on every TPU host of
a Ray cluster at once (``survey``, one task pinned to each node).

Ray is optional here: on a host without it (or before ``ray start``) the rest still
runs. ``doctor.diagnose`` judges what this module finds.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform as _platform
import re
import socket
import subprocess
import sys
import time

from pathways_ray.chips.doctor import OPEN_OK_VALUE, HostFacts
from pathways_ray.chips.worker_env import cpu_env

__all__ = ["chip_paths", "gather", "holders", "open_chip", "ray_node", "survey", "versions"]

_ENV = re.compile(r"^(TPU_|MEGASCALE_|JAX_PLATFORMS$|PATHWAYS_RAY_HOST$|PATHWAYS_RAY_PLATFORM$)")
_LOCKFILE = "/tmp/libtpu_lockfile"
_OPEN = f"""
import json, time
t0 = time.monotonic()
import jax, jax.numpy as jnp
devices = jax.devices()
x = jnp.ones((128, 128), jnp.float32)
value = float((x @ x).sum())
print(json.dumps({{"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                  "devices": len(devices), "value": value, "ok": value == {OPEN_OK_VALUE},
                  "seconds": time.monotonic() - t0}}))
"""


def versions() -> tuple[dict[str, str | None], dict[str, list[tuple[str, str]]]]:
    """Installed versions, and what jax and pathways-ray require of jaxlib, libtpu, jax."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    found = {n: version(n) for n in ("jax", "jaxlib", "ray", "pathways-ray")}
    found["libtpu"] = version("libtpu") or version("libtpu-nightly")
    found["python"] = _platform.python_version()
    wanted: dict[str, list[tuple[str, str]]] = {}
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging comes with pip and Ray; without it, no pins checked
        return found, wanted
    for who, extra in (("jax", "tpu"), ("pathways-ray", "")):
        for req in (metadata.requires(who) or []) if found.get(who) else []:
            r = Requirement(req)
            if r.name in ("jax", "jaxlib", "libtpu") and r.specifier and (
                    r.marker is None or r.marker.evaluate({"extra": extra})):
                wanted.setdefault(r.name, []).append((str(r.specifier), f"{who} {found[who]}"))
    return found, wanted


def chip_paths() -> list[str]:
    """This host's TPU chips as Ray counts them: /dev/accel<n>, else the VFIO groups of
    Google PCI devices (v5e, v6e and later)."""
    accel = sorted((p for p in glob.glob("/dev/accel*") if not os.path.isdir(p)),
                   key=lambda p: int(re.sub(r"\D", "", p) or 0))
    if accel:
        return accel
    groups = []
    for p in glob.glob("/dev/vfio/*"):
        name = os.path.basename(p)
        if name.isdigit() and _google_pci(int(name)):
            groups.append(p)
    return sorted(groups, key=lambda p: int(os.path.basename(p)))


def _google_pci(group: int) -> bool:
    root = f"/sys/kernel/iommu_groups/{group}/devices"
    with contextlib.suppress(OSError):
        for dev in os.listdir(root):
            with contextlib.suppress(OSError), open(f"{root}/{dev}/vendor") as f:
                if f.read().strip().lower() == "0x1ae0":
                    return True
    return False


def holders(paths: list[str]) -> list[tuple[int, str]]:
    """Processes (of those this user may inspect) with a chip or libtpu's lockfile open."""
    watched = {os.path.realpath(p) for p in [*paths, _LOCKFILE]}
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(_link(f"/proc/{pid}/fd/{fd}") in watched for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append((pid, cmd[:80]))
    return found


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def open_chip(platform: str, timeout_s: float) -> dict:
    """Open chip 0 in a subprocess, as a one-chip Ray actor would, and check a matmul."""
    env = dict(os.environ)
    if platform == "tpu":
        for k in [k for k in env if k.startswith(("MEGASCALE_", "TPU_PROCESS", "CLOUD_TPU"))]:
            del env[k]
        # what Ray gives a {"TPU": 1} actor; JAX_PLATFORMS=tpu so a failure is not
        # hidden by a fall back to the CPU
        env.update(TPU_VISIBLE_CHIPS="0", TPU_CHIPS_PER_HOST_BOUNDS="1,1,1",
                   TPU_HOST_BOUNDS="1,1,1", JAX_PLATFORMS="tpu")
    else:
        env.update(cpu_env(env))
    try:
        out = subprocess.run([sys.executable, "-c", _OPEN], env=env, capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer within {timeout_s:g} s (--open-timeout)"}
    if out.returncode == 0:
        with contextlib.suppress(ValueError, IndexError):
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if not result["ok"]:
                result["error"] = f"the matmul gave {result['value']}, not {OPEN_OK_VALUE}"
            return result
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    return {"ok": False, "error": (errors or lines or [f"exit code {out.returncode}"])[-1]}


def gather(*, open_chips: bool = True, open_timeout_s: float = 90.0,
           chips_held: bool = False) -> HostFacts:
    """This host's facts, less Ray's view of it (``ray_node`` adds that)."""
    found, wanted = versions()
    paths = chip_paths()
    facts = HostFacts(host=socket.gethostname(), versions=found, wanted=wanted,
                      chip_paths=paths, emulated="PATHWAYS_RAY_HOST" in os.environ,
                      env={k: v for k, v in os.environ.items() if _ENV.match(k)})
    if facts.emulated:
        facts.host = os.environ["PATHWAYS_RAY_HOST"]
    facts.holders = holders(paths) if paths else []
    if not open_chips:
        facts.open_note = "not opened (--no-open)"
    elif chips_held:
        facts.open_note = "not opened: chip workers of a reserved slice hold the chips"
    elif facts.holders and all(cmd.startswith("ray::") for _, cmd in facts.holders):
        facts.open_note = (f"not opened: Ray actors hold the chips (pids "
                           f"{', '.join(str(pid) for pid, _ in facts.holders)})")
    elif facts.holders:
        facts.opened = {"ok": False, "error": "held"}
    else:
        facts.opened = open_chip(facts.platform, open_timeout_s)
    return facts


def ray_node(facts: HostFacts, nodes: list[dict], available: dict, address: str,
             node_id: str | None = None) -> None:
    """Fill in Ray's view of the host: the node ``node_id``, else the one whose TPU labels
    name this host's slice and worker."""
    from pathways_ray.chips.doctor import expected_labels

    want = expected_labels(facts.env)
    keys = ("ray.io/tpu-slice-name", "ray.io/tpu-worker-id")
    match = [n for n in nodes if n["NodeID"] == node_id] if node_id else [
        n for n in nodes if n["Alive"] and all(k in want and n.get("Labels", {}).get(k) == want[k]
                                               for k in keys)]
    if not match and facts.platform == "cpu" and not facts.emulated:
        facts.ray_note = (f"this machine is not a TPU host of the Ray cluster at {address}: "
                          f"`pathways-ray doctor --cluster` checks each of them from here")
        return
    if not match:
        facts.ray_note = (f"no node of the Ray cluster at {address} is labelled as this "
                          f"host ({facts.key}): Ray does not run on it yet; start it with "
                          f"`ray start --address=...`")
        return
    n = match[0]
    tpu = n["Resources"].get("TPU", 0)
    facts.ray = {"node_id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"],
                 "labels": n.get("Labels", {}), "address": address,
                 "available_tpu": available.get(n["NodeID"], {}).get("TPU", 0) if n["Alive"]
                 else tpu}


def survey(*, open_chips: bool = True, open_timeout_s: float = 90.0,
           timeout_s: float = 120.0) -> list[HostFacts]:
    """Every TPU host of the connected Ray cluster, examined on the host itself by a task
    pinned to its node (``num_cpus=0``: a busy host still answers); a host whose task
    is not back within ``timeout_s`` is reported so, the others are not held up."""
    import ray
    from ray._private.state import available_resources_per_node
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    address = ray.get_runtime_context().gcs_address
    nodes = [n for n in ray.nodes() if n.get("Resources", {}).get("TPU")
             or n.get("Labels", {}).get("ray.io/tpu-slice-name")]
    available = available_resources_per_node()
    probe = ray.remote(num_cpus=0, max_retries=0)(gather)
    refs, reports = {}, {}
    for n in nodes:
        nid = n["NodeID"]
        if not n["Alive"]:
            labels = n.get("Labels", {})
            env = {"TPU_NAME": labels.get("ray.io/tpu-slice-name", ""),
                   "TPU_WORKER_ID": labels.get("ray.io/tpu-worker-id", "")}
            reports[nid] = HostFacts(host=f"node {nid[:8]}", versions={}, env=env)
            ray_node(reports[nid], nodes, available, address, node_id=nid)
            continue
        held = available.get(nid, {}).get("TPU", 0) < n["Resources"].get("TPU", 0)
        refs[nid] = probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            nid, soft=False)).remote(open_chips=open_chips, open_timeout_s=open_timeout_s,
                                     chips_held=held)
    deadline = time.monotonic() + timeout_s
    pending = list(refs.values())
    while pending and (left := deadline - time.monotonic()) > 0:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
    for nid, ref in refs.items():
        n = next(x for x in nodes if x["NodeID"] == nid)
        if ref in pending:
            ray.cancel(ref, force=True)
            labels = n.get("Labels", {})
            name = f"{labels.get('ray.io/tpu-slice-name', '?')}/" \
                   f"{labels.get('ray.io/tpu-worker-id', '?')}"
            reports[nid] = HostFacts(host=name, versions={},
                                     unreachable=f"host {name} (node {nid[:8]}) did not "
                                                 f"answer within {timeout_s:g} s (--timeout)")
            continue
        try:
            reports[nid] = ray.get(ref, timeout=5)
        except Exception as e:  # noqa: BLE001 - a host that died mid-probe: say so
            reports[nid] = HostFacts(host=f"node {nid[:8]}", versions={},
                                     unreachable=f"the probe on node {nid[:8]} failed: "
                                                 f"{type(e).__name__}: {str(e)[:200]}")
            continue
        ray_node(reports[nid], nodes, available, address, node_id=nid)
    return sorted(reports.values(), key=lambda f: f.key)

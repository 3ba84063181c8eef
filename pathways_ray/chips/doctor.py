"""``pathways-ray doctor``'s judgement: what a TPU host's facts mean, one line per finding,
with the fix for each problem.

Pure: the facts come in (``HostFacts``, gathered by ``doctor_probe``), findings go out
(``diagnose``), so every rule is tested in milliseconds on made-up hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from pathways_ray.chips.worker_env import cpu_env, tpu_multiprocess_env
from pathways_ray.clusters.topology import Topology

__all__ = ["OPEN_OK_VALUE", "Check", "HostFacts", "chip_worker_envs", "diagnose",
           "expected_labels", "problems"]

# The open probe's 128x128 ones-matrix product, summed: exact in bf16 and f32.
OPEN_OK_VALUE = 128.0 ** 3


@dataclass(frozen=True)
class Check:
    """One finding: ``level`` is "ok", "info" (worth knowing, nothing wrong) or
    "problem" (with ``fix``, what to do about it)."""

    area: str
    level: str
    what: str
    fix: str = ""


@dataclass
class HostFacts:
    """What one host looks like, as gathered on it (and, for ``ray``, from the cluster)."""

    host: str  # the host name
    versions: dict[str, str | None]  # python, jax, jaxlib, libtpu, ray, pathways-ray
    # package -> (its installed version must satisfy, who asks): jax's pins of jaxlib
    # and libtpu, pathways-ray's of jax
    wanted: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    chip_paths: list[str] = field(default_factory=list)  # /dev/accel*, /dev/vfio/<n>
    emulated: bool = False  # a host of the emulated fleet (PATHWAYS_RAY_HOST is set)
    env: dict[str, str] = field(default_factory=dict)  # TPU_*, JAX_PLATFORMS, MEGASCALE_*
    holders: list[tuple[int, str]] = field(default_factory=list)  # (pid, cmd) holding chips
    ray: dict | None = None  # node_id, alive, resources, labels, available_tpu, address
    ray_note: str = ""  # why ``ray`` is None
    opened: dict | None = None  # the open probe: ok, platform, device_kind, seconds, error
    open_note: str = ""  # why ``opened`` is None
    unreachable: str = ""  # why nothing could be gathered on the host (its probe failed)

    @property
    def platform(self) -> str:
        return "tpu" if self.chip_paths else "cpu"

    @property
    def key(self) -> str:
        """``slice/worker`` where the env names them, else the host name."""
        if self.env.get("TPU_NAME") and self.env.get("TPU_WORKER_ID") is not None:
            return f"{self.env['TPU_NAME']}/{self.env['TPU_WORKER_ID']}"
        return self.host

    def to_dict(self) -> dict:
        return {**asdict(self), "platform": self.platform, "key": self.key}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def problems(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.level == "problem"]


def _topology(facts: HostFacts) -> tuple[Topology | None, str]:
    """The slice's topology from the host's env, or None and why not."""
    env = facts.env
    accel, shape = env.get("TPU_ACCELERATOR_TYPE"), env.get("TPU_TOPOLOGY")
    if not accel:
        return None, "TPU_ACCELERATOR_TYPE is not set"
    chips = _chips_here(facts)
    try:
        return Topology.parse(accel, shape or None, chips_per_host=chips), ""
    except ValueError as e:
        if chips is not None:
            return None, (f"this host has {_n(chips, 'chip')}, but TPU_ACCELERATOR_TYPE={accel} "
                          f"TPU_TOPOLOGY={shape} says: {e}")
        return None, str(e)


def _chips_here(facts: HostFacts) -> int | None:
    if facts.chip_paths:
        return len(facts.chip_paths)
    if facts.ray and facts.ray.get("resources", {}).get("TPU"):
        return int(facts.ray["resources"]["TPU"])
    return None


def chip_worker_envs(facts: HostFacts) -> list[dict[str, str]]:
    """The env each chip worker of this host would get when its slice's JAX world starts
    (ports are picked then: shown as ``PORT``); empty where the slice is unknown."""
    topo, _ = _topology(facts)
    worker = facts.env.get("TPU_WORKER_ID", "")
    if topo is None or not worker.isdigit() or int(worker) >= topo.num_hosts:
        return []  # diagnose names what is wrong
    worker = int(worker)
    hosts = facts.env.get("TPU_WORKER_HOSTNAMES", "").split(",")
    if len(hosts) != topo.num_hosts:
        hosts = [f"host{i}" for i in range(topo.num_hosts)]
    per_host = topo.chips_per_host
    addresses = [f"{hosts[r // per_host]}:PORT" for r in range(topo.chips)]
    rows = []
    for chip in range(per_host):
        rank = worker * per_host + chip
        if facts.platform == "tpu":
            env = tpu_multiprocess_env(rank=rank, chip=chip, process_addresses=addresses,
                                       slice_shape=topo.shape)
            env = {k: v for k, v in env.items() if v}
        else:
            env = cpu_env({})
        rows.append({"chip": str(chip), "rank": str(rank), **env})
    return rows


def diagnose(facts: HostFacts) -> list[Check]:
    """Every finding about one host, in the order a person would check them."""
    if facts.unreachable:
        return [Check("host", "problem", facts.unreachable,
                      "see `pathways-ray status`: a frozen or overloaded host answers late; "
                      "a lost one is replaced by KubeRay (or `pathways-ray chaos "
                      "restore-host` on the emulated fleet)")]
    if facts.ray is not None and not facts.ray.get("alive", True):
        return _ray(facts)  # nothing else of it can be known
    return [*_versions(facts), *_chips(facts), *_host_env(facts), *_ray(facts),
            *_opened(facts)]


def _satisfies(version: str, spec: str) -> bool | None:
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:  # packaging comes with pip and Ray; without it, say nothing
        return None
    return Version(version) in SpecifierSet(spec)


def _versions(facts: HostFacts) -> list[Check]:
    v, out = facts.versions, []
    tpu = facts.platform == "tpu"
    jax_pin = f"=={v['jax']}" if v.get("jax") else ""
    install = f"pip install -U 'jax[tpu]{jax_pin}'" if tpu else "pip install -U jax jaxlib"
    if not v.get("jax"):
        return [Check("versions", "problem", "JAX is not installed", install)]
    if tpu and not v.get("libtpu"):
        out.append(Check("versions", "problem",
                         f"libtpu is not installed: JAX {v['jax']} cannot open the chips",
                         install))
    for pkg, asks in sorted(facts.wanted.items()):
        have = v.get(pkg)
        for spec, who in asks:
            if have and _satisfies(have, spec) is False:
                fix = (f"pip install 'jax=={have}' 'jaxlib=={have}'" if pkg == "jax"
                       else install)
                out.append(Check("versions", "problem",
                                 f"{pkg} {have} is installed; {who} needs {pkg}{spec}", fix))
    if not out:
        names = ("jax", "jaxlib", "libtpu", "ray", "pathways-ray", "python")
        out.append(Check("versions", "ok", ", ".join(f"{n} {v[n]}" for n in names
                                                      if v.get(n))))
    return out


def _chips(facts: HostFacts) -> list[Check]:
    paths = facts.chip_paths
    if paths:
        shown = ", ".join(paths[:4]) + (f", ... ({len(paths)})" if len(paths) > 4 else "")
        ids = f"ids 0-{len(paths) - 1}" if len(paths) > 1 else "id 0"
        return [Check("chips", "ok", f"{_n(len(paths), 'TPU chip')}, {ids}: {shown}")]
    if facts.emulated:
        n = _chips_here(facts)
        return [Check("chips", "ok", f"an emulated TPU host: {n or '?'} chips, one XLA CPU "
                                     f"device each")]
    if facts.env.get("TPU_ACCELERATOR_TYPE"):
        return [Check("chips", "problem",
                      f"TPU_ACCELERATOR_TYPE={facts.env['TPU_ACCELERATOR_TYPE']} is set but "
                      f"this host shows no TPU chip (/dev/accel*, /dev/vfio/<n>)",
                      "on GKE ask for the chips in the pod (resources.limits "
                      "google.com/tpu, as kuberay/ does); in a container on a TPU VM run it "
                      "--privileged or pass the devices (--device /dev/vfio/...)")]
    return [Check("chips", "info", "no TPU chips on this host: `pathways-ray up` emulates "
                                   "a fleet of them here")]


def _host_env(facts: HostFacts) -> list[Check]:
    env, out = facts.env, []
    if facts.platform == "cpu" and not facts.emulated:
        return []
    platforms = env.get("JAX_PLATFORMS", "")
    if facts.platform == "tpu" and platforms and "tpu" not in platforms.split(","):
        out.append(Check("host env", "problem",
                         f"JAX_PLATFORMS={platforms} on a TPU host: chip workers would not "
                         f"open the chips",
                         "unset JAX_PLATFORMS before `ray start` (JAX_PLATFORMS=proxy is for "
                         "a client of `pathways-ray proxy`, not for TPU hosts)"))
    missing = [k for k in ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY")
               if not env.get(k)]
    if missing:
        out.append(Check("host env", "problem",
                         f"{', '.join(missing)} not set: chip workers rank themselves by "
                         f"TPU_WORKER_ID and name their slice by TPU_NAME",
                         "on GKE the TPU webhook sets them (KubeRay's TPU pods); on a TPU VM "
                         "export them before `ray start` (TPU_WORKER_ID is the host's index "
                         "in the slice, from 0)"))
    if not env.get("TPU_ACCELERATOR_TYPE"):
        return out
    topo, why = _topology(facts)
    if topo is None:
        return [*out, Check("host env", "problem", why,
                            "set TPU_ACCELERATOR_TYPE (a pod type, e.g. v6e-8) and "
                            "TPU_TOPOLOGY (the slice's shape, e.g. 2x4) to the slice's own; "
                            "a container given part of a host's chips is a smaller slice "
                            "(on GKE ask for every chip of the host: google.com/tpu)")]
    if missing:
        return out
    worker = env["TPU_WORKER_ID"]
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if not worker.isdigit() or not int(worker) < topo.num_hosts:
        out.append(Check("host env", "problem",
                         f"TPU_WORKER_ID={worker} is not a TPU worker of {topo.describe()} "
                         f"(0..{topo.num_hosts - 1})", "set it to this host's index in the slice"))
    if hosts and len(hosts) != topo.num_hosts:
        out.append(Check("host env", "problem",
                         f"TPU_WORKER_HOSTNAMES names {len(hosts)} hosts; {topo.describe()} "
                         f"has {topo.num_hosts}", "list every host of the slice, in worker "
                                                  "order, comma-separated"))
    if not out:
        out.append(Check("host env", "ok",
                         f"slice {env['TPU_NAME']}, TPU worker {worker} of {topo.num_hosts}, "
                         f"{topo.describe()}, {_n(topo.chips_per_host, 'chip')} per host"))
    return out


def expected_labels(env: Mapping[str, str]) -> dict[str, str]:
    """The ``ray.io/tpu-*`` labels Ray derives from a TPU host's env."""
    want = {"ray.io/tpu-slice-name": env.get("TPU_NAME"),
            "ray.io/tpu-worker-id": env.get("TPU_WORKER_ID"),
            "ray.io/tpu-topology": env.get("TPU_TOPOLOGY"),
            "ray.io/tpu-pod-type": env.get("TPU_ACCELERATOR_TYPE")}
    return {k: v for k, v in want.items() if v}


def _ray(facts: HostFacts) -> list[Check]:
    node = facts.ray
    if node is None:
        return [Check("ray", "info", facts.ray_note or "not connected to a Ray cluster")]
    short = node["node_id"][:8]
    if not node.get("alive", True):
        return [Check("ray", "problem", f"Ray marks this host's node {short} dead",
                      "restart Ray on it (`ray start --address=...`); slices grow back onto "
                      "it, and KubeRay replaces a lost pod by itself")]
    out = []
    tpu = int(node.get("resources", {}).get("TPU", 0))
    chips = len(facts.chip_paths) if facts.chip_paths else None
    if chips is not None and tpu != chips:
        out.append(Check("ray", "problem",
                         f"Ray's TPU resource on node {short} is {tpu}; this host has {chips} "
                         f"chips", f"start Ray after the chips are visible, or with "
                                   f"--resources='{{\"TPU\": {chips}}}'"))
    labels = node.get("labels", {})
    for key, want in expected_labels(facts.env).items():
        if labels.get(key) != want:
            out.append(Check("ray", "problem",
                             f"Ray's label {key} is {labels.get(key)!r}; this host's env says "
                             f"{want!r}", "Ray reads the TPU_* env when it starts: restart Ray "
                                          "on this host with the env set (`ray stop`, then "
                                          "`ray start ...`)"))
    topo, _ = _topology(facts)
    if facts.env.get("TPU_WORKER_ID") == "0" and topo is not None:
        if topo.head_resource not in node.get("resources", {}):
            out.append(Check("ray", "problem", f"TPU worker 0 has no {topo.head_resource} "
                                               f"resource: slice placement groups cannot "
                                               f"find this slice",
                             "restart Ray on this host with the TPU_* env set"))
    if not out:
        held = tpu - int(node.get("available_tpu", tpu))
        note = f" ({held} held by actors: a reserved slice)" if held else ""
        out.append(Check("ray", "ok", f"node {short} at {node.get('address', '?')}: TPU "
                                      f"{tpu}{note}, labels match the env"))
    return out


def _opened(facts: HostFacts) -> list[Check]:
    o = facts.opened
    if o is None:
        return [Check("open", "info", facts.open_note)] if facts.open_note else []
    if o.get("ok"):
        return [Check("open", "ok", f"opened chip 0 in {o['seconds']:.1f} s: "
                                    f"{o['device_kind']} ({o['platform']}), a matmul checked")]
    error = o.get("error", "")
    held = ", ".join(f"pid {pid} ({cmd})" for pid, cmd in facts.holders)
    if held or any(s in error for s in ("already in use", "libtpu_lockfile",
                                         "Device or resource busy")):
        return [Check("open", "problem", f"chip 0 did not open: another process holds the "
                                         f"chips{': ' + held if held else ''}",
                      "one process at a time opens a chip: stop it, or run doctor while no "
                      "slice is reserved (`pathways-ray status`)")]
    if "No module named 'jax'" in error:
        return [Check("open", "problem", "chip 0 did not open: JAX is not installed",
                      "pip install -U 'jax[tpu]'")]
    if "Unable to initialize backend" in error or "libtpu" in error.lower():
        return [Check("open", "problem", f"chip 0 did not open: {error}",
                      "install JAX's TPU build: pip install -U 'jax[tpu]' (its libtpu pin)")]
    return [Check("open", "problem", f"chip 0 did not open: {error}",
                  "run `TPU_VISIBLE_CHIPS=0 python -c 'import jax; print(jax.devices())'` to "
                  "see JAX's whole error")]

"""``LocalFleet``: a real multi-node Ray cluster on this machine emulating TPU slices.

One raylet per emulated TPU host. Each host's raylet gets the env vars GKE's
TPU webhook sets on a TPU pod (``TPU_NAME``, ``TPU_WORKER_ID``,
``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``, …) and ``TPU: <chips>``; Ray's own
TPU detection then derives the ``TPU-<pod>-head`` and slice-name resources and
the ``ray.io/tpu-*`` labels exactly as on a real host, so the reservation code
that runs here is the code that runs on TPUs. The runtime never imports this
module: it is the emulator, for tests, demos, benchmarks and the CLI.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence

from pathways_ray import _auth, _procs
from pathways_ray._procs import free_ports
from pathways_ray.clusters.fleet import Fleet, _ensure_connected
from pathways_ray.clusters.host_plan import (
    HEAD_SYSTEM_CONFIG,
    NODE_ENV,
    HostPlan,
    plan_hosts,
    ray_start_command,
)
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import base_dir
from pathways_ray.emulation.chaos import HostFaults
from pathways_ray.emulation.fleet_state import (
    FleetState,
    running_fleets,
    stop_fleet_processes,
    stop_local_fleet,
)
from pathways_ray.errors import FleetError

__all__ = ["HostPlan", "LocalFleet", "cluster_or_local", "plan_hosts", "running_fleets",
           "stop_local_fleet"]

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,19}$")

ProgressFn = Callable[[str, int, int], None]


def cluster_or_local(address: str | None = None, *, log_to_driver: bool = True,
                     **local_fleet_kwargs) -> Fleet | LocalFleet:
    """Where a script runs: the cluster at ``address`` or ``$RAY_ADDRESS`` (set for the
    entrypoint of ``ray job submit``), else a new ``LocalFleet(**local_fleet_kwargs)``.

    Use it as a context manager: an attached cluster keeps running afterwards, a
    local fleet is stopped. ``log_to_driver=False`` keeps the workers' logs out of
    this process's output (they stay in the Ray session's log files).
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        return Fleet.attach(address, log_to_driver=log_to_driver)
    return LocalFleet(log_to_driver=log_to_driver, **local_fleet_kwargs)


class LocalFleet(HostFaults, Fleet):
    """A real multi-node Ray cluster on this machine emulating TPU slices.

    Example::

        with LocalFleet(num_slices=2, accelerator="v6e", topology="2x4",
                        chips_per_host=4) as fleet:
            ...  # two v6e-8 slices, each 2 hosts x 4 chips

    ``slices`` takes a list of ``Topology`` (or ``"v5p-2x2x2"``-style strings)
    for fleets that mix generations and shapes. The head node carries no TPU,
    like a KubeRay head pod. Processes are stopped on ``shutdown()``, on leaving
    the ``with`` block, and at interpreter exit; ``detach=True`` leaves them
    running for ``pathways-ray down``.
    """

    def __init__(
        self,
        slices: Sequence[Topology | str] | None = None,
        *,
        num_slices: int = 2,
        accelerator: str = "v6e",
        topology: str = "2x4",
        chips_per_host: int | None = None,
        name: str = "local",
        cpus_per_host: int | None = None,
        head_cpus: int = 2,
        object_store_mb: int = 256,
        dashboard: bool = False,
        start_timeout_s: float = 120.0,
        connect: bool = True,
        detach: bool = False,
        log_to_driver: bool = True,
    ):
        if slices is None:
            if not isinstance(num_slices, int) or num_slices < 1:
                raise ValueError(
                    f"num_slices={num_slices!r} must be a positive integer (slices to emulate)"
                )
            topo = Topology.parse(accelerator, topology, chips_per_host=chips_per_host)
            slices = [topo] * num_slices
        if not slices:
            raise ValueError("slices=[] is empty; pass at least one slice to emulate")
        self.topologies = [Topology.of(s) for s in slices]
        if not _NAME_RE.match(name or ""):
            raise ValueError(
                f"name={name!r} must be 1-20 characters of a-z, 0-9 and '-', starting "
                f"with a letter (it becomes part of socket paths)"
            )
        if object_store_mb < 80:
            raise ValueError(f"object_store_mb={object_store_mb} is below Ray's minimum of 80")
        self.name = name
        self.hosts = plan_hosts(self.topologies, cpus_per_host)
        self.head_cpus = head_cpus
        self.object_store_mb = object_store_mb
        self.dashboard = dashboard
        self.start_timeout_s = start_timeout_s
        self.connect = connect
        self.detach = detach
        self.log_to_driver = log_to_driver
        self.dir = base_dir() / name
        self.token_path = self.dir / "auth_token"
        self.fleet_id = ""
        self.address = ""
        self.dashboard_url: str | None = None
        self.node_ids: dict[str, str] = {}  # host key -> Ray node id
        self._state: FleetState | None = None
        self._ports_used: set[int] = set()
        self._port_pool: list[int] = []
        self._started = False
        self._auth_before: dict[str, str | None] | None = None  # what use_token replaced

    @classmethod
    def running(cls, name: str | None = None) -> LocalFleet:
        """A handle on a fleet another process started (``pathways-ray up``), for fault
        injection (``remove_host``, ``freeze_host``, ``restore_host``). It does not own
        the fleet: its ``shutdown()`` leaves it running (``pathways-ray down`` stops it).
        """
        fleets = running_fleets()
        if name is not None:
            fleets = [f for f in fleets if f.name == name]
        if not fleets:
            raise FleetError(f"no local fleet{f' named {name!r}' if name else ''} is running; "
                             f"start one with `pathways-ray up`")
        if len(fleets) > 1:
            raise FleetError("several local fleets are running ("
                             + ", ".join(f.name for f in fleets) + "); pick one by name")
        state = fleets[0]
        fleet = cls([Topology.of(s["topology"], chips_per_host=s["chips_per_host"])
                     for s in state.slices], name=state.name, connect=False, detach=True)
        fleet.fleet_id, fleet.address = state.fleet_id, state.address
        fleet.dashboard_url, fleet._state = state.dashboard_url, state
        return fleet

    # ---- lifecycle --------------------------------------------------------
    def start(self, progress: ProgressFn | None = None) -> LocalFleet:
        """Start the head and every host; returns once all hosts joined."""
        if self._started:
            return self
        state_file = self.dir / "fleet.json"
        if state_file.exists():
            old = FleetState.read(state_file)
            if _procs.find(old.fleet_id, old.all_sessions()):
                raise FleetError(
                    f"a fleet named {self.name!r} is already running at {old.address}; "
                    f"stop it with `pathways-ray down --name {self.name}` or pick another name="
                )
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        _auth.write_token(self.token_path)
        self.fleet_id = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self._state = FleetState(
            name=self.name,
            fleet_id=self.fleet_id,
            address="",
            token_path=str(self.token_path),
            dashboard_url=None,
            slices=[
                {"name": n, "topology": str(t), "chips_per_host": t.chips_per_host}
                for n, t in self.slice_names().items()
            ],
            created=time.time(),
        )
        self._state.write(state_file)
        self._started = True
        if not self.detach:
            atexit.register(self.shutdown)
        total = len(self.hosts) + 1
        progress = progress or (lambda msg, done, total: logger.info("%s (%d/%d)", msg, done,
                                                                      total))
        t0 = time.monotonic()
        try:
            # Every port this start needs, reserved together (see free_ports).
            self._port_pool = self._take_ports(2 + self.dashboard + 4 * (1 + len(self.hosts)))
            port = self._port_pool.pop()
            head_args = [
                "--head", f"--port={port}", f"--num-cpus={self.head_cpus}",
                f"--system-config={json.dumps(HEAD_SYSTEM_CONFIG)}",
                f"--ray-client-server-port={self._port_pool.pop()}",
                f"--include-dashboard={'true' if self.dashboard else 'false'}",
            ]
            if self.dashboard:
                dash_port = self._port_pool.pop()
                head_args += [f"--dashboard-port={dash_port}", "--dashboard-host=127.0.0.1"]
            progress("starting head node", 0, total)
            head = self._spawn("head", "head", head_args, {})
            self._wait_started([("head", head)], t0)
            self.address = f"{self._node_ip()}:{port}"
            if self.dashboard:
                self.dashboard_url = f"http://127.0.0.1:{dash_port}"
            self._state.address, self._state.dashboard_url = self.address, self.dashboard_url
            self._state.write(state_file)
            progress("head node up", 1, total)
            procs = []
            for i, plan in enumerate(self.hosts):
                env = {**plan.env, _procs.HOST_ENV: plan.key}
                procs.append((plan.key, self._spawn(f"host{i}", plan.key,
                                                    plan.start_args(self.address), env)))
            self._wait_started(procs, t0, progress=progress, offset=1, total=total)
            if self.connect:
                self._auth_before = _auth.use_token(self.token_path)
                _ensure_connected(self.address, log_to_driver=self.log_to_driver)
                self._wait_registered(t0)
        except BaseException:
            self.shutdown()
            raise
        logger.info("fleet %s up in %.1fs at %s", self.name, time.monotonic() - t0, self.address)
        return self

    def shutdown(self) -> None:
        """Disconnect and stop every process of this fleet; remove its directory."""
        if not self._started:
            return
        self._started = False
        try:
            import ray

            if ray.is_initialized() and self.address and (
                ray.get_runtime_context().gcs_address == self.address
            ):
                ray.shutdown()
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("ray.shutdown() failed; stopping the processes anyway")
        stop_fleet_processes(self._state)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._auth_before is not None:  # a later process must not use a removed token
            _auth.restore(self._auth_before, self.token_path)
            self._auth_before = None
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- facts --------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """What another process needs to join: ``RAY_ADDRESS`` and the auth settings."""
        return {"RAY_ADDRESS": self.address, **_auth.auth_env(self.token_path)}

    def slice_names(self) -> dict[str, Topology]:
        """Slice name -> topology, in the order they were declared."""
        out: dict[str, Topology] = {}
        for plan in self.hosts:
            out.setdefault(plan.slice_name, plan.topology)
        return out

    # ---- internals ------------------------------------------------------------------
    def _plan(self, slice_name: str, worker_id: int) -> HostPlan:
        for plan in self.hosts:
            if plan.slice_name == slice_name and plan.worker_id == worker_id:
                return plan
        raise ValueError(
            f"no host slice_name={slice_name!r} worker_id={worker_id!r} in fleet "
            f"{self.name!r}; its hosts are: " + ", ".join(p.key for p in self.hosts)
        )

    def _host_selector(self, key: str) -> dict:
        """``_procs.find``'s arguments for host ``key`` of this fleet (and no other's)."""
        if not self.fleet_id:
            raise FleetError(f"fleet {self.name!r} is not running (start() it, or take a "
                             f"handle with LocalFleet.running({self.name!r}))")
        return {"fleet_id": self.fleet_id, "sessions": self._host_sessions(key), "host": key}

    def _take_ports(self, n: int) -> list[int]:
        ports = free_ports(n, exclude=self._ports_used)
        self._ports_used.update(ports)
        return ports

    def _host_sessions(self, key: str) -> list[int]:
        return list(self._state.sessions.get(key, [])) if self._state else []

    def _spawn(self, tag: str, key: str, args: list[str],
               extra_env: dict[str, str]) -> subprocess.Popen:
        """Run `ray start` as the leader of a new session, recorded under host ``key``."""
        temp_dir = self.dir / tag
        temp_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **NODE_ENV,
            **os.environ,
            **_auth.auth_env(self.token_path),
            _procs.FLEET_ENV: self.fleet_id,
            "RAY_USAGE_STATS_ENABLED": "0",
            **extra_env,
        }
        env.pop(_auth.TOKEN, None)
        env.pop("RAY_ADDRESS", None)
        for var in ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
                    "TPU_WORKER_HOSTNAMES"):
            if var not in extra_env:
                env.pop(var, None)  # the head is not a TPU host
        ports = [self._port_pool.pop() for _ in range(4)]
        cmd = ray_start_command(temp_dir, self.object_store_mb, ports, args)
        log_path = temp_dir / "ray-start.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        proc.log_path = log_path  # type: ignore[attr-defined]
        self._state.sessions.setdefault(key, []).append(proc.pid)
        self._state.write(self.dir / "fleet.json")
        return proc

    def _wait_started(self, procs, t0: float, *, progress: ProgressFn | None = None,
                      offset: int = 0, total: int = 0, timeout_s: float | None = None) -> None:
        """Wait for each ``ray start`` to return (it returns once its node is up)."""
        deadline = t0 + (timeout_s or self.start_timeout_s)
        pending = dict(procs)
        done = offset
        while pending:
            for key, proc in list(pending.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del pending[key]
                if rc != 0:
                    text = proc.log_path.read_text(errors="replace")
                    tail = "".join(text.splitlines(True)[-15:])
                    raise FleetError(f"`ray start` for {key} exited with {rc}:\n{tail}")
                done += 1
                if progress:
                    progress(f"host {key} joined", done, total)
            if pending and time.monotonic() > deadline:
                raise FleetError(
                    f"{len(pending)} node(s) did not start within start_timeout_s="
                    f"{timeout_s or self.start_timeout_s:.0f}: {', '.join(pending)}; the machine "
                    f"may be overloaded — raise start_timeout_s or emulate fewer hosts"
                )
            time.sleep(0.1)

    def _node_ip(self) -> str:
        from ray._private.services import get_node_ip_address

        return get_node_ip_address()

    def _wait_registered(self, t0: float, timeout_s: float | None = None) -> None:
        """Wait until GCS lists every planned host alive; record node ids."""
        import ray

        deadline = t0 + (timeout_s or self.start_timeout_s)
        while True:
            seen = {}
            for node in ray.nodes():
                labels = node.get("Labels") or {}
                if node.get("Alive") and "ray.io/tpu-slice-name" in labels:
                    key = f"{labels['ray.io/tpu-slice-name']}/{labels['ray.io/tpu-worker-id']}"
                    seen[key] = node["NodeID"]
            if all(p.key in seen for p in self.hosts):
                self.node_ids = seen
                return
            if time.monotonic() > deadline:
                missing = [p.key for p in self.hosts if p.key not in seen]
                raise FleetError(f"hosts {missing} did not register with the head in time")
            time.sleep(0.2)

    def wait_node(self, node_id: str, alive: bool, timeout_s: float) -> None:
        """Wait until Ray marks node ``node_id`` alive or dead."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(n["NodeID"] == node_id and bool(n["Alive"]) == alive for n in ray.nodes()):
                return
            time.sleep(0.2)
        raise FleetError(f"Ray did not mark node {node_id[:8]} {'alive' if alive else 'dead'} "
                         f"within timeout_s={timeout_s}")

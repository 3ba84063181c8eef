"""What a local fleet leaves on disk for other processes, and the ports it takes.

``pathways-ray down`` and ``status`` run in other processes than the one that
started a fleet: they find it by its state file under ``base_dir()`` and stop
it by the Unix sessions and the tag its processes carry (``_procs.py``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pathways_ray import _procs
from pathways_ray.config import base_dir
from pathways_ray.errors import FleetError

__all__ = ["FleetState", "running_fleets", "stop_fleet_processes",
           "stop_local_fleet"]


@dataclass
class FleetState:
    """What ``pathways-ray down`` needs to find a fleet started by another process."""

    name: str
    fleet_id: str
    address: str
    token_path: str
    dashboard_url: str | None
    slices: list[dict] = field(default_factory=list)
    created: float = 0.0
    # host key ("head" or "<slice>/<worker id>") -> Unix session ids of its `ray start`s
    sessions: dict[str, list[int]] = field(default_factory=dict)

    def all_sessions(self) -> list[int]:
        return [sid for sids in self.sessions.values() for sid in sids]

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, path: Path) -> FleetState:
        return cls(**json.loads(path.read_text()))


def stop_fleet_processes(state: FleetState | None, grace_s: float = 5.0) -> int:
    """Stop every process of a fleet (its sessions and its tag); returns how many."""
    if state is None:
        return 0
    sessions = state.all_sessions()
    n = _procs.kill_all(state.fleet_id, sessions, grace_s=grace_s)
    left = _procs.wait_gone(state.fleet_id, sessions, timeout_s=5)
    if left:
        raise FleetError(f"processes {[p.pid for p in left]} of fleet {state.fleet_id} survived")
    return n


def running_fleets() -> list[FleetState]:
    """Local fleets with live processes, from their state files."""
    out = []
    root = base_dir()
    if not root.exists():
        return out
    for state_file in sorted(root.glob("*/fleet.json")):
        try:
            state = FleetState.read(state_file)
        except (OSError, ValueError, TypeError):
            continue
        if _procs.find(state.fleet_id, state.all_sessions()):
            out.append(state)
    return out


def stop_local_fleet(name: str) -> int:
    """Stop a fleet started by another process (``pathways-ray up``)."""
    state_file = base_dir() / name / "fleet.json"
    if not state_file.exists():
        raise FleetError(f"no local fleet named {name!r} (looked for {state_file})")
    state = FleetState.read(state_file)
    n = stop_fleet_processes(state)
    shutil.rmtree(state_file.parent, ignore_errors=True)
    return n

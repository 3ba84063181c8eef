"""``pathways-ray doctor``: what this TPU host (or every TPU host of a cluster) looks like to
pathways-ray, with a line for each thing that is wrong and how to fix it."""

from __future__ import annotations

import json
import os

from rich.markup import escape
from rich.table import Table

from pathways_ray.cli.common import cluster_flags, console, err, positive_int

_MARK = {"ok": "[green]ok[/green]", "info": "[dim]-[/dim]", "problem": "[red]PROBLEM[/red]"}


def register(sub) -> dict:
    """Add this command to ``sub``; returns its handler."""
    p = sub.add_parser(
        "doctor", help="check this TPU host (or every one of a cluster) for what would stop "
        "pathways-ray", description="What this host looks like to pathways-ray: JAX, jaxlib "
        "and libtpu versions, its TPU chips, its TPU_* env, the env each chip worker would "
        "get, Ray's TPU resources and labels for it, and whether chip 0 opens (in a "
        "subprocess). Every problem comes with its fix; the exit code is 1 if there is one.")
    p.add_argument("--cluster", action="store_true",
                   help="check every TPU host of the Ray cluster, each on itself")
    cluster_flags(p)
    p.add_argument("--no-open", action="store_true", help="do not open a chip")
    p.add_argument("--open-timeout", type=positive_int, default=90, metavar="SECONDS",
                   help="how long opening a chip may take (default 90)")
    p.add_argument("--timeout", type=positive_int, default=150, metavar="SECONDS",
                   help="--cluster: how long to wait for the hosts' answers (default 150)")
    p.add_argument("--json", action="store_true", help="print the facts and findings as JSON")
    return {"doctor": cmd_doctor}


def _connect(args) -> str | None:
    """Attach to the cluster the flags name; returns why not, or None once attached."""
    try:
        import ray
    except ImportError:
        return "Ray is not installed here: pip install 'pathways-ray' (Ray's view not checked)"
    if ray.is_initialized():
        return None
    import argparse

    from ray._private.services import find_bootstrap_address

    from pathways_ray.cli.common import connect_for_status
    from pathways_ray.emulation.local_fleet import running_fleets

    # --address, $RAY_ADDRESS, a local fleet, else the cluster `ray start` joined here
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address and not running_fleets():
        address = find_bootstrap_address(None)
        if not address:
            return ("not connected to a Ray cluster (no --address, $RAY_ADDRESS, local fleet "
                    "or `ray start` on this host): Ray's view of this host not checked")
    try:
        connect_for_status(argparse.Namespace(address=address, name=args.fleet))
    except Exception as e:  # noqa: BLE001 - a doctor reports it, and checks the rest
        return (f"could not connect to the Ray cluster ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}): Ray's view not checked")
    return None


def cmd_doctor(args) -> int:
    from pathways_ray.chips import doctor_probe
    from pathways_ray.chips.doctor import diagnose, problems

    why_not = _connect(args)
    if args.cluster:
        if why_not:
            err.print(f"--cluster needs a Ray cluster: {why_not}")
            return 2
        err.print("examining every TPU host of the cluster ...")
        hosts = doctor_probe.survey(open_chips=not args.no_open,
                                    open_timeout_s=args.open_timeout, timeout_s=args.timeout)
    else:
        facts = doctor_probe.gather(open_chips=not args.no_open,
                                    open_timeout_s=args.open_timeout)
        if why_not:
            facts.ray_note = why_not
        else:
            import ray
            from ray._private.state import available_resources_per_node

            doctor_probe.ray_node(facts, ray.nodes(), available_resources_per_node(),
                                  ray.get_runtime_context().gcs_address)
        hosts = [facts]
    found = [(h, diagnose(h)) for h in hosts]
    if args.json:
        from pathways_ray.chips.doctor import chip_worker_envs

        console.print_json(json.dumps([
            {**h.to_dict(), "checks": [c.__dict__ for c in checks],
             "chip_workers": chip_worker_envs(h)} for h, checks in found]))
    elif args.cluster:
        console.print(_cluster_table(found), highlight=False)
    else:
        console.print(_host_table(*found[0]), highlight=False)
        envs = _env_table(hosts[0])
        if envs is not None:
            console.print(envs, highlight=False)
    bad = sum(len(problems(checks)) for _, checks in found)
    if not args.json:
        console.print(f"{bad} problem{'s' * (bad != 1)} on {len(found)} "
                      f"host{'s' * (len(found) != 1)}" if bad else
                      f"no problems on {len(found)} host{'s' * (len(found) != 1)}")
    return 1 if bad else 0


def _host_table(facts, checks) -> Table:
    t = Table(title=f"pathways-ray doctor: {escape(facts.key)} ({facts.platform})",
              title_justify="left")
    for col in ("", "check", "finding", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(_MARK[c.level], c.area, escape(c.what), escape(c.fix))
    return t


def _env_table(facts) -> Table | None:
    from pathways_ray.chips.doctor import chip_worker_envs

    rows = chip_worker_envs(facts)
    if not rows:
        return None
    t = Table(title="the env each chip worker of this host gets (ports are picked when its "
              "slice's JAX world starts)", title_justify="left")
    t.add_column("variable", no_wrap=True)
    for r in rows:
        t.add_column(f"chip {r['chip']}", overflow="fold")
    for k in [k for k in rows[0] if k != "chip"]:
        t.add_row(k, *(escape(_runs(r[k]) if k == "TPU_PROCESS_ADDRESSES" else r[k])
                       for r in rows))
    return t


def _runs(addresses: str) -> str:
    """``a:P,a:P,b:P`` as ``a:P x2, b:P``: one address per chip of the slice."""
    out: list[list] = []
    for a in addresses.split(","):
        if out and out[-1][0] == a:
            out[-1][1] += 1
        else:
            out.append([a, 1])
    return ", ".join(a if n == 1 else f"{a} x{n}" for a, n in out)


def _cluster_table(found) -> Table:
    t = Table(title="pathways-ray doctor: every TPU host", title_justify="left")
    for col in ("host", "platform", "chips", "jax / libtpu", "ray", "chip 0", "problems"):
        t.add_column(col, overflow="fold")
    for facts, checks in found:
        by_area = {c.area: c for c in checks}
        v = facts.versions
        ray = by_area.get("ray")
        opened = by_area.get("open")
        bad = [c for c in checks if c.level == "problem"]
        t.add_row(escape(facts.key), "?" if facts.unreachable else facts.platform,
                  _chips(facts),
                  f"{v.get('jax') or '-'} / {v.get('libtpu') or '-'}",
                  _MARK[ray.level] if ray else "-",
                  _MARK[opened.level] if opened else "-",
                  "\n".join(f"[red]{escape(c.what)}[/red]\n  fix: {escape(c.fix)}"
                            for c in bad) or "none")
    return t


def _chips(facts) -> str:
    if facts.chip_paths:
        return str(len(facts.chip_paths))
    tpu = (facts.ray or {}).get("resources", {}).get("TPU")
    return f"{tpu:g}" if tpu and not facts.unreachable else "?"

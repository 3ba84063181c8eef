"""``pathways-ray serve``: an OpenAI-compatible endpoint on TPU slices.

    pathways-ray serve --model smollm2                      # local emulated v6e 2x2 slice
    pathways-ray serve --model Qwen/Qwen3-30B-A3B --accelerator v6e --topology 4x4 \\
        --address ray://head:10001 --slices 1:4             # real slices, autoscaled
    pathways-ray serve --name chat --model A --model B      # one endpoint, routed by model
    pathways-ray serve list                                 # apps, models, replica slices
    pathways-ray serve delete chat                          # that app only

Without ``--address`` (or ``$RAY_ADDRESS``) it starts a local emulated fleet of
``--slices`` slices, serves there, and stops it all on Ctrl-C. Apps other than
the default ``llm`` answer under ``/<name>/v1``; Ctrl-C deletes only this app.
"""

from __future__ import annotations

import argparse
import os
import time

from pathways_ray._ui import make_console
from pathways_ray.errors import PathwaysError

console = make_console()


def _slices(text: str) -> int | tuple[int, int]:
    from pathways_ray.serve.plan import replica_range as check

    try:
        value = tuple(int(t) for t in text.split(":", 1)) if ":" in text else int(text)
        check(value)
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a number of slices (2) or MIN:MAX for autoscaling (1:4), "
            f"with 0 <= MIN <= MAX and MAX >= 1"
        ) from None


def register(sub) -> dict:
    p = sub.add_parser("serve", help="serve an LLM with an OpenAI-compatible API on TPU slices",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("action", nargs="?", choices=["run", "list", "delete", "metrics"],
                   default="run",
                   help="run (default): serve until Ctrl-C; list: what the cluster serves; "
                        "delete NAME: delete one app; metrics: live figures per model")
    p.add_argument("app", nargs="?", default=None, help="the app to delete")
    p.add_argument("--model", action="append", default=None,
                   help="Hugging Face id or checkpoint directory; 'smollm2' is the bundled "
                        "SmolLM2-135M-Instruct (default). Repeat it to serve several models "
                        "behind one endpoint, each on its own slices")
    p.add_argument("--accelerator", default="v6e", help="TPU generation (default v6e)")
    p.add_argument("--topology", default="2x2",
                   help="slice shape of one replica (default 2x2; 4x4 = 16-way tensor "
                        "parallel on v6e)")
    p.add_argument("--chips-per-host", type=int, default=None)
    p.add_argument("--slices", type=_slices, default=1,
                   help="replicas, one per slice: N, or MIN:MAX to autoscale (default 1)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default 8192 on TPU, 2048 on the emulated fleet)")
    p.add_argument("--platform", choices=["auto", "tpu", "cpu"], default="auto",
                   help="tpu: vLLM on the chips; cpu: vLLM's CPU engine on emulated hosts; "
                        "auto: ask a TPU host of the cluster (default)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to serve on (default $RAY_ADDRESS, else a local fleet)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the replicas to come up (default 900)")
    p.add_argument("--name", default="llm", type=_app_name,
                   help="the Serve app (default llm, at /v1; another name answers at "
                        "/<name>/v1); apps of other names keep serving")
    p.add_argument("--window", type=float, default=15.0,
                   help="metrics: seconds between the two scrapes (default 15; Ray exports "
                        "its metrics every 10 s)")
    p.add_argument("--watch", action="store_true", help="metrics: redraw every --window")
    p.add_argument("--fleet", default=None,
                   help="the local fleet (its `pathways-ray up --name`), without --address "
                        "(default serve; for list and delete: the one running)")
    return {"serve": cmd_serve}


def _app_name(text: str) -> str:
    import re

    if not re.fullmatch(r"[a-z][a-z0-9-]{0,39}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be 1-40 characters of a-z, 0-9 and '-', starting with a letter "
            f"(it becomes the app's URL path)")
    return text


def cmd_serve(args) -> int:
    if args.action == "run":
        if args.app is not None:
            raise ValueError(f"unexpected {args.app!r}: `pathways-ray serve` takes options "
                             f"only (`serve delete NAME` deletes an app)")
        return _run(args)
    if args.action == "delete" and not args.app:
        raise ValueError("`pathways-ray serve delete NAME`: name the app "
                         "(`pathways-ray serve list` shows them)")
    from types import SimpleNamespace

    from pathways_ray.cli.common import connect_for_status

    # --address, $RAY_ADDRESS, or the one local fleet running (--fleet picks one)
    with connect_for_status(SimpleNamespace(address=args.address, name=args.fleet)):
        if args.action == "list":
            from pathways_ray.serve.inventory import render_apps, served_apps

            console.print(render_apps(served_apps()))
            return 0
        if args.action == "metrics":
            return _metrics(args.window, args.watch)
        from pathways_ray.serve.app import shutdown_llm
        from pathways_ray.serve.inventory import served_apps

        names = [a.name for a in served_apps()]
        if args.app not in names:
            raise ValueError(f"no Serve app {args.app!r} on this cluster; it serves: "
                             f"{', '.join(names) or 'nothing'}")
        shutdown_llm(args.app)
        console.print(f"deleted app {args.app!r}; still serving: "
                      f"{', '.join(n for n in names if n != args.app) or 'nothing'}")
        return 0


def _metrics(window_s: float, watch: bool) -> int:
    from pathways_ray.serve.metrics import figures, parse, render_figures, scrape

    if window_s <= 0:
        raise ValueError(f"--window {window_s:g}: give the seconds between scrapes, e.g. 5")
    before, t0 = parse(scrape()), time.monotonic()
    time.sleep(window_s)
    if not watch:
        console.print(render_figures(figures(before, parse(scrape()),
                                             time.monotonic() - t0), window_s))
        return 0
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        while True:
            after, t1 = parse(scrape()), time.monotonic()
            live.update(render_figures(figures(before, after, t1 - t0), window_s), refresh=True)
            before, t0 = after, t1
            time.sleep(window_s)


def _run(args) -> int:
    from pathways_ray.emulation.local_fleet import cluster_or_local
    from pathways_ray.serve.app import (
        _serve_llm_module,
        detect_platform,
        llm_config,
        serve_llm,
        shutdown_llm,
    )
    from pathways_ray.serve.plan import slice_topology

    topo = slice_topology(args.accelerator, args.topology, args.chips_per_host)
    models = args.model or ["smollm2"]
    if len(set(models)) < len(models):
        raise ValueError(f"--model {' --model '.join(models)}: each model once (one "
                         f"endpoint routes by model id)")
    _serve_llm_module()  # fail before starting anything if vLLM is not installed
    n_local = args.slices if isinstance(args.slices, int) else args.slices[1]
    address = args.address or os.environ.get("RAY_ADDRESS")
    t0 = time.monotonic()
    with console.status("starting ...") as status:
        def progress(msg, elapsed):
            status.update(f"{msg} ({time.monotonic() - t0:.0f}s)")

        status.update("starting the local emulated fleet" if not address else
                      f"connecting to {address}")
        # Replica and engine logs stay in the session's log files unless -v.
        fleet = cluster_or_local(address, slices=[topo] * (n_local * len(models)),
                                 name=args.fleet or "serve",
                                 log_to_driver=args.verbose)
        with fleet:
            platform = args.platform
            if platform == "auto":
                platform = detect_platform(args.accelerator)
            max_len = args.max_model_len or (8192 if platform == "tpu" else 2048)
            status.update(f"preparing {', '.join(models)}")
            cfgs = [llm_config(m, accelerator=args.accelerator, topology=topo.name,
                               chips_per_host=topo.chips_per_host, num_slices=args.slices,
                               max_model_len=max_len, platform=platform) for m in models]
            status.update("starting the replicas (vLLM loads the model)")
            url = serve_llm(*cfgs, name=args.name, host=args.host, port=args.port,
                            timeout_s=args.timeout, progress=progress)
            model_id = cfgs[0].model_id
            status.stop()
            console.print(
                f"[green]serving[/green] {', '.join(c.model_id for c in cfgs)} as app "
                f"{args.name!r} on {topo.describe()} x {args.slices} "
                f"({platform}) in {time.monotonic() - t0:.0f}s\n"
                f"  OpenAI base URL: [bold]{url}[/bold]\n"
                f"  try: curl {url}/chat/completions -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", "
                f"\"content\": \"Hello!\"}}]}}'\n"
                f"  Ctrl-C stops it", highlight=False)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                console.print("stopping ...")
            finally:
                try:
                    shutdown_llm(args.name)  # ours only: a shared cluster serves others
                except PathwaysError as e:  # still stop the fleet
                    console.print(f"[yellow]{e}[/yellow]")
    return 0

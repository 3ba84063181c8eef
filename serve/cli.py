"""``pathways-ray serve``: an OpenAI-compatible endpoint on TPU slices.

    pathways-ray serve --model smollm2                      # local emulated v6e 2x2 slice
    pathways-ray serve --model Qwen/Qwen3-30B-A3B --accelerator v6e --topology 4x4 \\
        --address ray://head:10001 --slices 1:4             # real slices, autoscaled

Without ``--address`` (or ``$RAY_ADDRESS``) it starts a local emulated fleet of
``--slices`` slices, serves there, and stops it all on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import time

from rich.console import Console

from pathways_ray.errors import PathwaysError

console = Console()


def _slices(text: str) -> int | tuple[int, int]:
    from pathways_ray.serve.plan import _slices as check

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
    p.add_argument("--model", default="smollm2",
                   help="Hugging Face id or checkpoint directory; 'smollm2' is the bundled "
                        "SmolLM2-135M-Instruct (default)")
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
    p.add_argument("--name", default="serve", help="local fleet name (default serve)")
    return {"serve": cmd_serve}


def cmd_serve(args) -> int:
    from pathways_ray.local_fleet import cluster_or_local
    from pathways_ray.serve.app import (
        _serve_llm_module,
        detect_platform,
        llm_config,
        serve_llm,
        shutdown_llm,
    )
    from pathways_ray.serve.plan import slice_topology

    topo = slice_topology(args.accelerator, args.topology, args.chips_per_host)
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
        fleet = cluster_or_local(address, slices=[topo] * n_local, name=args.name,
                                 log_to_driver=args.verbose)
        with fleet:
            platform = args.platform
            if platform == "auto":
                platform = detect_platform(args.accelerator)
            max_len = args.max_model_len or (8192 if platform == "tpu" else 2048)
            status.update(f"preparing {args.model}")
            cfg = llm_config(args.model, accelerator=args.accelerator, topology=topo.name,
                             chips_per_host=topo.chips_per_host, num_slices=args.slices,
                             max_model_len=max_len, platform=platform)
            status.update("starting the replicas (vLLM loads the model)")
            url = serve_llm(cfg, host=args.host, port=args.port, timeout_s=args.timeout,
                            progress=progress)
            model_id = cfg.model_id
            status.stop()
            console.print(
                f"[green]serving[/green] {model_id} on {topo.describe()} x {args.slices} "
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
                    shutdown_llm()  # our app only: a shared cluster may serve others
                except PathwaysError as e:  # still stop the fleet
                    console.print(f"[yellow]{e}[/yellow]")
    return 0

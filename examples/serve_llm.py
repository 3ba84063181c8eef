"""Serve an LLM with an OpenAI-compatible API on TPU slices (Ray Serve LLM + vLLM),
then talk to it with the official ``openai`` client.

    python examples/serve_llm.py          # local emulated v6e 2x2 slice, bundled SmolLM2
    python examples/serve_llm.py --keep   # ... and keep serving until Ctrl-C

On a Ray cluster with TPU slices (``--address`` or ``$RAY_ADDRESS``), e.g. the
seed example, one replica per v6e 4x4 slice with 16-way tensor parallelism:

    python examples/serve_llm.py --address ray://head:10001 \\
        --model Qwen/Qwen3-30B-A3B --topology 4x4 --max-model-len 8192

The same app as a Ray Serve config file: ``serve run examples/serve_config.yaml``.
"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI

from pathways_ray import cluster_or_local
from pathways_ray.serve import detect_platform, llm_config, serve_llm, shutdown_llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="Ray cluster (default $RAY_ADDRESS, else a local fleet)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--accelerator", default="v6e")
    ap.add_argument("--topology", default="2x2")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")
    args = ap.parse_args()

    with cluster_or_local(args.address, accelerator=args.accelerator, topology=args.topology,
                          num_slices=1, name="serve-example", log_to_driver=False):
        platform = detect_platform(args.accelerator)  # "cpu" on the emulated fleet
        config = llm_config(args.model, accelerator=args.accelerator, topology=args.topology,
                            max_model_len=args.max_model_len, platform=platform)
        t0 = time.monotonic()
        url = serve_llm(config, port=args.port,
                        progress=lambda msg, s: print(f"[{s:5.0f}s] {msg}", flush=True))
        print(f"serving {config.model_id} at {url} ({platform}) after "
              f"{time.monotonic() - t0:.0f}s")
        try:
            client = OpenAI(base_url=url, api_key="unused")
            print(f"Q: {args.question}\nA: ", end="", flush=True)
            stream = client.chat.completions.create(
                model=config.model_id, messages=[{"role": "user", "content": args.question}],
                max_tokens=64, temperature=0, stream=True)
            for chunk in stream:
                if chunk.choices:
                    print(chunk.choices[0].delta.content or "", end="", flush=True)
            print()
            if args.keep:
                print("Ctrl-C stops it")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            shutdown_llm()  # this app only; on a shared cluster Serve keeps the rest


if __name__ == "__main__":  # vLLM's engine processes re-import this file
    main()

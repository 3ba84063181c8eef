"""``pathways-ray proxy``: serve unmodified JAX programs (``JAX_PLATFORMS=proxy``) from
the fleet, through the IFRT proxy protocol (``pathways_ray.proxy``)."""

from __future__ import annotations

import argparse
import os
import secrets
import threading

from pathways_ray.cli.common import cluster_flags, connect_for_status, console, err
from pathways_ray.clusters.topology import Topology


def _shape_count(text: str) -> tuple[str, int]:
    """``v6e-2x2:2`` -> ("v6e-2x2", 2); a bare shape counts once."""
    shape, _, count = text.partition(":")
    try:
        topo = Topology.of(shape.strip())
        n = int(count) if count else 1
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--slices {text!r}: {e}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--slices {text!r}: the count must be 1 or more")
    return str(topo), n


def register(sub) -> dict:
    """Add ``proxy`` to ``sub``; returns its handler."""
    p = sub.add_parser(
        "proxy", help="serve unmodified JAX programs (JAX_PLATFORMS=proxy) from the fleet",
        description="Serve jaxlib's IFRT proxy protocol in front of the single controller: "
        "a plain JAX program run with the printed exports and pathwaysutils.initialize() "
        "sees one device per chip of its session's slices (jax.devices(), slice_index). "
        "Each session reserves its own slices (or leases them from --service) and gives "
        "them back when it ends. Ctrl-C or SIGTERM stops the server and every session.")
    p.add_argument("--slices", type=_shape_count, nargs="+", default=[("v6e-2x2", 2)],
                   metavar="SHAPE[:COUNT]",
                   help="what each session gets (default v6e-2x2:2)")
    p.add_argument("--service", default=None,
                   help="lease each session's slices from this shared service instead")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1; the gRPC is plain: "
                   "put anything else behind the cluster's network controls)")
    p.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    p.add_argument("--token", default=None,
                   help="serve only sessions that present this token (their "
                   "initialization_data pathways_ray_token); 'auto' makes one. Default: "
                   "$PATHWAYS_RAY_PROXY_TOKEN (a Kubernetes Secret, say), else none on "
                   "127.0.0.1 and 'auto' on any other --host")
    p.add_argument("--cold", action="store_true",
                   help="no warm client: each session reserves its slices and starts its "
                   "chip workers itself (default: one client is kept ready, holding its "
                   "slices between sessions, so jax.devices() answers at once)")
    p.add_argument("--storage", default=None, metavar="ROOTS",
                   help="where clients may have the chips write and read (Orbax with "
                   "ENABLE_PATHWAYS_PERSISTENCE=1, profiles): comma-separated directories "
                   "and URL prefixes. Default: $PATHWAYS_RAY_PROXY_STORAGE, else gs:// (any "
                   "bucket the hosts can reach; no local path)")
    p.add_argument("--colocated-python", action="store_true",
                   help="run jax.experimental.colocated_python functions: the clients' "
                   "pickled Python, in the sidecar of the TPU host of their devices, as "
                   "this server's user (default: refused; $PATHWAYS_RAY_PROXY_COLOCATED_PYTHON=1)")
    cluster_flags(p)
    return {"proxy": cmd_proxy}


def cmd_proxy(args) -> int:
    from pathways_ray.config import STORAGE_ENV
    from pathways_ray.proxy.server import LOOPBACK, ProxyServer

    if args.service is not None:
        slices: list | dict = {}
        for shape, n in args.slices:
            slices[shape] = slices.get(shape, 0) + n
    else:
        slices = [shape for shape, n in args.slices for _ in range(n)]
    if args.storage is not None:
        os.environ[STORAGE_ENV] = args.storage
    if args.colocated_python:
        from pathways_ray.proxy.plugins.colocated import COLOCATED_ENV

        os.environ[COLOCATED_ENV] = "1"
    token = args.token or os.environ.get("PATHWAYS_RAY_PROXY_TOKEN") or None
    if token is None and args.host not in LOOPBACK:
        token = "auto"
    if token == "auto":
        token = secrets.token_urlsafe(24)
    fleet = connect_for_status(argparse.Namespace(address=args.address, name=args.fleet))
    try:
        server = ProxyServer(slices, service=args.service, host=args.host, port=args.port,
                             token=token, warm=not args.cold)
        server.start()
        try:
            console.print(f"IFRT proxy serving at {server.address}; run a JAX program with:")
            for key, value in server.exports.items():
                console.print(f"  export {key}={value}", soft_wrap=True, highlight=False)
            console.print("  # and pathwaysutils.initialize() before the first jax call"
                          + (" (with the token: see 'Run your JAX program unchanged')"
                             if token else ""), highlight=False)
            err.print("Ctrl-C stops it")
            threading.Event().wait()  # until Ctrl-C / SIGTERM (KeyboardInterrupt)
        finally:
            server.stop()
    finally:
        fleet.shutdown()
    return 0

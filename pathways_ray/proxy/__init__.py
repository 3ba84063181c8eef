"""Unmodified JAX on the fleet: an IFRT proxy server in front of the single controller.

A JAX program run with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET=grpc://HOST:PORT``
(``pathwaysutils.initialize()`` registers jaxlib's IFRT proxy client as JAX's "proxy"
backend) talks to ``pathways-ray proxy`` as it would to Cloud Pathways. ``protos``
holds the protocol, generated from the jaxlib this project pins
(``scripts/gen_ifrt_proxy_protos.py``); ``versions`` and ``devices`` are pure;
``server`` is the gRPC service.
"""

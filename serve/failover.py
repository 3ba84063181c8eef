"""Ray Serve LLM's OpenAI app, made to ride out a lost replica.

When a TPU host dies, Ray Serve's router stops sending new requests to its replica
within a moment (its queue-length probes fail) and restarts the replica once the
slice is back. What it leaves to the caller: the requests *in flight* on the lost
replica wait until Ray declares the node dead (its health checks: ~5 s on the
emulated fleet, 15-30 s with Ray's defaults) and then fail with HTTP 500. Two
classes close that gap, passed to ``build_openai_app`` (``ingress_cls``) and to
each ``LLMConfig`` (``server_cls``) by :func:`pathways_ray.serve.openai_app`:

- :class:`KeepaliveLLMServer` (``LLMServer``) sends a keepalive on each chat and
  completion response every ``KEEPALIVE_S`` until the response begins
  (:mod:`~pathways_ray.serve.keepalive`);
- :class:`FailoverIngress` (``OpenAiIngress``) sends a request again when its
  replica is lost before anything reached the client: Ray says so
  (``RayActorError``), or the keepalives stop for ``$PATHWAYS_RAY_SERVE_SILENCE_S``
  (default 2 s). An LLM request is idempotent until its first token is sent. A
  stream cut after that ends with an OpenAI error event naming the lost replica
  (the ``openai`` client raises ``APIError``), not with a connection cut mid-body.

Routing, health checks and bringing the replica back stay Ray Serve's.
"""

from __future__ import annotations

import logging
import os

from ray.exceptions import RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ErrorInfo,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
from ray.llm._internal.serve.core.server.llm_server import LLMServer

from pathways_ray.serve.keepalive import Silent, until_silent, with_keepalive

__all__ = ["RETRIES_ENV", "SILENCE_ENV", "FailoverIngress", "KeepaliveLLMServer"]

logger = logging.getLogger("ray.serve")

RETRIES_ENV = "PATHWAYS_RAY_SERVE_RETRIES"
SILENCE_ENV = "PATHWAYS_RAY_SERVE_SILENCE_S"
KEEPALIVE_S = 0.5


def _setting(env: str, default: str, kind: type, what: str):
    raw = os.environ.get(env, default)
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value < 0 or (kind is float and value == 0):
        raise ValueError(f"${env}={raw!r} must be {what} (default {default})")
    return value


class StreamCut(Exception):
    """A stream that ended without vLLM's closing ``[DONE]`` event."""


def _has_done(item) -> bool:
    """Whether a streamed item (an SSE string, or a batch of them) holds the end."""
    parts = item if isinstance(item, list) else [item]
    return any(isinstance(p, str) and "data: [DONE]" in p for p in parts)


class KeepaliveLLMServer(LLMServer):
    """``LLMServer`` whose chat and completion responses carry keepalives until they
    begin, so that the ingress notices a lost replica in ~2 s."""

    async def _run_request(self, request, *, engine_method: str, **kwargs):
        stream = await super()._run_request(request, engine_method=engine_method, **kwargs)
        if engine_method in ("chat", "completions"):
            return with_keepalive(stream, KEEPALIVE_S)
        return stream


class FailoverIngress(OpenAiIngress):
    """``OpenAiIngress`` that resends a request whose replica was lost before its
    first chunk, and ends a stream cut after it with an error event."""

    def __init__(self, llm_deployments, model_cards, **kwargs):
        # The handles to the LLM replicas were made by the process that built the app,
        # with that process's transport (Ray Serve reads RAY_SERVE_USE_GRPC_BY_DEFAULT
        # once, at import). The transport is the cluster's choice (the nodes' env,
        # pathways_ray.clusters.host_plan.NODE_ENV: gRPC), so take this node's.
        from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT

        by_reference = not RAY_SERVE_USE_GRPC_BY_DEFAULT
        super().__init__({model: handle.options(_by_reference=by_reference)
                          for model, handle in llm_deployments.items()}, model_cards, **kwargs)

    async def _get_response(self, *, body, call_method, raw_request=None):
        retries = _setting(RETRIES_ENV, "3", int, "a whole number of retries, 0 or more")
        silence_s = _setting(SILENCE_ENV, "2", float, "a positive number of seconds")
        streaming = bool(getattr(body, "stream", False))
        for attempt in range(retries + 1):
            sent = ended = False
            try:
                async for item in until_silent(super()._get_response(
                        body=body, call_method=call_method, raw_request=raw_request),
                        silence_s):
                    sent = True
                    ended = ended or _has_done(item)
                    yield item
                if streaming and sent and not ended:
                    # vLLM ends every stream with "data: [DONE]"; a replica that died
                    # mid-stream can end it early and quietly: a truncated answer
                    # that looks complete. Say so instead.
                    raise StreamCut("the replica's stream ended before its [DONE] event")
                return
            except (RayActorError, Silent, StreamCut) as e:
                what = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if sent:
                    logger.warning("%s to model %s: replica lost mid-stream (%s)",
                                   call_method, body.model, what)
                    yield ErrorResponse(error=ErrorInfo(
                        message=f"the replica serving this stream was lost after it had "
                                f"sent tokens ({what}); send the request again",
                        type="ServiceUnavailable", code=503))
                    return
                if attempt == retries:
                    raise OpenAIHTTPException(
                        status_code=503, type="ServiceUnavailable",
                        message=f"every replica this request was sent to was lost ({retries} "
                                f"retries, ${RETRIES_ENV}; last: {what}); send it again once "
                                f"`pathways-ray serve list` shows a running replica") from None
                logger.warning("%s to model %s: replica lost before the first token (%s); "
                               "sending it again (retry %d of %d)", call_method, body.model,
                               what, attempt + 1, retries)

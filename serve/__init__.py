"""OpenAI-compatible LLM endpoints on TPU slices: Ray Serve LLM + vLLM, one replica
per slice. ``llm_config_dict`` (pure) and the model helpers import no Ray Serve;
``llm_config``, ``openai_app`` and ``serve_llm`` import Ray Serve LLM (and so vLLM)
when first used."""

from pathways_ray.serve.models import BUNDLED_MODELS, resolve_model, smollm2_checkpoint
from pathways_ray.serve.plan import llm_config_dict, openai_serve_config

_LAZY = {"DIRECT_STREAMING_ENV", "cpu_engine_env", "detect_platform", "llm_config",
         "openai_app", "serve_llm", "shutdown_llm", "tpu_engine_env"}

__all__ = ["BUNDLED_MODELS", "llm_config_dict", "openai_serve_config", "resolve_model",
           "smollm2_checkpoint",
           *sorted(_LAZY)]


def __getattr__(name):
    if name in _LAZY:
        from pathways_ray.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'pathways_ray.serve' has no attribute {name!r}")

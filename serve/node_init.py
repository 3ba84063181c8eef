"""Ray Serve LLM's node initialization, skipped when it has nothing to do.

Before a replica starts its engine, Ray Serve LLM runs a task on every node of the
replica's placement group to download the model there. For a model in a local
directory with no cloud mirror (the bundled model, or one baked into the image)
those tasks download nothing, yet each starts a fresh worker process that imports
torch: ~9 s per replica on a busy 2-core machine, before the engine may start.
``SkipLocalModelDownload`` (a Ray Serve LLM callback, ``LLMConfig.callback_config``)
skips them in that case only; remote sources (``gs://``, ``s3://``, mirrors) and
Hugging Face ids keep Ray's path.
"""

from __future__ import annotations

import logging
import os

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.common.utils.cloud_utils import is_remote_path

__all__ = ["SkipLocalModelDownload", "nothing_to_download"]

logger = logging.getLogger(__name__)


def nothing_to_download(model: str, mirror_config) -> bool:
    """Whether Ray's per-node download would find nothing to fetch for ``model``: a
    directory on this node, with no cloud mirror configured."""
    return mirror_config is None and not is_remote_path(model) and os.path.isdir(model)


class SkipLocalModelDownload(CallbackBase):
    async def on_before_node_init(self) -> None:
        engine = self.llm_config.get_engine_config()
        if nothing_to_download(engine.actual_hf_model_id, engine.mirror_config):
            logger.info("model %s is a local directory: no per-node download tasks",
                        engine.actual_hf_model_id)
            self.ctx.run_init_node = False

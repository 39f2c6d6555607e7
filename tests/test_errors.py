"""Bad input: one documented exception type (GlanceError) with a message that says what to do."""

import json

import pytest
import torch

import glance_rt
from glance_rt import GlanceError
from tests.conftest import tiny_target
from tests.tiny_models import make_inputs


def test_unsupported_architecture_in_memory():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(GlanceError, match="supports.*llama"):
        glance_rt.load_target(model)


def test_unsupported_architecture_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(GlanceError, match="unsupported architecture 'bert'"):
        glance_rt.load_target(tmp_path)


@pytest.mark.parametrize("source", ["/no/such/model", 42])
def test_unknown_source(source):
    with pytest.raises(GlanceError, match="never downloads|takes a folder"):
        glance_rt.load_target(source)


def test_bad_dtype():
    with pytest.raises(GlanceError, match="dtype"):
        glance_rt.load_target(None, dtype="int8")


def test_drafter_for_another_target():
    llama, _, _ = tiny_target("llama")
    vlm, _, _ = tiny_target("qwen2_vl")
    drafter = glance_rt.init_drafter(llama, block_size=4)
    if llama.vocab_size != vlm.vocab_size:
        with pytest.raises(GlanceError, match="vocab size"):
            glance_rt.Decoder(vlm, drafter)
    wide = glance_rt.init_drafter(llama, block_size=4, hidden_size=32)
    with pytest.raises(GlanceError, match="hidden size 32"):
        glance_rt.Decoder(llama, wide)
    deep = glance_rt.init_drafter(llama, block_size=4, target_layer_ids=(0, 9))
    with pytest.raises(GlanceError, match=r"layer ids \[9\]"):
        glance_rt.Decoder(llama, deep)


def test_prompt_over_cache_capacity():
    target, _, tok = tiny_target("qwen3")
    inputs = make_inputs("qwen3", tok)
    dec = glance_rt.Decoder(target, glance_rt.init_drafter(target, block_size=4), tree_budget=16, max_length=48)
    with pytest.raises(GlanceError, match="exceeds the static cache.*max_length"):
        dec.generate(max_new_tokens=32, **inputs)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava", "idefics3"])
def test_image_count_must_match_placeholders(arch):
    target, _, processor = tiny_target(arch)
    one = make_inputs(arch, processor, n_images=1)
    two = make_inputs(arch, processor, n_images=2)
    bad = {**one, **{k: v for k, v in two.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}}
    with pytest.raises(GlanceError, match="image"):
        glance_rt.Decoder(target).generate(max_new_tokens=4, **bad)
    no_pixels = {k: v for k, v in one.items() if "pixel" not in k and "grid" not in k and "sizes" not in k}
    with pytest.raises(GlanceError, match="image"):
        glance_rt.Decoder(target).generate(max_new_tokens=4, **no_pixels)


def test_batch_of_two_is_refused():
    target, _, tok = tiny_target("llama")
    with pytest.raises(GlanceError, match="batch size 1"):
        glance_rt.Decoder(target).generate(max_new_tokens=4, input_ids=torch.ones(2, 3, dtype=torch.long))


@pytest.mark.parametrize("block", [1, 65])
def test_block_size_out_of_range(block):
    target, _, _ = tiny_target("llama")
    with pytest.raises(GlanceError, match="block_size"):
        glance_rt.init_drafter(target, block_size=block)


@pytest.mark.parametrize("budget", [0, 5000])
def test_budget_out_of_range(budget):
    target, _, _ = tiny_target("llama")
    with pytest.raises(GlanceError, match="tree_budget"):
        glance_rt.Decoder(target, glance_rt.init_drafter(target), tree_budget=budget)


def test_max_new_tokens_must_be_positive():
    target, _, tok = tiny_target("llama")
    with pytest.raises(GlanceError, match="max_new_tokens"):
        glance_rt.Decoder(target).generate(max_new_tokens=0, **make_inputs("llama", tok))


def test_missing_optional_dependency_names_the_install_command(monkeypatch, tmp_path):
    """An optional extra that is not installed: GlanceError with the pip command, not a traceback."""
    import importlib.util

    from click.testing import CliRunner

    from glance_rt.cli import main
    from glance_rt.errors import require

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    with pytest.raises(GlanceError, match=r"needs onnx, .*pip install 'glance-rt\[onnx\]'"):
        require("onnx", "onnx", "onnxruntime")
    target, _, _ = tiny_target("llama")
    from glance_rt.engines.engine import build_engine

    with pytest.raises(GlanceError, match=r"pip install 'glance-rt\[onnx\]'"):
        build_engine(target, None, tmp_path / "e", backend="onnxruntime", progress=False)
    from tests.tiny_models import make_tiny

    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    r = CliRunner().invoke(main, ["build-engine", "--backend", "onnxruntime", "--target", str(tmp_path / "m"),
                                  "--out", str(tmp_path / "c")])
    assert r.exit_code == 1 and "pip install 'glance-rt[onnx]'" in r.output and "Traceback" not in r.output


def test_engine_and_export_shapes_are_checked_before_any_work(tmp_path):
    """build-engine and export refuse bad budgets and static shapes up front, as a Decoder does."""
    from glance_rt.engines.engine import build_engine
    from glance_rt.export.onnx import export_model

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4)
    for build in (build_engine, export_model):
        with pytest.raises(GlanceError, match="max_len must be at least 2"):
            build(target, drafter, tmp_path / "a", max_len=1, progress=False)
        with pytest.raises(GlanceError, match="chunk at least 1"):
            build(target, None, tmp_path / "b", chunk=0, progress=False)
        with pytest.raises(GlanceError, match="budget"):
            build(target, drafter, tmp_path / "c", budgets=(0,), progress=False)
    assert not any(tmp_path.iterdir())  # nothing written


def test_caches_that_do_not_fit_are_refused_before_they_are_allocated(monkeypatch, tmp_path):
    """Static caches larger than the memory available now: a GlanceError naming the settings to lower, from
    the Python API and from `serve` before it starts (not an out-of-memory kill mid-run)."""
    from click.testing import CliRunner

    import glance_rt.models.kv_cache as kv
    from glance_rt.cli import main
    from tests.tiny_models import make_tiny

    target, _, _ = tiny_target("llama")
    c = target.text_config
    one_slot = 2 * c.num_hidden_layers * c.num_key_value_heads * 512 * (c.hidden_size // c.num_attention_heads) * 4
    monkeypatch.setattr(kv, "available_bytes", lambda device: 3 * one_slot)  # 3 slots of 512 rows fit, 4 do not
    glance_rt.Decoder(target, None, max_length=512, max_batch=3)
    with pytest.raises(GlanceError, match=r"4 slot\(s\) x 512 rows.*lower max_batch \(--max-batch\) or max_length"):
        glance_rt.Decoder(target, None, max_length=512, max_batch=4)
    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    result = CliRunner().invoke(main, ["serve", "--target", str(tmp_path / "m"), "--max-batch", "4",
                                       "--max-length", "512"])
    assert result.exit_code != 0 and "lower max_batch (--max-batch)" in result.output

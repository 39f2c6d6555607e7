"""The CLI through click's CliRunner, on tiny model folders (load_target's folder path) and the
embedded default."""

import functools

import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.method import DEFAULT_LOOKUP
from tests.conftest import hf_greedy
from tests.tiny_models import make_images, make_tiny


@functools.cache
def model_folder(arch: str, root: str) -> str:
    model, processor = make_tiny(arch)
    path = f"{root}/{arch}"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_vl", "llava"])
def test_folder_loads_and_matches_hf(arch, root):
    path = model_folder(arch, root)
    target = glance_rt.load_target(path)
    assert target.processor is not None
    images = make_images(1) if target.is_vlm else []
    inputs = target.encode_chat("Say something.", images)
    ref = hf_greedy(target.hf_model, inputs, 16)
    drafter = glance_rt.init_drafter(target, block_size=4)
    assert glance_rt.Decoder(target, drafter, tree_budget=8).generate(max_new_tokens=16, **inputs).token_ids == ref


def test_generate_streams_from_a_folder(root):
    path = model_folder("qwen3", root)
    target = glance_rt.load_target(path)
    inputs = target.encode_chat("Hello there.")
    want = target.decode(hf_greedy(target.hf_model, inputs, 12))
    result = CliRunner().invoke(main, ["generate", "--target", path, "--prompt", "Hello there.",
                                       "--max-new-tokens", "12", "--stats"])
    assert result.exit_code == 0, result.output
    assert want.strip() in result.stdout
    assert "[stats]" in result.stderr and "autoregressively" in result.stderr


def test_generate_with_drafter_and_image(root, tmp_path):
    path = model_folder("qwen2_vl", root)
    target = glance_rt.load_target(path)
    glance_rt.init_drafter(target, block_size=4).save(tmp_path / "drafter")
    image = tmp_path / "img.png"
    make_images(1)[0].save(image)
    result = CliRunner().invoke(main, ["generate", "--target", path, "--drafter", str(tmp_path / "drafter"),
                                       "--image", str(image), "--prompt", "What is this?", "--max-new-tokens", "10",
                                       "--tree-budget", "8", "--stats"])
    assert result.exit_code == 0, result.output
    from PIL import Image

    inputs = target.encode_chat("What is this?", [Image.open(image).convert("RGB")])
    assert target.decode(hf_greedy(target.hf_model, inputs, 10)).strip() in result.stdout
    assert "draft passes" in result.stderr


def test_generate_compare_warms_up_and_checks_against_autoregression(root, tmp_path):
    """The demo's command: GLANCE's answer, then the same engine autoregressively, both warmed up:
    tokens/s of both, tau, and the tokens identical."""
    path = model_folder("qwen3", root)
    target = glance_rt.load_target(path)
    glance_rt.init_drafter(target, block_size=4).save(tmp_path / "drafter")
    inputs = target.encode_chat("Hello there.")
    ref = hf_greedy(target.hf_model, inputs, 14)
    result = CliRunner().invoke(main, ["generate", "--target", path, "--drafter", str(tmp_path / "drafter"),
                                       "--prompt", "Hello there.", "--max-new-tokens", "14", "--compare"])
    assert result.exit_code == 0, result.output
    assert target.decode(ref).strip() in result.stdout
    assert "warming up" in result.stderr and "tokens identical: yes" in result.stdout
    assert f"GLANCE (trees of 8 + prompt lookup {DEFAULT_LOOKUP}, eager): {len(ref)} tokens" in result.stdout
    assert f"autoregressive (same engine):   {len(ref)} tokens" in result.stdout
    result = CliRunner().invoke(main, ["generate", "--target", path, "--prompt", "Hi", "--compare"])
    assert result.exit_code != 0 and "needs a drafter" in result.output
    assert result.stdout == ""  # refused before any work: no answer streamed first


def test_generate_chain_drafts_the_whole_block(root, tmp_path):
    """`--chain` with no budget drafts the drafter's whole block (B-1), as DFlash's runtime does."""
    path = model_folder("qwen3", root)
    target = glance_rt.load_target(path)
    glance_rt.init_drafter(target, block_size=16).save(tmp_path / "drafter")
    args = ["generate", "--target", path, "--drafter", str(tmp_path / "drafter"), "--prompt", "Hello there.",
            "--max-new-tokens", "6", "--chain", "--compare"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "GLANCE (a chain of 15, eager)" in result.stdout and "tokens identical: yes" in result.stdout
    result = CliRunner().invoke(main, [*args, "--tree-budget", "4"])
    assert result.exit_code == 0 and "GLANCE (a chain of 4, eager)" in result.stdout, result.output


def test_generate_with_an_eagle3_head(root, tmp_path):
    """`--drafter` takes an EAGLE-3 folder too (told apart by its architecture): the target's tokens."""
    from glance_rt.models.eagle3 import init_eagle3, save_eagle3

    path = model_folder("qwen3", root)
    target = glance_rt.load_target(path)
    layers = target.text_config.num_hidden_layers
    save_eagle3(init_eagle3(target, target_layer_ids=(0, layers // 2, layers - 1)).head, tmp_path / "eagle3")
    result = CliRunner().invoke(main, ["generate", "--target", path, "--drafter", str(tmp_path / "eagle3"),
                                       "--prompt", "Hello there.", "--max-new-tokens", "8", "--compare"])
    assert result.exit_code == 0, result.output
    assert "EAGLE-3 (trees of 8, eager)" in result.stdout and "tokens identical: yes" in result.stdout


def test_bad_inputs_give_clear_errors(root, tmp_path):
    path = model_folder("qwen3", root)
    runner = CliRunner()
    r = runner.invoke(main, ["generate", "--target", "/no/such", "--prompt", "x"])
    assert r.exit_code != 0 and "never downloads" in r.output
    good = tmp_path / "good.png"
    make_images(1)[0].save(good)
    r = runner.invoke(main, ["generate", "--target", path, "--image", str(good), "--prompt", "x"])
    assert r.exit_code != 0 and "text model" in r.output
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    vlm = model_folder("llava", root)
    r = runner.invoke(main, ["generate", "--target", vlm, "--image", str(bad), "--prompt", "x"])
    assert r.exit_code != 0 and "could not open image" in r.output
    r = runner.invoke(main, ["generate", "--target", path, "--prompt", "x", "--tree-budget", "0",
                             "--drafter", str(tmp_path)])
    assert r.exit_code != 0 and "Error" in r.output


@pytest.mark.slow
def test_embedded_default_generate():
    """The README's main job: no target given -> SmolLM2-135M-Instruct, exact greedy answer."""
    r = CliRunner().invoke(main, ["generate", "--prompt", "What is 2+2?", "--max-new-tokens", "12", "--stats"])
    assert r.exit_code == 0, r.output
    from tests.conftest import smollm_target

    target = smollm_target()
    inputs = target.encode_chat("What is 2+2?")
    assert target.decode(hf_greedy(target.hf_model, inputs, 12)).strip() in r.stdout
    assert "[stats]" in r.stderr


def test_version():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and glance_rt.__version__ in r.output


torch.set_num_threads(2)


def test_gguf_copy_is_keyed_by_the_file_its_dtype_and_versions(tmp_path, monkeypatch):
    """A GGUF file's converted copy is named by the file (path, size, modification time: a rewritten file
    gets a new copy) and the dtype, under the cache folder; the key reads no bytes of the file."""
    import os

    from glance_rt.hf.target import gguf_cache_folder

    monkeypatch.setenv("GLANCE_RT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 64)
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    first = gguf_cache_folder(f, torch.float32)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-")
    assert gguf_cache_folder(f, torch.float32) == first
    assert gguf_cache_folder(f, torch.bfloat16) != first
    f.write_bytes(b"b" * 64)  # rewritten: same size, a new modification time
    os.utime(f, ns=(2_000_000_000, 2_000_000_000))
    assert gguf_cache_folder(f, torch.float32) != first
    other = tmp_path / "sub"
    other.mkdir()
    (other / "m.gguf").write_bytes(b"b" * 64)
    os.utime(other / "m.gguf", ns=(2_000_000_000, 2_000_000_000))
    assert gguf_cache_folder(other / "m.gguf", torch.float32) != gguf_cache_folder(f, torch.float32)


def test_train_copy_span_writes_a_span_copy_drafter(root, tmp_path):
    """--copy-span is the copy head in span form: the run trains one and its drafter/ says so (glance-only)."""
    import json

    from tests.test_train import write_prompts

    path = model_folder("qwen3", root)
    result = CliRunner().invoke(main, [
        "train", "--target", path, "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--out",
        str(tmp_path / "run"), "--copy-span", "--block-size", "4", "--response-tokens", "8", "--steps", "2",
        "--save-every", "2", "--batch-size", "2", "--blocks-per-seq", "2", "--eval-per-kind", "1", "--no-bf16"])
    assert result.exit_code == 0, result.output
    glance = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["glance"]
    assert glance["copy_head"] is True and glance["copy_span"] is True
    loaded = glance_rt.load_drafter(tmp_path / "run" / "drafter", glance_rt.load_target(path))
    assert loaded.config.copy_span

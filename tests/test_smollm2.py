"""The real embedded model (SmolLM2-135M-Instruct, GGUF): exact greedy output, every mode."""

import pytest

import glance_rt
from tests.conftest import OracleDrafter, hf_greedy, smollm_target

pytestmark = pytest.mark.slow

PROMPTS = [
    "Copy exactly: The committee approved the budget on March 3rd, 2024, with 7 votes in favour.",
    "Write a haiku about compilers.",
]
NEW = 40


@pytest.fixture(scope="module")
def cases():
    target = smollm_target()
    out = []
    for prompt in PROMPTS:
        inputs = target.encode_chat(prompt)
        out.append((inputs, hf_greedy(target.hf_model, inputs, NEW)))
    return target, out


def test_embedded_default_is_smollm2(cases):
    target, _ = cases
    assert target.name == "SmolLM2-135M-Instruct"
    assert target.text_config.num_hidden_layers == 30 and target.vocab_size == 49152
    assert 2 in target.eos_token_ids  # <|im_end|>


@pytest.mark.parametrize("mode", ["ar", "chain", "tree32", "tree8-b4", "oracle", "decoy"])
def test_real_model_lossless(cases, mode):
    target, items = cases
    for inputs, ref in items:
        p = inputs["input_ids"].shape[1]
        drafter, kw = {
            "ar": (None, {}),
            "chain": (glance_rt.init_drafter(target, block_size=8), {"chain": True}),
            "tree32": (glance_rt.init_drafter(target, num_layers=2, block_size=8), {"tree_budget": 32}),
            "tree8-b4": (glance_rt.init_drafter(target, block_size=4, seed=3), {"tree_budget": 8}),
            "oracle": (OracleDrafter(p, ref, target.vocab_size, 8), {"tree_budget": 16}),
            "decoy": (OracleDrafter(p, ref, target.vocab_size, 5, decoy=True), {"tree_budget": 24}),
        }[mode]
        res = glance_rt.Decoder(target, drafter, **kw).generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref, (mode, res.text)
        if mode == "oracle":
            assert res.stats.mean_accepted > 3
        if mode == "decoy":  # right tokens sit at rank 1: accepted paths leave rank 0
            assert max(res.stats.accepted_lengths) >= 3


def test_shipped_drafter_loads_and_is_lossless(cases):
    import os

    from glance_rt.hf.embedded import DRAFTER_DIR

    target, items = cases
    drafter = glance_rt.load_drafter(target=target)  # no path: the one shipped for the default target
    assert os.path.getsize(DRAFTER_DIR / "model.safetensors") <= 20 * 2**20
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == (2, 15, 27)
    for inputs, ref in items:
        res = glance_rt.Decoder(target, drafter, tree_budget=32, gate=False).generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref
        assert res.stats.draft_passes == res.stats.rounds


def test_shipped_drafter_is_dflash_compatible(cases):
    """The shipped drafter follows the DFlash contract: DFlash's reference (the stand-in in
    tests/dflash_reference.py) loads it strictly and commits the same tokens per round as glance-rt's
    chain decoder."""
    from glance_rt.hf.embedded import DRAFTER_DIR
    from glance_rt.models.drafter import check_dflash
    from tests.dflash_reference import load_reference, reference_chain

    target, items = cases
    check_dflash(DRAFTER_DIR)
    ref = load_reference(DRAFTER_DIR)
    dec = glance_rt.Decoder(target, glance_rt.load_drafter(None, target), chain=True, prepack=False, gate=False)
    deepest = 0
    for inputs, want in items:
        tokens, lengths = reference_chain(ref, target.hf_model, inputs["input_ids"], NEW)
        res = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == want and tokens[:len(want)] == want
        got = res.stats.accepted_lengths
        assert got[:-1] == lengths[:len(got) - 1] and max(got) >= 2  # every prompt accepts drafts
        deepest = max(deepest, *got)
    assert deepest > 2  # and some round accepts several (the haiku's chain reaches 2 with today's drafter)


@pytest.mark.extended  # 5 min: compile and AOTInductor engines on the tiny architectures stay in CI's tier
def test_shipped_drafter_compiled_and_aoti_engine_match_hf(cases, tmp_path):
    """The compiled backend and an AOTInductor engine of the default target + shipped drafter give
    HF's greedy tokens (the eager backend is covered above)."""
    from glance_rt.engines.engine import build_engine

    target, items = cases
    drafter = glance_rt.load_drafter(None, target)
    compiled = glance_rt.Decoder(target, drafter, tree_budget=16, max_length=256, backend="compile")
    build_engine(target, drafter, tmp_path / "engine", budgets=(16,), max_len=256, progress=False)
    engine = glance_rt.Decoder.from_engine(tmp_path / "engine", target, drafter)
    for inputs, ref in items:
        assert compiled.generate(max_new_tokens=NEW, **inputs).token_ids == ref
        assert engine.generate(max_new_tokens=NEW, **inputs).token_ids == ref


@pytest.mark.extended  # 2.5 min: ONNX Runtime engines of the tiny architectures stay in CI's tier
def test_shipped_drafter_onnxruntime_engine_matches_hf(cases, tmp_path):
    """`glance-rt export` of the default target + shipped drafter, run through ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    from glance_rt.export.onnx import export_model

    target, items = cases
    drafter = glance_rt.load_drafter(None, target)
    export_model(target, drafter, tmp_path / "onnx", budgets=(16,), max_len=256, progress=False)
    engine = glance_rt.Decoder.from_engine(tmp_path / "onnx", target, drafter)
    for inputs, ref in items:
        assert engine.generate(max_new_tokens=NEW, **inputs).token_ids == ref


def test_gguf_loads_from_its_converted_copy_as_from_the_file(tmp_path, monkeypatch, capsys):
    """The first load of a GGUF keeps a converted folder (saying so on stderr); later loads read it: the
    same tensors, config, generation config and tokenizer as converting the file. A damaged copy is
    converted again, and a killed conversion's temp folder is removed at the next load."""
    import torch

    from glance_rt.errors import GlanceWarning
    from glance_rt.hf.embedded import default_gguf_path
    from glance_rt.hf.target import gguf_cache_folder

    monkeypatch.setenv("GLANCE_RT_CACHE", str(tmp_path))
    direct = glance_rt.load_target(None, gguf_cache=False)
    assert not (tmp_path / "gguf").exists()
    capsys.readouterr()
    glance_rt.load_target(None)  # converts and keeps the copy
    err = capsys.readouterr().err
    assert "converting SmolLM2-135M-Instruct" in err and "converted in" in err
    folder = gguf_cache_folder(default_gguf_path(), torch.float32)
    lock = f".{folder.name}.lock"  # held while a process converts (files.exclusive)
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted([folder.name, lock])  # nothing half-written
    (tmp_path / "gguf" / f".{folder.name}.k1ll3d").mkdir()  # what a conversion killed mid-write leaves
    (tmp_path / "gguf" / f".{folder.name}.k1ll3d" / "model.safetensors").write_bytes(b"half")
    with pytest.warns(GlanceWarning, match="did not finish"):
        cached = glance_rt.load_target(None)
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted([folder.name, lock])  # cleared
    assert cached.hf_model.config._name_or_path == str(folder)  # read from the copy, not the GGUF
    assert "converting" not in capsys.readouterr().err

    def same(a, b):
        sa, sb = a.hf_model.state_dict(), b.hf_model.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        ca, cb = a.hf_model.config.to_dict(), b.hf_model.config.to_dict()
        for c in (ca, cb):
            c.pop("_name_or_path"), c.pop("quantization_config", None)
        assert ca == cb
        assert a.hf_model.generation_config.to_dict() == b.hf_model.generation_config.to_dict()
        assert (a.name, a.eos_token_ids, a.vocab_size) == (b.name, b.eos_token_ids, b.vocab_size)
        ta, tb = a.tokenizer, b.tokenizer
        assert ta.chat_template == tb.chat_template and ta.all_special_ids == tb.all_special_ids
        for text in ["Copy exactly: 7 votes, März 3rd — 数字 ✓", "def f(x):\n\treturn x ** 2  # <|im_end|>"]:
            assert ta(text)["input_ids"] == tb(text)["input_ids"]
            assert a.encode_chat(text)["input_ids"].tolist() == b.encode_chat(text)["input_ids"].tolist()
        tied = a.hf_model.lm_head.weight.data_ptr() == a.hf_model.model.embed_tokens.weight.data_ptr()
        assert tied == (b.hf_model.lm_head.weight.data_ptr() == b.hf_model.model.embed_tokens.weight.data_ptr())

    same(direct, cached)
    inputs = direct.encode_chat(PROMPTS[0])
    assert hf_greedy(cached.hf_model, inputs, 8) == hf_greedy(direct.hf_model, inputs, 8)

    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.warns(GlanceWarning, match="converting the GGUF file again"):
        again = glance_rt.load_target(None)
    same(direct, again)
    assert glance_rt.load_target(None).hf_model.config._name_or_path == str(folder)  # the copy mended

"""Sampling parameters and draws (glance_rt/round/sample.py): processed scores equal Hugging Face's own
processor list; keyed Gumbel-max draws follow the processed distribution; bad values are refused."""

import math

import numpy as np
import pytest
import torch

from glance_rt.errors import GlanceError
from glance_rt.round.sample import Chooser, Sampling, draw_key, gumbel
from tests.conftest import tiny_target

SETTINGS = [
    dict(do_sample=True),
    dict(do_sample=True, temperature=0.7),
    dict(do_sample=True, temperature=1.3, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.8),
    dict(do_sample=True, top_k=None, min_p=0.1, temperature=0.5),
    dict(do_sample=True, repetition_penalty=1.3, top_p=0.9, top_k=20),
    dict(do_sample=False, repetition_penalty=1.2),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=str)
def test_processed_scores_equal_hf_generate_processors(kw):
    """On random logits and histories, our scores equal the processor list HF's `generate` builds
    from the same GenerationConfig (same classes, same order, same defaults)."""
    from transformers import GenerationConfig

    _, model, _ = tiny_target("llama")
    cfg = GenerationConfig(**kw)
    for k, v in GenerationConfig._get_default_generation_params().items():
        if getattr(cfg, k, None) is None:
            setattr(cfg, k, v)
    hf = model._get_logits_processor(generation_config=cfg, input_ids_seq_length=10, device="cpu")
    mine = Chooser(Sampling(**kw))
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(model.config.vocab_size, generator=gen) * 4
        ids = torch.randint(0, model.config.vocab_size, (12,), generator=gen)
        want = hf(ids[None], logits[None].clone())[0]
        torch.testing.assert_close(mine.scores(logits, ids), want)


def test_draws_follow_the_processed_distribution():
    """Keyed Gumbel-max over 4000 positions: counts against the exact probabilities (chi-square; the
    seed is fixed, so the outcome is deterministic; a correct sampler fails this with probability
    1e-4 over seeds)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    sampler = Chooser(Sampling(do_sample=True, temperature=0.8, top_k=0, seed=1234))
    n = 4000
    counts = np.bincount([sampler.choose(logits, torch.zeros(1, dtype=torch.long), i) for i in range(n)],
                         minlength=6)
    p = torch.softmax(logits / 0.8, 0).double().numpy()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 25.8  # chi-square, 5 degrees of freedom, upper 1e-4 quantile (25.79)


def test_draws_are_keyed_by_seed_and_position_only():
    a = gumbel(7, 100, 50, "cpu")
    assert torch.equal(a, gumbel(7, 100, 50, "cpu"))
    assert not torch.equal(a, gumbel(7, 101, 50, "cpu")) and not torch.equal(a, gumbel(8, 100, 50, "cpu"))
    assert len({draw_key(s, p) for s in range(20) for p in range(200)}) == 4000


def test_filtered_tokens_are_never_drawn():
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0, -2.0])
    sampler = Chooser(Sampling(do_sample=True, top_k=2, seed=3))
    assert {sampler.choose(logits, torch.zeros(1, dtype=torch.long), i) for i in range(300)} == {0, 1}


def test_greedy_default_is_argmax():
    assert Sampling().greedy_only and not Sampling(repetition_penalty=1.1).greedy_only
    logits = torch.randn(100)
    assert Chooser(Sampling()).choose(logits, torch.zeros(1, dtype=torch.long), 5) == int(logits.argmax())


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(temperature=math.nan), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be a non-negative integer"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(seed=-3), "seed must be a non-negative integer"),
    (dict(stop="###"), "stop must be a tuple"),
    (dict(stop=("",)), "stop must be a tuple"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(GlanceError, match=match):
        Sampling(**kw)


# ------------------------------------------------------------------------------ seed-exact decoding

import glance_rt  # noqa: E402
from tests.conftest import OracleDrafter, vocab_drafter  # noqa: E402
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs  # noqa: E402

NEW = 24
# The tiny models' logits spread ~100 (tests/tiny_models.py: clear greedy margins), so their distributions
# are nearly one-hot at ordinary temperatures; these temperatures make the draws really random.
HOT = 60.0
SEED_SETTINGS = [
    dict(do_sample=True, temperature=HOT, top_k=0),
    dict(do_sample=True, temperature=HOT / 2, top_k=5),
    dict(do_sample=True, temperature=2 * HOT, top_k=0, top_p=0.8),
    dict(do_sample=True, temperature=HOT, top_k=None, min_p=0.05),
    dict(do_sample=True, temperature=HOT, repetition_penalty=1.5, top_k=50),
    dict(do_sample=False, repetition_penalty=1.5),
]


def ar_tokens(target, inputs, sampling, new=NEW, backend="eager"):
    """The same engine's autoregressive sampling: the reference a speculative run must equal."""
    dec = glance_rt.Decoder(target, None, max_length=256, backend=backend, lookup=0)
    return dec.generate(max_new_tokens=new, sampling=sampling, **inputs).token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_seed_exact_on_every_architecture(arch):
    """Sampled GLANCE (untrained drafter, tree + lookup) == AR sampling with the same seed, token for
    token; another seed gives other tokens (the draws are really random)."""
    target, _, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    s = glance_rt.Sampling(do_sample=True, temperature=HOT, top_k=0, seed=11)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256)
    got = dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids
    assert got == ar_tokens(target, inputs, s)
    other = glance_rt.Sampling(do_sample=True, temperature=HOT, top_k=0, seed=12)
    assert dec.generate(max_new_tokens=NEW, sampling=other, **inputs).token_ids != got
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids != got


@pytest.mark.parametrize("kw", SEED_SETTINGS, ids=str)
@pytest.mark.parametrize("budget,chain,lookup", [(4, False, 0), (12, False, 3), (0, True, 0)])
def test_seed_exact_across_warpers_budgets_and_chains(kw, budget, chain, lookup):
    target, _, processor = tiny_target("qwen3")
    inputs = make_inputs("qwen3", processor, prompt="Say something long about the sea.")
    drafter = vocab_drafter(target, 40, seed=3, num_layers=1, block_size=5)
    s = glance_rt.Sampling(**{**kw, "seed": 5})
    dec = glance_rt.Decoder(target, drafter, tree_budget=budget or 8, chain=chain, lookup=lookup, max_length=256)
    assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == ar_tokens(target, inputs, s)


@pytest.mark.parametrize("kind", ["perfect", "decoy"])
def test_seed_exact_with_perfect_and_decoy_drafters(kind):
    """A drafter that proposes the sampled continuation itself (long acceptances), and one that ranks a
    wrong token above it at every depth: both commit exactly the AR sample."""
    target, _, processor = tiny_target("llama")
    inputs = make_inputs("llama", processor, prompt="Tell me a story.")
    s = glance_rt.Sampling(do_sample=True, temperature=HOT, top_p=0.95, seed=21)
    want = ar_tokens(target, inputs, s, new=30)
    p = inputs["input_ids"].shape[1]
    oracle = OracleDrafter(p, want, target.vocab_size, block_size=6, decoy=kind == "decoy")
    dec = glance_rt.Decoder(target, oracle, tree_budget=8, max_length=256, lookup=0)
    res = dec.generate(max_new_tokens=30, sampling=s, **inputs)
    assert res.token_ids == want
    if kind == "perfect":
        assert res.stats.mean_accepted > 3


@pytest.mark.parametrize("backend", ["compile"])
def test_seed_exact_on_compiled_passes(backend):
    target, _, processor = tiny_target("llama")
    inputs = make_inputs("llama", processor, prompt="Name three colours.")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    s = glance_rt.Sampling(do_sample=True, temperature=HOT, top_k=20, seed=3)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, backend=backend, chunk=8)
    assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == \
        ar_tokens(target, inputs, s, backend=backend)


def test_greedy_stays_hf_greedy_and_repetition_penalty_is_hfs():
    """Greedy (the in-graph argmax) still equals HF greedy; greedy with a repetition penalty (the host
    walk over processed scores) equals HF greedy with the same penalty."""
    from tests.conftest import hf_greedy

    target, model, processor = tiny_target("qwen2")
    inputs = make_inputs("qwen2", processor)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
    s = glance_rt.Sampling(repetition_penalty=1.3)
    assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == \
        hf_greedy(model, inputs, NEW, repetition_penalty=1.3)


def test_sampled_continuations_follow_the_exact_distribution():
    """A 6-token-vocabulary model: the exact probability of every 2-token continuation (36) is
    enumerated from its logits through the processors; 1500 seeded GLANCE runs (a drafter, a tree)
    are counted against it (chi-square, 35 degrees of freedom). Seeds 0..1499 are fixed, so the test is
    deterministic; a correct sampler would fail it for 1e-4 of seed ranges."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # logits spread enough that temperature 1 would fail the test (checked: chi2 > 150)
        model.lm_head.weight.mul_(5)
    model.generation_config.eos_token_id = None
    target = glance_rt.load_target(model)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=3, seed=1)
    prompt = torch.tensor([[1, 4, 2]])
    s = glance_rt.Sampling(do_sample=True, temperature=0.7, top_k=0)
    chooser = Chooser(s)

    def probs(ids):
        with torch.no_grad():
            logits = model(ids[None]).logits[0, -1]
        return torch.softmax(chooser.scores(logits, ids).double(), 0)

    p1 = probs(prompt[0])
    exact = torch.stack([p1[a] * probs(torch.cat([prompt[0], torch.tensor([a])])) for a in range(6)]).flatten()
    dec = glance_rt.Decoder(target, drafter, tree_budget=4, max_length=32, lookup=0)
    n, counts = 1500, torch.zeros(36, dtype=torch.float64)
    for seed in range(n):
        seeded = Sampling(**{**vars(s), "seed": seed})
        a, b = dec.generate(max_new_tokens=2, sampling=seeded, input_ids=prompt).token_ids
        counts[a * 6 + b] += 1
    expected = n * exact
    assert expected.min() >= 5  # every cell counts (the chi-square approximation holds)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 74.9  # chi-square, 35 degrees of freedom, upper 1e-4 quantile (74.87)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_stop_strings_end_where_hf_ends(arch):
    """A stop string spanning two tokens, completed inside a round (a perfect drafter commits many
    tokens per round): generation ends after the token completing it, as HF's stop_strings; the text
    ends where HF's does. Also with sampling (against AR sampling with the same stop)."""
    from tests.conftest import hf_greedy

    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    full = hf_greedy(model, inputs, 30)
    tok = target.tokenizer
    pieces = [tok.decode(full[:i]) for i in range(len(full) + 1)]
    grew = [len(pieces[i + 1]) - len(pieces[i]) for i in range(len(full))]  # characters token i adds
    k = next(i for i in range(8, 28) if grew[i - 1] >= 2 and grew[i] >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]) : len(pieces[k]) + 2]  # spans tokens k-1 and k
    want = hf_greedy(model, inputs, 30, stop_strings=[stop], tokenizer=tok)
    assert len(want) < len(full) and stop in tok.decode(want)
    oracle = OracleDrafter(inputs["input_ids"].shape[1], full, target.vocab_size, block_size=8)
    dec = glance_rt.Decoder(target, oracle, tree_budget=8, max_length=256, lookup=0)
    res = dec.generate(max_new_tokens=30, sampling=Sampling(stop=(stop,)), **inputs)
    assert res.token_ids == want and res.text == tok.decode(want, skip_special_tokens=True)
    assert res.stats.mean_accepted > 2  # the stop came inside a round, not at its edge by luck
    s = Sampling(do_sample=True, temperature=HOT, seed=4, stop=(stop,))
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    got = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256).generate(
        max_new_tokens=30, sampling=s, **inputs).token_ids
    assert got == ar_tokens(target, inputs, s, new=30)


def test_stop_strings_need_a_tokenizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    dec = glance_rt.Decoder(glance_rt.load_target(model), None, max_length=32)
    with pytest.raises(GlanceError, match="tokenizer"):
        dec.generate(max_new_tokens=2, sampling=Sampling(stop=("x",)), input_ids=torch.tensor([[1, 2]]))
    with pytest.raises(GlanceError, match="glance_rt.Sampling"):
        dec.generate(max_new_tokens=2, sampling={"do_sample": True}, input_ids=torch.tensor([[1, 2]]))


# ----------------------------------------------------------------------------------------- the CLI


def saved_tiny(tmp_path, arch="llama"):
    from tests.tiny_models import make_tiny

    model, processor = make_tiny(arch)
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    target = glance_rt.load_target(tmp_path / "m")
    glance_rt.init_drafter(target, block_size=4, seed=1).save(tmp_path / "d")
    return str(tmp_path / "m"), str(tmp_path / "d")


def test_cli_generate_compare_audit_and_bench_sample_seed_exact(tmp_path):
    """--temperature everywhere: generate --compare finds GLANCE's sample identical to AR's; audit
    passes seed-exact against AR and records the sampling; bench checks every method against ar and
    its report says so; a bad value is refused with what to do."""
    import json

    from click.testing import CliRunner

    from glance_rt.cli import main

    m, d = saved_tiny(tmp_path)
    hot = ["--temperature", str(HOT), "--top-k", "0", "--seed", "9"]
    r = CliRunner().invoke(main, ["generate", "--target", m, "--drafter", d, "--prompt", "Hello there.",
                                  "--max-new-tokens", "14", "--compare", *hot])
    assert r.exit_code == 0, r.output
    assert "tokens identical: yes" in r.stdout
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "kind": "chat"}) + "\n" for p in ["Hi there.", "Copy: a b."]))
    r = CliRunner().invoke(main, ["audit", "--target", m, "--drafter", d, "--suite", str(suite), "--max-new-tokens",
                                  "12", "--json", str(tmp_path / "a.json"), *hot])
    assert r.exit_code == 0, r.output
    audit = json.loads((tmp_path / "a.json").read_text())
    assert audit["exact"] == audit["total"] == 2 and audit["sampling"]["temperature"] == HOT
    r = CliRunner().invoke(main, ["bench", "--target", m, "--drafter", d, "--suite", str(suite), "--methods",
                                  "ar,tree-4,hf", "--max-new-tokens", "8", "--json", str(tmp_path / "b.json"), *hot])
    assert r.exit_code == 0, r.output
    bench = json.loads((tmp_path / "b.json").read_text())
    assert bench["reference"] == "the same engine's autoregression (same seed)" and not bench["mismatches"]
    assert "Sampling (temperature 60.0" in r.stdout
    r = CliRunner().invoke(main, ["bench", "--target", m, "--suite", str(suite), "--methods", "hf", *hot])
    assert r.exit_code != 0 and "add ar to --methods" in r.output
    r = CliRunner().invoke(main, ["generate", "--target", m, "--prompt", "Hi", "--temperature", "0.5",
                                  "--top-p", "1.5"])
    assert r.exit_code != 0 and "top_p must be in (0, 1]" in r.output


@pytest.mark.full
def test_seed_exact_through_an_onnx_runtime_engine(tmp_path):
    """An exported engine's GLANCE sample == the autoregressive sample (eager: an engine built with a
    drafter has no graphs for a drafter-less decoder; its graphs return the logits the walk draws from)."""
    from glance_rt.export.onnx import export_model

    target, _, processor = tiny_target("qwen2_5_vl")
    inputs = make_inputs("qwen2_5_vl", processor, n_images=1)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    export_model(target, drafter, tmp_path / "x", budgets=(6,), max_len=160, chunk=8, progress=False)
    dec = glance_rt.Decoder.from_engine(tmp_path / "x", target, drafter)
    s = glance_rt.Sampling(do_sample=True, temperature=HOT, top_p=0.9, seed=8)
    assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == ar_tokens(target, inputs, s)

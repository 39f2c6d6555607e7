"""Exact numerics: with numerics="exact" a verify pass computes every tree row's logits bit for
bit as the autoregressive step at that position does, so GLANCE commits the same engine's AR tokens in
every dtype, greedy and sampled, whatever the drafter, the budget or the lookup."""

import pytest
import torch
import torch.nn.functional as F

import glance_rt
import glance_rt.models.exact as exact
from glance_rt.models.attention import tree_attention_reference
from glance_rt.tools.numerics import row_agreement, tree_mask
from tests.conftest import OracleDrafter, extended, tiny_target
from tests.tiny_models import ARCHS, make_inputs, make_tiny

DTYPES = ["float32", "bfloat16", "float16"]
PROMPT = list(range(5, 40))
TREE = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [-1, 0, 0, 1, 1, 2, 3, 6, 7, 8, 9])  # depth up to 5
NEW = 24


def loaded(arch: str, dtype: str):
    model, processor = make_tiny(arch)
    return glance_rt.load_target(model, processor=processor, dtype=dtype), processor


def test_tree_mask_is_the_ancestor_mask():
    m = tree_mask([-1, 0, 0, 1])
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_verify_rows_are_ar_steps_bit_for_bit(arch, dtype):
    """Every row of an 11-row tree (branches, depth 5) gets the logits of the AR step at its position
    after its path is committed, bit for bit."""
    target, _ = loaded(arch, dtype)
    checks = row_agreement(target, PROMPT, *TREE, numerics="exact")
    assert all(c.equal for c in checks), [(c.row, c.max_diff) for c in checks if not c.equal]
    if dtype == "float32":  # and with oneDNN's prepacked kernels (fp32 on a CPU), called at the block's rows
        checks = row_agreement(target, PROMPT, *TREE, kernels=True, numerics="exact")
        assert all(c.equal for c in checks), [(c.row, c.max_diff) for c in checks if not c.equal]
    # as fixed-shape passes run it: every pass over all cache rows, the visible ones gathered to the front
    checks = row_agreement(target, PROMPT, *TREE, numerics="exact", static=True)
    assert all(c.equal for c in checks), [(c.row, c.max_diff) for c in checks if not c.equal]


def through_the_path_kernel(q, k, v, tree_mask, prefix_len, scale, static):
    """Exact attention as CUDA runs it (the Triton path kernel; here through Triton's interpreter), with
    splits of 32 rows so that the paths (35 prompt rows + up to 6) cross a split boundary."""
    return exact.path_attention(q, k, v, tree_mask, prefix_len, scale, 32)  # the op, as CUDA calls it


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_are_ar_steps_through_the_path_kernel(dtype, monkeypatch):
    """On CUDA exact numerics attend through the Triton path kernel (one launch a layer, no gathered
    copies): with it, every tree row's logits are the AR step's, bit for bit (passes over the fixed-length
    cache, as compiled and captured graphs run; the kernel's own tests cover calls over exact lengths)."""
    pytest.importorskip("triton", reason="triton is not installed")
    target, _ = loaded("qwen2_5_vl", dtype)  # M-RoPE: where issue 39 found bf16 rows differing
    monkeypatch.setattr(exact, "exact_attention", through_the_path_kernel)
    checks = row_agreement(target, PROMPT, *TREE, numerics="exact", static=True)
    assert all(c.equal for c in checks), [(c.row, c.max_diff) for c in checks if not c.equal]


def test_the_cuda_kernels_are_ops_that_compile_whole():
    """Exact numerics' CUDA kernels are custom ops (`glance::path_attention`, `glance::invariant_linear`):
    a compiled pass traces each as one node, with no graph break (fullgraph), and gets the kernels'
    results (run here through Triton's interpreter)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.test_attention import random_tree_mask

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    mask, prefix = random_tree_mask(5, g), torch.tensor(20)
    x, w, b = torch.randn(3, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)

    def passes(q, k, v, mask, prefix, x, w, b):
        return exact.path_attention(q, k, v, mask, prefix, 0.25, 16), exact.invariant_linear(x, w, b)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(passes, fullgraph=True, backend=backend)(q, k, v, mask, prefix, x, w, b)
    want = passes(q, k, v, mask, prefix, x, w, b)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.glance.path_attention.default in targets and torch.ops.glance.invariant_linear.default in targets
    torch.testing.assert_close(want[1], F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_row_block_linear_is_the_linear_and_row_invariant():
    """RowBlockLinear computes the layer (bias included) and a row's bits do not depend on how many rows
    come with it, in every dtype (torch's own fp32 GEMM is not: the fast path differs)."""
    from glance_rt.models.kernels import linear_invariance

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lin = torch.nn.Linear(96, 200, dtype=dtype)
        block = exact.RowBlockLinear(lin)
        x = torch.randn(2, 17, 96, generator=g).to(dtype)
        torch.testing.assert_close(block(x), lin(x), rtol=0.01, atol=0.01)
        assert block(x).shape == (2, 17, 200)
        diff = linear_invariance(lambda x, w, b=block: b(x), x[0], lin.weight, (2, 3, 8, 9, 17))
        assert set(diff.values()) == {0}, (dtype, diff)


def split_k(self, x):
    """A planted variant of RowBlockLinear whose reduction order depends on the row count: one row
    reduces over K at once, several rows in two halves summed (split-K)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows, w, b = x.reshape(-1, k), self.linear.weight, self.linear.bias
    if rows.shape[0] == 1:
        out = F.linear(rows, w, b)
    else:
        h = k // 2
        out = F.linear(rows[:, :h], w[:, :h]) + F.linear(rows[:, h:], w[:, h:])
        out = out if b is None else out + b
    return out.reshape(*lead, -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_planted_split_k_linear_is_caught(dtype, monkeypatch):
    target, _ = loaded("qwen3", dtype)
    monkeypatch.setattr(exact.RowBlockLinear, "forward", split_k)
    checks = row_agreement(target, PROMPT, *TREE, numerics="exact")
    assert not any(c.equal for c in checks)


def test_a_planted_masked_attention_is_caught(monkeypatch):
    """Attention over the whole prefix + tree with a mask (the fast path) instead of each row's own
    gathered rows: the tree's gaps enter the reduction and the rows lose the AR step's bits (fp32). A
    200-token prompt: at 35 tokens torch's AVX-512 SDPA happens to give every row the AR step's bits
    anyway (its AVX2 and scalar kernels do not), at 200 none of the three does."""
    target, _ = loaded("llama", "float32")
    monkeypatch.setattr(exact, "row_attention", tree_attention_reference)
    checks = row_agreement(target, list(range(5, 205)), *TREE, numerics="exact")
    assert not all(c.equal for c in checks)


def same_engine_ar(target, inputs, sampling, new=NEW):
    dec = glance_rt.Decoder(target, None, max_length=256, numerics="exact")
    return dec.generate(max_new_tokens=new, sampling=sampling, **inputs).token_ids


SAMPLINGS = {"greedy": glance_rt.Sampling(), "sampled": glance_rt.Sampling(do_sample=True, temperature=1.5, seed=7)}
CONFIGS = [{"tree_budget": 8, "lookup": 0}, {"tree_budget": 32, "lookup": 0}, {"tree_budget": 16, "lookup": 3},
           {"chain": True}]


def token_case(arch, dtype):
    """qwen2_5_vl in bf16 in the fast tier; every architecture in bf16 and llama in fp16 in CI's; the other
    fp16 cases in the extended (fp16 verify rows bit for bit on all nine stay: test_verify_rows_are_ar_steps_...)."""
    if (arch, dtype) == ("qwen2_5_vl", "bfloat16"):
        return pytest.param(arch, dtype)
    marks = [pytest.mark.full] + ([pytest.mark.extended] if dtype == "float16" and arch != "llama" else [])
    return pytest.param(arch, dtype, marks=marks)


TOKEN_CASES = [token_case(arch, dtype) for dtype in ("bfloat16", "float16")
               for arch in ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "llava")]


@pytest.mark.parametrize("arch,dtype", TOKEN_CASES)
def test_glance_commits_the_same_engines_ar_tokens(arch, dtype):
    """Untrained drafter, every round drafting, budgets 8 and 32, 16 + lookup, a chain; greedy and
    sampled: the tokens are the exact-numerics AR tokens (issue 39 counted 9 of 48 such runs differing
    in bf16 with the fast kernels)."""
    target, processor = loaded(arch, dtype)
    inputs = make_inputs(arch, processor, prompt="Say something long about the sea.", n_images=0)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    for name, s in SAMPLINGS.items():
        want = same_engine_ar(target, inputs, s)
        for cfg in CONFIGS:
            dec = glance_rt.Decoder(target, drafter, max_length=256, gate=False, numerics="exact", **cfg)
            assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == want, (name, cfg)


@pytest.mark.parametrize("kind", ["perfect", "decoy"])
def test_oracle_and_decoy_drafters_in_bf16(kind):
    """A drafter proposing the AR continuation itself (long acceptances: deep rows verified) and one that
    ranks a wrong token above it at every depth: both commit exactly the bf16 AR tokens."""
    target, processor = loaded("qwen2_5_vl", "bfloat16")
    inputs = make_inputs("qwen2_5_vl", processor, prompt="Tell me a story.", n_images=1)
    for s in SAMPLINGS.values():
        want = same_engine_ar(target, inputs, s, new=30)
        oracle = OracleDrafter(inputs["input_ids"].shape[1], want, target.vocab_size, block_size=6,
                               decoy=kind == "decoy")
        dec = glance_rt.Decoder(target, oracle, tree_budget=8, max_length=256, lookup=0, numerics="exact")
        res = dec.generate(max_new_tokens=30, sampling=s, **inputs)
        assert res.token_ids == want
        if kind == "perfect":
            assert res.stats.mean_accepted > 3


def test_exact_glance_and_its_ar_run_the_same_kernels():
    """In exact numerics the verifier's linears run the kernels timed at exactly the block's rows (decode
    passes) and at prefill's, laid out for the block, whatever the decoder's budgets: a GLANCE decoder and
    its AR hold the same modules, prefill's included, and commit the same tokens. With timings that favour
    oneDNN from 9 rows up they differed before: each decode block took its nearest row class's kernel (9
    rows for GLANCE, 1 for its AR), and prefill's oneDNN layouts followed the largest verify bucket (the
    bf16 bench of 2026-12-05, with bf16 prepacking tried, found 4 of 10 prompts differing)."""
    from glance_rt.models.kernels import KERNELS, KernelTuner, kernel_of

    def timer(out_f, in_f, rows, dtype):
        best = "onednn" if rows >= 9 else "mkl_t"
        return {k: 1.0 if k == best else 2.0 for k in KERNELS}

    tuner = KernelTuner(timer=timer, cache=False, pass_timer=lambda key, runs: {"plan": 1.0, "plain": 2.0},
                        prober=lambda *request: {"differs_at": 2})  # no kernel row-invariant: blocks
    target, processor = loaded("llama", "float32")  # (the kernels are chosen for fp32 weights)
    inputs = make_inputs("llama", processor, prompt="Say something long about the sea.", n_images=0)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    glance = glance_rt.Decoder(target, drafter, max_length=256, gate=False, numerics="exact", prepack=tuner)
    ar = glance_rt.Decoder(target, None, max_length=256, numerics="exact", prepack=tuner)

    def linears(dec):  # every linear layer the verifier runs: prefill's and the decode passes' blocks
        return [m for m in dec.verifier.modules() if kernel_of(m) is not None]

    blocks = [m.linear for m in glance.verifier.modules() if isinstance(m, exact.RowBlockLinear)]
    assert {kernel_of(m) for m in blocks} == {"mkl_t"}  # the choice at the block's 8 rows
    assert "onednn" in {kernel_of(m) for m in linears(glance)}  # prefill's, at 64 rows
    assert all(a is b for a, b in zip(linears(glance), linears(ar), strict=True))
    want = ar.generate(max_new_tokens=NEW, **inputs).token_ids
    assert glance.generate(max_new_tokens=NEW, **inputs).token_ids == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_numerics_run_whole_calls_of_a_kernel_proved_row_invariant(dtype):
    """Where a kernel gives, on this machine, every row of a call of 1 to 32 rows a one-row call's bits (the
    tuner's probe, per weight shape: oneDNN's prepacked kernel for fp32 weights, torch's own linear for
    bf16, which is not prepacked), exact decode passes run it in whole calls, unpadded: every tree row still
    has its AR step's logits bit for bit, and GLANCE commits its AR's tokens, greedy and sampled. A probe
    that finds a row count where the bits differ keeps the padded blocks."""
    from glance_rt.models.kernels import KERNELS, KernelTuner, kernel_of, row_invariance
    from glance_rt.tools.numerics import decoder_row_agreement

    target, processor = loaded("llama", dtype)
    inputs = make_inputs("llama", processor, prompt="Say something long about the sea.", n_images=0)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kernel = "onednn" if dtype == "float32" else "mkl"  # the one the blocks would run too
    probed = {}

    def probe(*request):
        probed[request] = row_invariance(*request)
        return probed[request]

    for prober in (probe, lambda *request: {"differs_at": 9}):
        tuner = KernelTuner(timer=lambda *req: dict.fromkeys(KERNELS, 1.0), cache=False, prober=prober,
                            pass_timer=lambda key, runs: {"plan": 1.0, "plain": 2.0})
        kw = {"max_length": 256, "numerics": "exact", "prepack": tuner}
        glance = glance_rt.Decoder(target, drafter, gate=False, lookup=0, **kw)
        ar = glance_rt.Decoder(target, None, **kw)
        proved = {r[1:3] for r, v in probed.items() if v["differs_at"] == 0} if prober is probe else set()
        blocks = [m for m in glance.verifier.modules() if isinstance(m, exact.RowBlockLinear)]
        for m in blocks:  # per weight shape, as its probe found (on some machines bf16 is invariant for some only)
            whole = (m.linear.out_features, m.linear.in_features) in proved  # (the probe's weight shape)
            assert (m.pad, m.block, kernel_of(m.linear)) == \
                ((False, exact.INVARIANT_ROWS, kernel) if whole else (True, exact.EXACT_ROWS, "mkl")), (prober, whole)
        assert blocks
        rows = decoder_row_agreement(glance, PROMPT, *TREE)
        assert all(r.equal for r in rows), (prober, rows)
        for s in SAMPLINGS.values():
            assert glance.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == \
                ar.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids, (prober, s)
    # the kernel probed, laid out for the block (oneDNN) or as it is, for calls of 1..32 rows
    assert {(r[0], r[3], *r[4:6]) for r in probed} == {(kernel, 8 if kernel == "onednn" else 0, exact.INVARIANT_ROWS,
                                                        getattr(torch, dtype))}


def test_the_row_invariance_probe_catches_a_split_k_kernel():
    """`first_difference` (the probe's verdict): a kernel that reduces one row over K at once and several
    rows in two halves (split-K) differs from 2 rows on; one whose rows are computed alone differs nowhere."""
    from glance_rt.models.kernels import first_difference

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(12, 64, generator=g)

    def split_k(x, w):
        if x.shape[0] == 1:
            return F.linear(x, w)
        return F.linear(x[:, :32], w[:, :32]) + F.linear(x[:, 32:], w[:, 32:])

    assert first_difference(split_k, x, w) == 2
    assert first_difference(lambda x, w: torch.cat([F.linear(r[None], w) for r in x]), x, w) == 0


def test_eagle3_head_in_exact_numerics():
    from tests.test_eagle3_decode import eagle3

    target, processor = loaded("qwen3", "bfloat16")
    inputs = make_inputs("qwen3", processor, prompt="Say something long about the sea.", n_images=0)
    dec = glance_rt.Decoder(target, eagle3(target, depth=3, top_k=3), tree_budget=6, max_length=256, gate=False,
                            numerics="exact")
    assert dec.method_name == "eagle3-6+always+exact"
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == same_engine_ar(target, inputs, glance_rt.Sampling())


def test_exact_numerics_are_named_and_refused_where_they_cannot_run():
    from glance_rt.method import Method

    target, _, _ = tiny_target("llama")
    for name in ("ar+exact", "tree-8+lookup+always+exact", "tree-8+exact@plain", "chain+exact"):
        m = Method.parse(name)
        assert m.numerics == "exact" and m.name == name and Method.parse(m.name) == m
    assert Method.parse("tree-8").numerics == "fast"
    dec = glance_rt.Decoder.from_method(Method.parse("tree-8+lookup+exact"), target, glance_rt.init_drafter(target))
    assert dec.numerics == "exact" and dec.method_name == "tree-8+lookup+exact"
    assert Method.parse("tree-8+exact@compile").backend == "compile"
    assert Method(numerics="exact", engine="some/engine").name == "tree-8+lookup+exact@engine:engine"
    with pytest.raises(glance_rt.GlanceError, match="unknown numerics"):
        glance_rt.Decoder(target, None, numerics="bitwise")


def test_cli_generate_exact_compares_with_exact_ar(tmp_path_factory, tmp_path):
    """`generate --exact --compare` in bf16: GLANCE with exact numerics against the same engine's exact AR."""
    from click.testing import CliRunner

    from glance_rt.cli import main
    from glance_rt.models.drafter import save_drafter
    from tests.test_cli import model_folder

    path = model_folder("qwen3", str(tmp_path_factory.mktemp("models")))
    target = glance_rt.load_target(path)
    save_drafter(glance_rt.init_drafter(target, num_layers=1, block_size=6, seed=2), tmp_path / "d")
    args = ["generate", "--target", path, "--drafter", str(tmp_path / "d"), "--prompt", "Hello there",
            "--max-new-tokens", "16", "--tree-budget", "6", "--dtype", "bfloat16", "--always-draft", "--compare",
            "--exact"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "eager, exact numerics" in result.output and "tokens identical: yes" in result.output


def test_cli_audit_exact_in_bf16_checks_against_the_exact_ar(tmp_path):
    """`audit --exact` in bf16: against the same engine's exact autoregression, every output identical."""
    import json

    from click.testing import CliRunner

    from glance_rt.cli import main
    from glance_rt.models.drafter import save_drafter

    model, processor = make_tiny("qwen2_5_vl")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    target = glance_rt.load_target(str(tmp_path / "m"))
    save_drafter(glance_rt.init_drafter(target, num_layers=1, block_size=6, seed=2), tmp_path / "d")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "kind": "chat"}) + "\n" for p in ["Hi there.", "Copy: a b c."]))
    r = CliRunner().invoke(main, ["audit", "--target", str(tmp_path / "m"), "--drafter", str(tmp_path / "d"),
                                  "--suite", str(suite), "--max-new-tokens", "16", "--dtype", "bfloat16", "--exact",
                                  "--always-draft", "--json", str(tmp_path / "a.json")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["exact"] == report["total"] == 2 and report["numerics"] == "exact"
    assert report["reference"] == "the same engine's autoregression in exact numerics"


@pytest.mark.parametrize("arch", [extended("qwen2_5_vl"), "llama"])
def test_compiled_exact_glance_is_its_compiled_ar_and_never_recompiles(arch):
    """backend="compile" with exact numerics (attention gathered to the cache's fixed length): GLANCE in
    bf16 commits the compiled exact AR's tokens, greedy and sampled, trees and lookup, rounds on the
    device too (one graph per drafted round, and AR steps as the one-row `step` graph); new prompts add no
    graph."""
    from tests.test_passes import unique_graphs

    torch._dynamo.reset()
    target, processor = loaded(arch, "bfloat16")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kw = {"max_length": 256, "backend": "compile", "chunk": 8, "numerics": "exact"}
    ar = glance_rt.Decoder(target, None, **kw)
    decs = [glance_rt.Decoder(target, drafter, gate=False, **kw, **cfg) for cfg in CONFIGS[:3]]
    decs.append(glance_rt.Decoder(target, drafter, gate=False, tree_budget=8, lookup=0, device_round=True, **kw))
    decs.append(glance_rt.Decoder(target, None, device_round=True, **kw))  # its steps: the one-row graph `step`
    for dec in (ar, *decs):
        dec.warmup()  # every graph compiled up front
    warm = unique_graphs()
    for i, prompt in enumerate(["Say something long about the sea.", "Hi", "Count the objects, then name them."]):
        inputs = make_inputs(arch, processor, prompt=prompt, n_images=0, seed=i)
        for s in SAMPLINGS.values():
            want = ar.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids
            for dec in decs:
                assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == want, (prompt, s)
    assert unique_graphs() == warm


@pytest.mark.full
@pytest.mark.extended  # 1.6 min: exact ONNX Runtime engines and exact compiled passes stay in CI's tier
def test_exact_aoti_engines_commit_their_ar_engines_tokens(tmp_path):
    """`build_engine(..., numerics="exact")` (`build-engine --exact`): the manifest records it, a load
    runs the Decoder in exact numerics, and in bf16 the GLANCE engine commits exactly the tokens of an AR
    engine built the same way, greedy and sampled; another numerics asked is refused saying why."""
    from glance_rt.engines.engine import build_engine
    from glance_rt.method import Method

    target, processor = loaded("llama", "bfloat16")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kw = {"max_len": 192, "chunk": 8, "progress": False, "flavor": "shared", "numerics": "exact"}
    build_engine(target, drafter, tmp_path / "g", budgets=(0, 8), **kw)
    build_engine(target, None, tmp_path / "a", budgets=(0,), **kw)
    import json

    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["numerics"] == "exact"
    dec = glance_rt.Decoder.from_engine(tmp_path / "g", target, drafter, gate=False, lookup=0)
    ar = glance_rt.Decoder.from_engine(tmp_path / "a", target, None)
    assert dec.numerics == ar.numerics == "exact" and dec.method_name == "tree-8+always+exact@aoti"
    for prompt in ("Say something long about the sea.", "Hi"):
        inputs = make_inputs("llama", processor, prompt=prompt, n_images=0)
        for s in SAMPLINGS.values():
            assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == \
                ar.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids, (prompt, s)
    with pytest.raises(glance_rt.GlanceError, match="built with exact numerics, fast asked"):
        glance_rt.Decoder.from_method(Method(engine=str(tmp_path / "g")), target, drafter)


def test_exact_engines_refuse_what_they_cannot_build(tmp_path):
    """TensorRT `--exact` is refused (its tactics are timed per engine); an exact onnxruntime engine takes
    one sequence and a verify graph per bucket; nothing is written."""
    from glance_rt.engines.engine import build_engine

    target, _ = loaded("llama", "float32")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kw = {"max_len": 192, "chunk": 8, "progress": False, "numerics": "exact"}
    with pytest.raises(glance_rt.GlanceError, match="built with --backend aoti or onnxruntime: TensorRT"):
        build_engine(target, drafter, tmp_path / "o", backend="tensorrt", **kw)
    for bad in ({"max_batch": 2}, {"dynamic_rows": True}):
        with pytest.raises(glance_rt.GlanceError, match="exact numerics onnxruntime engine takes one sequence"):
            build_engine(target, drafter, tmp_path / "o", backend="onnxruntime", **kw, **bad)
    assert not (tmp_path / "o").exists()


def test_visible_first_is_a_stable_sort_of_the_hidden_rows():
    """`visible_first` (the exported form of exact attention's gather) == a stable sort putting each
    row's visible cache rows first, in order: all visible, none visible, random."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.ones(3, 7, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)]
    cases += [torch.rand(t, n, generator=gen) < p for t, n, p in ((1, 1, 0.5), (4, 9, 0.3), (8, 40, 0.7), (5, 33, 0.1))]
    for seen in cases:
        order, keep = exact.visible_first(seen)
        assert torch.equal(order, torch.sort((~seen).to(torch.int8), dim=1, stable=True).indices)
        assert torch.equal(keep, torch.arange(seen.shape[1])[None] < seen.sum(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_gives_each_row_its_ar_steps_bits(dtype):
    """Eager exact attention (`row_attention`: a scratch prefix, each row's path written behind it in
    depth-first order) == the masked reference, and every row == a one-row step over its path committed
    behind the prefix, bit for bit: the test's tree, a chain, a star, and a mask whose rows see arbitrary
    earlier rows (not a tree: each row's visible rows then differ from the last row's in several places)."""
    gen = torch.Generator().manual_seed(0)
    p, heads, kv_heads, d, length = 40, 6, 2, 16, 96
    masks = [tree_mask(TREE[1]), tree_mask([-1, 0, 1, 2, 3]), tree_mask([-1, 0, 0, 0, 0])]
    seen = torch.rand(9, 9, generator=gen) < 0.5
    masks.append(torch.tril(seen, -1) | torch.eye(9, dtype=torch.bool))
    for mask in masks:
        t = mask.shape[0]
        q = torch.randn(1, heads, t, d, generator=gen).to(dtype)
        k, v = (torch.randn(1, kv_heads, length, d, generator=gen).to(dtype) for _ in range(2))
        out = exact.row_attention(q, k, v, mask, torch.tensor(p), 0.25)
        ref = tree_attention_reference(q, k, v, mask, torch.tensor(p), 0.25)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        for i in range(t):
            path = p + mask[i].nonzero()[:, 0]  # [n]: its visible tree rows, itself last
            n = p + path.numel()
            kc, vc = k.clone(), v.clone()  # the cache once its path is committed behind the prefix
            kc[:, :, p:n], vc[:, :, p:n] = k[:, :, path], v[:, :, path]
            step = exact.row_attention(q[:, :, i : i + 1], kc, vc, mask[:1, :1], torch.tensor(n - 1), 0.25)
            assert torch.equal(step[:, :, 0], out[:, :, i]), (i, mask[i].nonzero()[:, 0].tolist())


@pytest.mark.full
@pytest.mark.parametrize("arch", ["llama", extended("qwen2_5_vl")])
def test_exact_onnxruntime_engines_verify_rows_as_their_ar_steps(arch, tmp_path):
    """`build-engine --backend onnxruntime --exact` (fp32: ONNX Runtime's CPU kernels): through the engine's
    own graphs, every row of a 9-row tree (the tree-8 bucket's verify graph) has the logits of the AR step
    at its position (the one-row verify graph) bit for bit, where a fast engine's rows differ; and the
    GLANCE engine commits the tokens of an AR engine built the same way, greedy and sampled. The verify
    graphs are per bucket (dynamic rows off: a GEMM block's row count is fixed); `audit --exact` of the
    GLANCE engine, greedy and sampled, is exact."""
    import json

    from glance_rt.engines.engine import build_engine
    from glance_rt.tools.audit import audit
    from glance_rt.tools.numerics import decoder_row_agreement
    from glance_rt.tools.suites import encode_rows

    target, processor = loaded(arch, "float32")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kw = {"max_len": 192, "chunk": 8, "progress": False, "backend": "onnxruntime"}
    tokens, parents = [11, 12, 13, 14, 15, 16, 17, 18, 19], [-1, 0, 0, 1, 1, 2, 3, 5, 6]
    equal = {}
    for numerics in ("fast", "exact"):
        out = build_engine(target, drafter, tmp_path / numerics, budgets=(0, 8), numerics=numerics, **kw)
        m = json.loads((out / "manifest.json").read_text())
        assert m["numerics"] == numerics and m["dynamic_rows"] == (numerics == "fast")
        dec = glance_rt.Decoder.from_engine(out, target, drafter, gate=False, lookup=0)
        assert dec.numerics == numerics
        equal[numerics] = [c.equal for c in decoder_row_agreement(dec, PROMPT, tokens, parents)]
    assert all(equal["exact"]), equal
    assert not all(equal["fast"]), equal  # the check separates them: the fast engine's rows differ in their last bits
    ar = glance_rt.Decoder.from_engine(build_engine(target, None, tmp_path / "ar", budgets=(0,), numerics="exact",
                                                    **kw), target, None)
    assert ar.method_name == "ar+exact@onnxruntime" and dec.method_name == "tree-8+always+exact@onnxruntime"
    for prompt in ("Say something long about the sea.", "Hi"):
        inputs = make_inputs(arch, processor, prompt=prompt, n_images=0)
        for s in SAMPLINGS.values():
            assert dec.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids == \
                ar.generate(max_new_tokens=NEW, sampling=s, **inputs).token_ids, (prompt, s)
    # audit --exact: against the engine's own graphs run without the drafter (its draft graphs left unbound)
    rows = [{"prompt": p, "kind": "chat"} for p in ("Say something long about the sea.", "Hi")]
    for s in SAMPLINGS.values():
        report = list(audit(target, dec, rows, encode_rows(target, rows), NEW, progress=False, sampling=s))
        assert [r.exact for r in report] == [True, True], (s, report)

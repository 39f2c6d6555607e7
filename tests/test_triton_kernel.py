"""The Triton tree-attention kernel (plugins/tree_attention_triton.py): on CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU) against the torch reference op, and its
ahead-of-time compile (PTX + cubin for sm_80/sm_90, no GPU needed) against the TensorRT launch ABI."""

import math

import pytest
import torch

from glance_rt.models.attention import tree_attention_reference
from tests.test_attention import random_tree_mask

triton_kernel = pytest.importorskip("glance_rt.plugins.tree_attention_triton", reason="triton is not installed")

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def case(heads, kv_heads, t, prefix, d, dtype, seed, cache_rows=None):
    """q, k, v, mask for one call; cache rows past prefix + T hold NaN (the kernel must never read them)."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = cache_rows or prefix + t + 9
    q = torch.randn(1, heads, t, d, generator=gen)
    k, v = (torch.randn(1, kv_heads, kv_len, d, generator=gen) for _ in range(2))
    k[:, :, prefix + t :] = float("nan")
    v[:, :, prefix + t :] = float("nan")
    mask = random_tree_mask(t, gen)
    return [x.to(device(), dtype) for x in (q, k, v)] + [mask.to(device())]


def expected(q, k, v, mask, prefix, scale):
    seen = prefix + q.shape[2]
    q, k, v = (x.float().cpu() for x in (q, k[:, :, :seen], v[:, :, :seen]))
    return tree_attention_reference(q, k, v, mask.cpu(), torch.tensor(prefix), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (12, 2)])
@pytest.mark.parametrize("t,prefix,d", [(1, 7, 16), (1, 70, 64), (5, 0, 16), (9, 13, 8), (17, 100, 32), (24, 64, 24)])
def test_kernel_matches_reference(dtype, heads, kv_heads, t, prefix, d):
    """Random trees, GQA ratios, prefix lengths (tiles cut mid-prefix and mid-tree), head dims that
    need padding; a NaN-filled cache tail that must never be read."""
    q, k, v, mask = case(heads, kv_heads, t, prefix, d, dtype, seed=heads * 1000 + t * 10 + prefix)
    scale = 1 / math.sqrt(d)
    got = triton_kernel.tree_attention(q, k, v, mask, torch.tensor(prefix, device=q.device), scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any()
    want = expected(q, k, v, mask, prefix, scale)
    torch.testing.assert_close(got.float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_kernel_reads_cache_slices_and_transposed_queries():
    """As the model calls it: q a transposed view of [1, T, H, D] projections, k and v the first rows
    of a larger static cache (head stride max_len * D, not kv_len * D)."""
    q, k, v, mask = case(6, 2, 5, 11, 16, torch.float32, seed=3, cache_rows=64)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [1, H, T, D] view of [1, T, H, D]
    got = triton_kernel.tree_attention(q, k[:, :, :30], v[:, :, :30], mask, torch.tensor(11, device=q.device), 0.25)
    torch.testing.assert_close(got.cpu(), expected(q, k, v, mask, 11, 0.25), atol=2e-6, rtol=2e-6)


def test_kernel_sees_prefix_by_length_not_by_mask():
    """A 1-row autoregressive step ([[True]]) sees every prefix row: changing a prefix row's value
    changes the output, a row past prefix + T does not (it is NaN and never read)."""
    q, k, v, mask = case(4, 2, 1, 40, 16, torch.float32, seed=5)
    mask[:] = True
    p = torch.tensor(40, device=q.device)
    a = triton_kernel.tree_attention(q, k, v, mask, p, 0.25)
    v[:, :, 0] += 10
    b = triton_kernel.tree_attention(q, k, v, mask, p, 0.25)
    assert (a - b).abs().max() > 1e-3


# ----------------------------------------------------------------------------- split-KV


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,t,prefix,d,split_rows", [
    (4, 2, 1, 100, 16, 16),  # an AR step over 7 splits, the last one partial
    (6, 2, 9, 32, 16, 16),  # prefix on a boundary: split [32, 48) holds only tree rows
    (4, 4, 5, 13, 8, 16),  # the tree straddles a boundary; head dim padded
    (12, 2, 17, 70, 32, 32),  # a tree wider than a split; G*T = 102 rows in 64-row tiles
    (6, 1, 24, 201, 24, 64),  # MQA, 4 splits of 64, each one tile
    (4, 2, 40, 32, 16, 16),  # tree rows only from row 32: an early node sees nothing in splits [48, 72)
    (4, 2, 64, 37, 16, 32),  # the widest tree whose mask rows are read as int64 bits (bit 63 is the sign)
    (2, 1, 70, 45, 16, 64),  # wider: the mask gathered tile by tile
])
def test_split_kernel_matches_reference(dtype, heads, kv_heads, t, prefix, d, split_rows):
    """Split-KV: many splits, a split of tree rows only, GQA/MQA, padded head dims; the cache holds
    spare splits past prefix + T (NaN: a live split must stop at prefix + T, a dead one read nothing)."""
    q, k, v, mask = case(heads, kv_heads, t, prefix, d, dtype, seed=prefix + t, cache_rows=prefix + t + 3 * split_rows)
    scale = 1 / math.sqrt(d)
    got = triton_kernel.tree_attention(q, k, v, mask, torch.tensor(prefix, device=q.device), scale, split_rows)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), expected(q, k, v, mask, prefix, scale), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("t", [1, 9, 64])
@pytest.mark.parametrize("split_rows", [None, 32])
def test_tree_bits_give_the_gathered_masks_bits(t, split_rows):
    """Trees of <= 64 rows test their mask as one int64 per query row; the gather every wider tree uses
    gives the same visibility, so the same bits, direct and split, across tiles cut mid-tree."""
    q, k, v, mask = case(4, 2, t, 50, 16, torch.bfloat16, seed=t, cache_rows=50 + t + 64)
    p = torch.tensor(50, device=q.device)
    bits = triton_kernel.tree_attention(q, k, v, mask, p, 0.25, split_rows)
    gathered = triton_kernel.tree_attention(q, k, v, mask, p, 0.25, split_rows, tune={"TREE_BITS": False})
    assert torch.equal(bits, gathered)
    torch.testing.assert_close(bits.float().cpu(), expected(q, k, v, mask, 50, 0.25), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seqs,t,prefix", [(1, 1, 100), (1, 9, 32), (3, 5, 70), (2, 20, 45)])
def test_the_fused_combine_gives_the_combine_kernels_bits(dtype, seqs, t, prefix):
    """FUSED: the last live split of each query tile folds the splits itself (no combine launch): the
    same bits as split + combine, over sequences with their own prefixes, many splits and spare dead ones,
    and 64-row tiles whose fold goes in 16-row slices (40 rows: a part slice and an empty one); the
    per-tile counters are back at 0 after the call, so a second call (a graph replay) is right too."""
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(seqs, 4, t, 16, generator=gen).to(device(), dtype)
    k, v = (torch.randn(seqs, 2, prefix + t + 64, 16, generator=gen).to(device(), dtype) for _ in range(2))
    masks = torch.stack([random_tree_mask(t, gen) for _ in range(seqs)]).to(device())
    prefixes = torch.tensor([prefix - 7 * i for i in range(seqs)], device=device())
    want = triton_kernel.tree_attention(q, k, v, masks, prefixes, 0.25, 16)
    for _ in range(2):
        got = triton_kernel.tree_attention(q, k, v, masks, prefixes, 0.25, 16, tune={"FUSED": True})
        assert torch.equal(got, want)
        assert not triton_kernel._COUNTERS[str(q.device)].any()


def test_the_fused_combine_refuses_tiles_it_cannot_slice():
    q, k, v, mask = case(4, 2, 3, 40, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_kernel.tree_attention(q, k, v, mask, torch.tensor(40), 0.25, 16, block_m=8, tune={"FUSED": True})


def test_split_kernel_default_splits_a_long_cache():
    """The op's own default (SPLIT_ROWS) at a cache of several splits, through the named op's launcher."""
    s = triton_kernel.SPLIT_ROWS
    q, k, v, mask = case(8, 2, 3, 2 * s + 5, 16, torch.float32, seed=11, cache_rows=4 * s)
    got = triton_kernel.tree_attention(q, k, v, mask, torch.tensor(2 * s + 5, device=q.device), 0.25)
    torch.testing.assert_close(got.cpu(), expected(q, k, v, mask, 2 * s + 5, 0.25), atol=2e-6, rtol=2e-6)


def test_one_live_split_equals_the_direct_kernel_bit_for_bit():
    """Folding one split is exact (e^(-1e30 - m) = 0, e^0 = 1): a call whose rows fit the first split
    gives the direct kernel's bits, which is why a cache of <= SPLIT_ROWS rows runs the direct kernel."""
    q, k, v, mask = case(4, 2, 6, 20, 16, torch.float32, seed=4, cache_rows=128)
    p = torch.tensor(20, device=q.device)
    split = triton_kernel.tree_attention(q, k, v, mask, p, 0.25, split_rows=32, block_m=16)
    direct = triton_kernel.tree_attention(q, k, v, mask, p, 0.25, split_rows=None)
    assert torch.equal(split, direct)


@pytest.mark.parametrize("split_rows", [16, 32])
def test_split_boundaries_are_fixed_by_cache_rows(split_rows):
    """A verify row and an autoregressive step at the same position reduce in the same order: row i of a
    chain verified at prefix P equals, bit for bit, a one-row step at prefix P + i over the same cache
    (same tile of query rows, `block_m`, so only the split and tile boundaries are under test)."""
    t, prefix = 7, 29
    q, k, v, mask = case(4, 2, t, prefix, 16, torch.float32, seed=8, cache_rows=prefix + t + 40)
    k, v = k.nan_to_num(1.0), v.nan_to_num(1.0)  # every row real: the step's view of the cache
    chain = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    verify = triton_kernel.tree_attention(q, k, v, chain, torch.tensor(prefix, device=q.device), 0.25, split_rows,
                                          block_m=16)
    one = torch.ones(1, 1, dtype=torch.bool, device=q.device)
    for i in range(t):
        step = triton_kernel.tree_attention(q[:, :, i : i + 1], k, v, one, torch.tensor(prefix + i, device=q.device),
                                            0.25, split_rows, block_m=16)
        assert torch.equal(step, verify[:, :, i : i + 1]), i


@pytest.mark.parametrize("tune", [{"BLOCK_N": 16}, {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3}])
def test_tuned_launches_match_the_reference(tune):
    """gpu_check's sweep launches (other tile rows, warps, stages), split and direct: still the op."""
    q, k, v, mask = case(6, 2, 5, 45, 16, torch.float32, seed=12, cache_rows=96)
    p = torch.tensor(45, device=q.device)
    want = expected(q, k, v, mask, 45, 0.25)
    for split_rows in (32, None):
        got = triton_kernel.tree_attention(q, k, v, mask, p, 0.25, split_rows, tune=tune)
        torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split_rows", [None, 16])
def test_a_batch_is_one_launch_with_each_sequences_own_result(dtype, split_rows):
    """A batched call (`glance_rt.round.batch`): three sequences with their own prefix lengths (one 0) and
    trees, k and v the first slots of a slot-major cache [slots, KVH, L, D] (as `KVCache` holds them), the
    cache's other rows NaN. Each sequence's result == its own call's, bit for bit
    (the same programs), and == the reference; a sequence reading another's slot would read NaN."""
    slots, rows, kv_heads, heads, d, t = 4, 80, 2, 6, 16, 5
    gen = torch.Generator().manual_seed(21)
    prefixes = [40, 0, 7]
    cache_k, cache_v = (torch.full((slots, kv_heads, rows, d), float("nan")) for _ in range(2))
    for s, p in enumerate(prefixes):
        for c in (cache_k, cache_v):
            c[s, :, : p + t] = torch.randn(kv_heads, p + t, d, generator=gen)
    views = [c.to(device(), dtype)[:3] for c in (cache_k, cache_v)]  # [3, KVH, L, D]
    q = torch.randn(3, heads, t, d, generator=gen).to(device(), dtype)
    masks = torch.stack([random_tree_mask(t, gen) for _ in prefixes]).to(device())
    rows = torch.tensor(prefixes, device=q.device)[:, None] + torch.arange(t, device=q.device)  # [3, T]
    prefix = rows[:, 0]  # as the model passes it: a column of the batch's cache rows (not contiguous)
    got = triton_kernel.tree_attention(q, *views, masks, prefix, 0.25, split_rows)
    assert got.shape == q.shape and not got.isnan().any()
    for s, p in enumerate(prefixes):
        k, v = (x[s : s + 1] for x in views)
        alone = triton_kernel.tree_attention(q[s : s + 1], k, v, masks[s], prefix[s], 0.25, split_rows)
        assert torch.equal(got[s : s + 1], alone), s
        torch.testing.assert_close(got[s : s + 1].float().cpu(), expected(q[s : s + 1], k, v, masks[s], p, 0.25),
                                   atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("seqs", [1, 3])
def test_the_plugins_launch_runs_what_a_graph_hands_it(seqs):
    """The TensorRT plugin launches the direct kernel with `direct_launch`'s grid and extras, computed from
    the node's input shapes alone (B, H, T, KVH, L), over the packed tensors a graph hands it: a batch's
    cache slots as one dense [B, KVH, L, D], one sequence's mask [T, T] and prefix a scalar. Run through
    the interpreter with integer shapes, each sequence's result is the op's own on that sequence, bit
    for bit (so KV_BATCH = KVH * L is the packed sequence stride and the grid covers every row)."""
    heads, kv_heads, t, d, rows = 6, 2, 5, 16, 48
    gen = torch.Generator().manual_seed(5)
    prefixes = [30, 0, 11][:seqs]
    q = torch.randn(seqs, heads, t, d, generator=gen).to(device())
    k, v = (torch.randn(seqs, kv_heads, rows, d, generator=gen).to(device()) for _ in range(2))
    masks = torch.stack([random_tree_mask(t, gen) for _ in prefixes]).to(device())
    prefix = torch.tensor(prefixes, device=q.device)
    if seqs == 1:
        masks, prefix = masks[0], prefix[0]  # one sequence: [T, T] and a scalar, as a one-sequence graph has them
    tiles = triton_kernel.blocks(d, "float32")
    grid, extras = triton_kernel.direct_launch(seqs, heads, t, kv_heads, rows, tiles["BLOCK_M"])
    out = torch.empty_like(q)
    triton_kernel.tree_attention_kernel[grid](q, k, v, masks, prefix, *extras, out, SCALE=0.25,
                                              GROUPS=heads // kv_heads, HEAD_DIM=d, **tiles,
                                              num_warps=triton_kernel.NUM_WARPS, num_stages=1)
    for s in range(seqs):
        mask, p = (masks, prefix) if seqs == 1 else (masks[s], prefix[s])
        alone = triton_kernel.tree_attention(q[s : s + 1], k[s : s + 1], v[s : s + 1], mask, p, 0.25, None)
        assert torch.equal(out[s : s + 1], alone), s


def test_split_rows_must_be_a_power_of_two():
    q, k, v, mask = case(4, 2, 1, 10, 16, torch.float32, seed=1)
    for bad in (8, 48):
        with pytest.raises(ValueError, match="power of two"):
            triton_kernel.tree_attention(q, k, v, mask, torch.tensor(10), 0.25, split_rows=bad)


def run_without_interpreter(code: str, *args: str):
    """Run `code` in a Python process without TRITON_INTERPRET (the interpreter replaces Triton's
    language, so nothing compiles beside it) -> the JSON its last line of output prints."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


AOT_CASES = [(arch, dtype, 128) for arch in (80, 90) for dtype in ("float32", "float16", "bfloat16")]
AOT_CASES += [(90, dtype, d) for dtype in ("float32", "bfloat16") for d in (64, 80, 256)]


@pytest.fixture(scope="module")
def compiled():
    """`compile_aot` of every case, in a process without TRITON_INTERPRET (the interpreter replaces
    Triton's language, so nothing compiles beside it): (arch, dtype, head_dim) -> `describe`."""
    import json

    code = ("import json, sys\nfrom glance_rt.plugins import tree_attention_triton as m\n"
            "out = {}\nfor arch, dtype, d in json.loads(sys.argv[1]):\n"
            "    out[f'{arch}-{dtype}-{d}'] = m.describe(m.compile_aot(dtype, d, 8, d ** -0.5, arch))\n"
            "print(json.dumps(out))")
    out = run_without_interpreter(code, json.dumps(AOT_CASES))
    return {tuple(int(x) if x.isdigit() else x for x in k.split("-")): v for k, v in out.items()}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_aot_compile_matches_plugin_abi(compiled, arch, dtype):
    """`triton.compile` for sm_80/sm_90 with no GPU (ptxas runs: a cubin comes out), pinned PTX ISA;
    the entry's parameters are the ABI's in order, then only zero-sized hidden scratch pointers."""
    k = compiled[arch, dtype, 128]
    types = triton_kernel.check_abi(k["ptx"], k["name"], k["shared"], k["scratch"])
    assert types[:9] == ["u64"] * 5 + ["u32"] * 3 + ["u64"]
    assert k["scratch"] == {"global_scratch_size": 0, "profile_scratch_size": 0}
    v = triton_kernel.PTX_VERSION
    assert f".target sm_{arch}" in k["ptx"] and f".version {v // 10}.{v % 10}" in k["ptx"]
    assert k["cubin_bytes"] > 0
    assert f".reqntid {k['num_warps'] * 32}" in k["ptx"]


@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_aot_shared_memory_fits_without_opt_in(compiled, head_dim, dtype):
    k = compiled[90, dtype, head_dim]
    assert k["shared"] <= 48 * 1024
    triton_kernel.check_abi(k["ptx"], k["name"], k["shared"], k["scratch"])


def test_check_abi_rejects_a_mismatch(compiled):
    """check_abi can fail: a kernel whose T parameter was specialised away, or that needs scratch."""
    k = compiled[90, "float16", 128]
    ptx = k["ptx"]
    dropped = ptx.replace(f".param .u32 {k['name']}_param_5,", "", 1)
    assert dropped != ptx
    with pytest.raises(ValueError, match="do not start with"):
        triton_kernel.check_abi(dropped, k["name"], k["shared"], k["scratch"])
    with pytest.raises(ValueError, match="scratch memory"):
        triton_kernel.check_abi(ptx, k["name"], k["shared"], {**k["scratch"], "global_scratch_size": 128})
    with pytest.raises(ValueError, match="shared memory"):
        triton_kernel.check_abi(ptx, k["name"], 64 * 1024, k["scratch"])


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plugin_ptx_assembles_with_exactly_the_abi(compiled, arch, dtype, tmp_path):
    """The PTX the TensorRT plugin ships: renamed entry, hidden scratch parameters dropped, exactly the
    ABI's parameters; CUDA's own ptxas (not Triton's) still assembles it for the GPU."""
    import re
    import shutil
    import subprocess

    k = compiled[arch, dtype, 128]
    ptx = triton_kernel.plugin_ptx(k, "glance_tree_attention_test")
    types = triton_kernel.check_abi(ptx, "glance_tree_attention_test", k["shared"], k["scratch"])
    assert types == ["u64"] * 5 + ["u32"] * 3 + ["u64"]
    assert not re.search(rf"\b{k['name']}\b", ptx)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas (CUDA toolkit) on PATH")
    (tmp_path / "k.ptx").write_text(ptx)
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    run = subprocess.run([ptxas, f"-arch={sm}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


def test_plugin_ptx_refuses_a_body_that_reads_a_hidden_parameter(compiled):
    k = compiled[90, "float16", 128]
    hidden = f"{k['name']}_param_9"
    assert hidden in k["ptx"]
    body = k["ptx"].replace("ret;", f"ld.param.u64 %rd999, [{hidden}];\n\tret;", 1)
    with pytest.raises(ValueError, match="reads hidden parameter 9"):
        triton_kernel.plugin_ptx({**k, "ptx": body}, "x")


def test_split_kernels_compile_ahead_of_time():
    """The split and combine kernels lower to PTX and assemble (cubin) for sm_80 and sm_90 with no GPU,
    where the interpreter alone would not catch what only the compiler refuses."""
    code = ("import json\nfrom glance_rt.plugins import tree_attention_triton as m\nout = []\n"
            "for arch, dtype, d, bm in [(90, 'bfloat16', 128, 64), (80, 'float32', 64, 16)]:\n"
            "    for k in m.compile_split_aot(dtype, d, 7, d ** -0.5, arch, m.SPLIT_ROWS, bm):\n"
            "        out.append([k.metadata.name, len(k.asm['cubin']), f'.target sm_{arch}' in k.asm['ptx']])\n"
            "print(json.dumps(out))")
    got = run_without_interpreter(code)
    assert [name for name, _, _ in got] == ["tree_attention_split_kernel", "tree_attention_combine_kernel"] * 2
    assert all(cubin > 0 and target for _, cubin, target in got)


def test_the_ops_split_launches_do_not_spill_registers():
    """At a 7B's attention shapes (bf16, sm_90, pointers aligned as the JIT assumes), the op's default split
    launch for an AR step (16 query rows a program) and a 64-row verify (64) spills no register, nor does
    it with the opt-in fused combine (whose fold of a whole 64-row tile spilled), and the tree mask read
    as bits needs fewer registers than the gathered one (the gather spilled at 64 rows:
    scripts/kernel_resources.py). ptxas, not a timing: a spilling kernel is slow on every GPU."""
    code = ("import json\nfrom glance_rt.plugins import tree_attention_triton as m\nout = {}\n"
            "for t in (1, 64):\n"
            "    for bits, fused in ((True, False), (False, False), (True, True)):\n"
            "        k, _ = m.compile_split_aot('bfloat16', 128, 7, 128 ** -0.5, 90, m.SPLIT_ROWS,\n"
            "                                   m.split_block_m(7 * t), bits, aligned=True, fused=fused)\n"
            "        out[f'{t}-{bits}-{fused}'] = m.ptxas_resources(k.asm['ptx'])\n"
            "print(json.dumps(out))")
    got = run_without_interpreter(code)
    for t in (1, 64):
        bits, gathered, fused = got[f"{t}-True-False"], got[f"{t}-False-False"], got[f"{t}-True-True"]
        for launch in (bits, fused):
            assert launch["spill_stores"] == launch["spill_loads"] == 0, (t, launch)
        assert bits["registers"] < gathered["registers"], (t, bits, gathered)


# ----------------------------------------------------------------------------- exact numerics: the path kernel


def path_case(heads, kv_heads, t, prefix, d, dtype, seed):
    """q, k, v, mask, prefix for a tree call whose cache is NaN past prefix + T."""
    q, k, v, mask = case(heads, kv_heads, t, prefix, d, dtype, seed, cache_rows=prefix + t + 40)
    return q, k, v, mask, torch.tensor(prefix, device=q.device)


def committed(k, v, mask, prefix: int, row: int):
    """The cache an autoregressive step at `row`'s position reads once its path is committed: its ancestors'
    K/V rows moved together after the prefix (as the commit moves accepted rows), NaN after its own;
    -> (k, v, the step's prefix length)."""
    path = prefix + mask[row].nonzero()[:, 0]  # [n] cache rows: ancestors, itself
    out = []
    for c in (k, v):
        c = c.clone()
        c[:, :, prefix : prefix + len(path)] = c[:, :, path]
        c[:, :, prefix + len(path) :] = float("nan")
        out.append(c)
    return *out, prefix + len(path) - 1


def rows_equal_to_their_ar_steps(q, k, v, mask, prefix, split_rows, exact=True, tune=None) -> list[bool]:
    """For every row of a tree call: is its result, bit for bit, the one-row call at its position over the
    cache with its path committed (both with launch settings `tune`)?"""
    scale = q.shape[3] ** -0.5
    tree = triton_kernel.tree_attention(q, k, v, mask, prefix, scale, split_rows, exact=exact, tune=tune)
    one = torch.ones(1, 1, dtype=torch.bool, device=q.device)
    same = []
    for row in range(q.shape[2]):
        k1, v1, p = committed(k, v, mask, int(prefix), row)
        step = triton_kernel.tree_attention(q[:, :, row : row + 1], k1, v1, one, torch.tensor(p, device=q.device),
                                            scale, split_rows, exact=exact, tune=tune)
        same.append(torch.equal(step[:, :, 0], tree[:, :, row]))
    return same


PATH_CASES = [  # heads, kv_heads, T, prefix, head dim, split rows
    (4, 2, 9, 13, 16, None),  # the direct form: one program per row walks the whole path
    (8, 2, 17, 100, 32, 32),  # paths cross split and tile boundaries that the tree's rows do not
    (6, 1, 24, 60, 16, 16),  # MQA, many splits, rows deeper than a split
    (20, 1, 12, 250, 24, 64),  # G = 20: two head tiles per row; head dim padded
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,t,prefix,d,split_rows", PATH_CASES)
def test_path_kernel_rows_are_their_ar_steps_bit_for_bit(dtype, heads, kv_heads, t, prefix, d, split_rows):
    """Exact numerics (issue 39): every row of a random tree gets, bit for bit, what the one-row call at its
    position gets over the cache with its path committed (ancestors moved together, as the commit does),
    and both are the op (the reference's values); the NaN past each call's rows is never read."""
    q, k, v, mask, p = path_case(heads, kv_heads, t, prefix, d, dtype, seed=heads + t + prefix)
    got = triton_kernel.tree_attention(q, k, v, mask, p, d**-0.5, split_rows, exact=True)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), expected(q, k, v, mask, prefix, d**-0.5), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert all(rows_equal_to_their_ar_steps(q, k, v, mask, p, split_rows))


@pytest.mark.parametrize("path_rows", [2, 4])
@pytest.mark.parametrize("heads,kv_heads,t,prefix,d,split_rows", PATH_CASES)
def test_path_programs_of_several_rows_give_each_row_its_ar_steps_bits(heads, kv_heads, t, prefix, d, split_rows,
                                                                       path_rows):
    """PATH_ROWS (opt-in): a program serves several query rows, reading the prefix tiles their paths share
    once, each row's dots at the program's one shape (an AR step fills one row of it): every row still gets
    its AR step's bits (the AR step at the same PATH_ROWS), and the op's values; T not a multiple of it
    leaves a part group. Here the interpreter's dot is row by row (`interpreter_dot`): that a GPU's MMA
    gives a row the same bits at any row slot is for the GPU check (`path_rows_equal_their_ar_steps`)."""
    q, k, v, mask, p = path_case(heads, kv_heads, t, prefix, d, torch.bfloat16, seed=heads + t + prefix)
    tune = {"PATH_ROWS": path_rows}
    got = triton_kernel.tree_attention(q, k, v, mask, p, d**-0.5, split_rows, exact=True, tune=tune)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), expected(q, k, v, mask, prefix, d**-0.5), atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])
    assert all(rows_equal_to_their_ar_steps(q, k, v, mask, p, split_rows, tune=tune))


def test_the_fast_kernel_fails_the_path_check():
    """The same check catches a kernel that is not row-exact: the fast tiles (a row's ancestors at their
    tree rows, other branches masked between them) give some row other bits than its AR step."""
    for heads, kv_heads, t, prefix, d, split_rows in PATH_CASES[:2]:
        q, k, v, mask, p = path_case(heads, kv_heads, t, prefix, d, torch.float32, seed=heads + t + prefix)
        assert not all(rows_equal_to_their_ar_steps(q, k, v, mask, p, split_rows, exact=False))


@pytest.mark.parametrize("split_rows", [None, 16])
def test_path_kernel_over_a_batch_gives_each_sequence_its_own_bits(split_rows):
    """Batched (issue 40's layout: slot-major cache views, prefix a column of the rows): one launch, each
    sequence's result its own call's, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    slots, kv_heads, heads, rows, d, t = 3, 2, 4, 90, 16, 6
    k, v = (torch.randn(slots + 1, kv_heads, rows, d, generator=gen).to(device()) for _ in range(2))
    q = torch.randn(slots, heads, t, d, generator=gen).to(device())
    masks = torch.stack([random_tree_mask(t, gen) for _ in range(slots)]).to(device())
    prefix = (torch.tensor([[0], [33], [70]], device=q.device) + torch.arange(t, device=q.device))[:, 0]
    for tune in (None, {"PATH_ROWS": 4}):
        got = triton_kernel.tree_attention(q, k[:slots], v[:slots], masks, prefix, 0.25, split_rows, exact=True,
                                           tune=tune)
        for s in range(slots):
            alone = triton_kernel.tree_attention(q[s : s + 1], k[s : s + 1], v[s : s + 1], masks[s], prefix[s], 0.25,
                                                 split_rows, exact=True, tune=tune)
            assert torch.equal(got[s : s + 1], alone), (s, tune)


def test_path_kernel_compiles_ahead_of_time():
    """The path kernel, split and direct forms, lowers to PTX and assembles for sm_80 and sm_90 with no GPU."""
    code = ("import json\nfrom glance_rt.plugins import tree_attention_triton as m\nout = []\n"
            "for arch, dtype, d, partial, bt, rows in [(90, 'bfloat16', 128, True, 64, 1),\n"
            "                                          (80, 'float32', 64, False, 16, 1),\n"
            "                                          (90, 'bfloat16', 128, True, 64, 2)]:\n"
            "    k = m.compile_path_aot(dtype, d, 7, d ** -0.5, arch, m.SPLIT_ROWS, partial, bt, True, rows)\n"
            "    out.append([k.metadata.name, len(k.asm['cubin']), f'.target sm_{arch}' in k.asm['ptx'],\n"
            "                m.ptxas_resources(k.asm['ptx'])])\n"
            "print(json.dumps(out))")
    got = run_without_interpreter(code)
    assert [name for name, *_ in got] == ["tree_attention_path_kernel"] * 3
    assert all(cubin > 0 and target for _, cubin, target, _ in got)
    split_one, split_two = got[0][3], got[2][3]  # the op's split launch at 1 and 2 query rows a program
    assert split_one["spill_stores"] == split_two["spill_stores"] == 0, (split_one, split_two)

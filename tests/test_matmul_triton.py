"""The row-invariant Triton matmul (plugins/matmul_triton.py) through Triton's interpreter
(conftest sets TRITON_INTERPRET=1 without a GPU): it computes the linear layer, a row gets the same bits
whatever the number of rows in the call, and a planted split-K variant fails that same check."""

import pytest
import torch
import torch.nn.functional as F

from glance_rt.models.kernels import linear_invariance

mm = pytest.importorskip("glance_rt.plugins.matmul_triton", reason="triton is not installed")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
ROWS = (2, 3, 9, 17, 33)  # one tile of 16 rows, a tile and a part, three tiles


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def case(dtype, n=88, k=72, rows=33, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device())
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(device())
    b = torch.randn(n, generator=g).to(dtype).to(device()) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_it_is_the_linear_layer(dtype, bias):
    """N and K not multiples of the tiles (88 x 72 against 16 x 128/256), a leading batch shape."""
    x, w, b = case(dtype, bias=bias)
    got = mm.invariant_linear(x.reshape(3, 11, -1), w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (3, 11, 88) and got.dtype == dtype
    torch.testing.assert_close(got.reshape(33, -1).float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(dtype):
    x, w, b = case(dtype)
    diff = linear_invariance(lambda x, w: mm.invariant_linear(x, w, b), x, w, ROWS)
    assert set(diff.values()) == {0}, diff


@triton.jit
def split_k_kernel(x, w, bias, out, M, N, K, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The planted variant: like the real kernel, but a call of more than one row sums K in two halves
    (split-K, as GEMM libraries do for some row counts), so a row's reduction order depends on M."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    half = tl.cdiv(tl.cdiv(K, BLOCK_K), 2) * BLOCK_K if M > 1 else K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if k0 < half:
            lo = tl.dot(a, b, lo, input_precision=PRECISION)
        else:
            hi = tl.dot(a, b, hi, input_precision=PRECISION)
    acc = lo + hi
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=inside)


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_a_planted_split_k_variant_is_caught(dtype):
    """Still the linear layer (to rounding), but no longer row-invariant: the check sees it. In fp32:
    the interpreter's fp16/bf16 `tl.dot` rounds each tile's product to 16 bits, whose fp32 sums are
    exact in any order, so a split cannot show there (on a GPU the MMA accumulates in fp32)."""
    x, w, b = case(dtype, k=512)  # 4 K tiles: halves of 2 sum in another order
    got = mm.invariant_linear(x, w, b, kernel=split_k_kernel)
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, rtol=0.01, atol=0.01 * float(want.abs().max()))
    diff = linear_invariance(lambda x, w: mm.invariant_linear(x, w, b, kernel=split_k_kernel), x, w, ROWS)
    assert any(diff.values()), diff


def test_aot_compile_for_sm80_and_sm90():
    """`triton.compile` for sm_80/sm_90 with no GPU, in a process without TRITON_INTERPRET: PTX and a
    cubin for every dtype (the tiles are fixed per dtype: one compile each)."""
    from tests.test_triton_kernel import run_without_interpreter

    code = ("import json, torch\nfrom glance_rt.plugins import matmul_triton as m\nout = {}\n"
            "for arch in (80, 90):\n    for dt in (torch.float32, torch.float16, torch.bfloat16):\n"
            "        k = m.compile_aot(dt, True, arch)\n"
            "        out[f'{arch}-{dt}'] = [f'.target sm_{arch}' in k.asm['ptx'], len(k.asm['cubin'])]\n"
            "print(json.dumps(out))")
    out = run_without_interpreter(code)
    assert len(out) == 6 and all(target and cubin > 0 for target, cubin in out.values()), out


def test_a_one_row_call_fills_a_gpu_and_spills_nothing():
    """An AR step's linears are one-row calls: at the 3B's down projection ([2048, 11008]) the bf16 tiles
    give 128 programs (the tiles before 2026-12-06: 32, a quarter of an H200's 132 SMs, each walking all
    of K); compiled for sm_90 as the JIT compiles a launch on torch tensors, the default configs spill no
    register and pipeline their loads (cp.async)."""
    from tests.test_triton_kernel import run_without_interpreter

    assert mm.grid(1, 2048, mm.CONFIGS[torch.bfloat16]) == (1, 128)
    assert mm.grid(64, 2048, mm.CONFIGS[torch.bfloat16]) == (4, 128)
    code = ("import json, torch\nfrom glance_rt.plugins import matmul_triton as m\n"
            "from glance_rt.plugins.tree_attention_triton import ptxas_resources\nout = {}\n"
            "for dt in (torch.float32, torch.bfloat16):\n"
            "    k = m.compile_aot(dt, False, 90, aligned=True)\n"
            "    out[str(dt)] = [ptxas_resources(k.asm['ptx']), 'cp.async' in k.asm['ptx']]\n"
            "print(json.dumps(out))")
    for dtype, (res, pipelined) in run_without_interpreter(code).items():
        assert res["spill_stores"] == res["spill_loads"] == 0 and pipelined, (dtype, res)

"""A row-invariant matmul on GPUs: out = x @ w.T (+ bias), where every output element is
reduced over K in one fixed order, whatever the number of rows M in the call.

GEMM libraries pick tiles, split-K and even the algorithm by M, so a row computed among T verify rows
and the same row alone (an autoregressive step) can differ in their last bits. Here one program per
(BLOCK_M rows, BLOCK_N columns) tile walks K from 0 up in BLOCK_K steps, accumulating in fp32 with
`tl.dot`; the tile sizes, warps and stages are fixed per dtype (never chosen by M), there is no split-K,
and a row's result depends only on its own x row and the weights: the same bits in a call of 1 row or
of 33. The bias is added once to the fp32 sum, then the result is rounded to the output dtype.

fp32 multiplies in IEEE fp32 (no TF32); fp16/bf16 multiply in their type and accumulate in fp32.
Exact numerics run it for every linear layer of a decode pass on CUDA (`glance_rt.models.exact`);
on a CPU they use torch's GEMM at a fixed row count instead. Tested through Triton's interpreter
(tests/test_matmul_triton.py: against F.linear, row invariance across M, and a planted split-K variant
that the same check catches); not yet run on a GPU.
"""

import torch
import triton
import triton.language as tl

# Launch settings per dtype. The tiles are part of the reduction order, so they are fixed, never chosen
# per call. Narrow column tiles and long K tiles give a one-row call enough programs to read the weights
# at the GPU's bandwidth: a [2048, 11008] down projection runs 128 programs (64-column tiles: 32, a
# quarter of an H200's SMs, each walking all of K with 8 KiB in flight), each keeping 3 K tiles of its
# 16 weight rows in flight. sm_90, bf16 (`ptxas`, as the JIT compiles a launch on torch tensors): 48
# registers, 48 KiB of shared memory, no spills. At 64 rows the 4 row tiles of a column tile run side
# by side and share its weights through L2.
CONFIGS = {torch.float32: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=4),
           torch.float16: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
           torch.bfloat16: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)}


@triton.jit
def invariant_matmul_kernel(x, w, bias, out, M, N, K, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [M, K], w [N, K], bias [N], out [M, N], all contiguous; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in one order: 0, BK, 2*BK, ...
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN] += [BM, BK] @ [BK, BN]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=inside)


def grid(rows: int, out_features: int, config: dict) -> tuple:
    """Programs of a call: (row tiles, column tiles); row tiles vary fastest, so those of one column tile
    run side by side and read its weights once from memory, then from L2."""
    return triton.cdiv(rows, config["BLOCK_M"]), triton.cdiv(out_features, config["BLOCK_N"])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     kernel=invariant_matmul_kernel, config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N], row-invariant (`kernel`: the Triton kernel
    launched, the same signature; a test plants another). `config`: launch settings instead of the
    dtype's `CONFIGS` (the GPU check's sweep; every call of one decoder must use the same)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    m, n = rows.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = config or CONFIGS[x.dtype]
    kernel[grid(m, n, cfg)](rows, weight.contiguous(), bias if bias is not None else rows, out, m, n, k,
                 HAS_BIAS=bias is not None, PRECISION="ieee", **cfg)
    return out.reshape(*lead, n)


def compile_aot(dtype: torch.dtype, has_bias: bool = True, arch: int = 90, config: dict | None = None,
                aligned: bool = False):
    """The kernel compiled ahead of time for GPUs of compute capability `arch` (80: A100, 90: H100/H200),
    with no GPU (as `tree_attention_triton.compile_aot`): proof that it lowers to PTX and assembles.
    `aligned`: as Triton's JIT specialises a launch on torch tensors with N and K multiples of 16 (what
    `ptxas_resources` should read)."""
    from glance_rt.plugins.tree_attention_triton import DTYPES, _compile

    ty = DTYPES[str(dtype).removeprefix("torch.")]
    cfg = dict(config or CONFIGS[dtype])
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    signature = {"x": f"*{ty}", "w": f"*{ty}", "bias": f"*{ty}", "out": f"*{ty}", "M": "i32", "N": "i32", "K": "i32"}
    constexprs = {"HAS_BIAS": has_bias, "PRECISION": "ieee", **cfg}
    return _compile(invariant_matmul_kernel, signature, constexprs, arch, stages, warps, aligned, ("N", "K"))

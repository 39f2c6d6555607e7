"""Tree attention on GPUs: ONE Triton kernel, the CUDA implementation of `glance::tree_attention`
(torch, eager and compiled) and the kernel the TensorRT plugin bakes into its engines.

Contract (as `glance_rt.models.attention.tree_attention_reference`): query rows t < T of head h see
cache rows j < prefix_len, and rows prefix_len + i where tree_mask[t, i]; every other row is
invisible. The kernel reads prefix_len from device memory and loops over cache rows [0, prefix_len + T)
only: no host sync (a CUDA graph captures it), and the cache tail past the queries' own rows is never
read. Flash-style (online softmax over BLOCK_N-row tiles, fp32 accumulators, one pass over K and V);
grouped-query heads are folded, so one program reads each K/V tile once for the G query heads that
share it.

Launch ABI (TensorRT's AOT plugin order: input pointers, int32 extras, output pointers):

    tree_attention_kernel(q, k, v, tree_mask, prefix_len, T, KV_ROWS, out)
      q          *dtype  [1, H, T, D] contiguous
      k, v       *dtype  [1, KVH, KV_ROWS, D] contiguous (only the first prefix_len + T rows are read)
      tree_mask  *i1     [T, T] (torch.bool: one byte per entry)
      prefix_len *i64    [] on the device
      T, KV_ROWS i32     queries per head; cache rows per KV head (the head stride, in rows)
      out        *dtype  [1, H, T, D] contiguous
    constexprs: GROUPS = H // KVH, HEAD_DIM = D, SCALE, BLOCK_M, BLOCK_N, BLOCK_D
    grid: (cdiv(GROUPS * T, BLOCK_M), KVH, 1); block: num_warps * 32 threads

fp32 runs its dot products in IEEE fp32 (no TF32): fp32 output must match the reference, whose
tokens equal Hugging Face's. fp16/bf16 multiply in their dtype and accumulate in fp32.
"""

import triton
import triton.language as tl

ABI = ("q", "k", "v", "tree_mask", "prefix_len", "T", "KV_ROWS", "out")  # the kernel's runtime parameters
INPUTS, EXTRAS, OUTPUTS = ABI[:5], ABI[5:7], ABI[7:]
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # torch dtype name -> Triton type
NUM_WARPS = 4
PTX_VERSION = 87  # Triton 3.9's default PTX ISA (9.4) is newer than CUDA 13.0's ptxas takes: pin one both know


def blocks(head_dim: int, dtype: str) -> dict:
    """Tile sizes: BLOCK_D pads the head dim to a power of two (tl.dot needs >= 16 on every side);
    BLOCK_N keeps shared memory within the 48 KiB a launch gets without opting in (TensorRT launches
    AOT kernels with the shared_mem the plugin declares)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = (4 if dtype == "float32" else 2) * block_d  # bytes per cache row of one K or V tile
    return dict(BLOCK_M=16, BLOCK_N=64 if wide <= 256 else 32 if wide <= 512 else 16, BLOCK_D=block_d)


def stages(head_dim: int, dtype: str) -> int:
    """Software-pipelining depth: 1 (no prefetch) where a second K/V tile would pass 48 KiB."""
    return 1 if (4 if dtype == "float32" else 2) * head_dim > 512 else 2


@triton.jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, prefix_ptr, T, KV_ROWS, out_ptr,
                          GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    kvh = tl.program_id(1)
    rows = GROUPS * T  # folded query rows of this KV head: head kvh*G + r // T, query r % T
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    t = r % T  # [M] query index (its tree_mask row)
    d = tl.arange(0, BLOCK_D)  # [D]
    r_ok, d_ok = r < rows, d < HEAD_DIM
    q_off = (kvh * rows + r)[:, None] * HEAD_DIM + d[None, :]  # the G heads of a KV head are adjacent
    q = tl.load(q_ptr + q_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    prefix = tl.load(prefix_ptr).to(tl.int32)
    seen = prefix + T  # rows past the queries' own are never read
    kv_base = kvh.to(tl.int64) * KV_ROWS * HEAD_DIM
    precision: tl.constexpr = "ieee" if q_ptr.dtype.element_ty == tl.float32 else "tf32"  # tf32: ignored off fp32

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a tile with nothing visible gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, seen, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] cache rows
        j_ok = j < seen
        kv_off = kv_base + j[:, None] * HEAD_DIM + d[None, :]  # [N, D]
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=precision) * SCALE  # [M, N] fp32
        i = j - prefix  # [N] tree column of a row the queries wrote
        in_tree = (i >= 0) & j_ok
        tm = tl.load(mask_ptr + t[:, None] * T + i[None, :], mask=r_ok[:, None] & in_tree[None, :], other=0)
        visible = (j < prefix)[None, :] | (tm != 0)  # [M, N]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def grid(rows: int, kv_heads: int, block_m: int) -> tuple[int, int, int]:
    """Programs for GROUPS * T folded query rows over kv_heads KV heads."""
    return (triton.cdiv(rows, block_m), kv_heads, 1)



def tree_attention(q, k, v, tree_mask, prefix_len, scale: float):
    """Launch the kernel on torch tensors: CUDA, or CPU tensors through Triton's interpreter (with
    TRITON_INTERPRET=1 set before triton is first imported, as the tests do). Shapes as the op; k and v
    may be row slices of a larger cache (any head stride), q any layout. -> [1, H, T, D]."""
    import torch

    _, heads, t, d = q.shape
    kv_heads = k.shape[1]
    q = q.contiguous()
    if k.stride(3) != 1 or k.stride(2) != d or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)  # [1, H, T, D]
    prefix = prefix_len.reshape(()).to(torch.int64)
    tiles = blocks(d, str(q.dtype).removeprefix("torch."))
    tree_attention_kernel[grid(heads // kv_heads * t, kv_heads, tiles["BLOCK_M"])](
        q, k, v, tree_mask.contiguous(), prefix, t, k.stride(1) // d, out,
        GROUPS=heads // kv_heads, HEAD_DIM=d, SCALE=float(scale), **tiles, num_warps=NUM_WARPS,
        num_stages=stages(d, str(q.dtype).removeprefix("torch.")))
    return out


def compile_aot(dtype: str, head_dim: int, groups: int, scale: float, arch: int = 90):
    """Compile the kernel ahead of time for one dtype ("float32", "float16", "bfloat16") and shape
    family, for GPUs of compute capability `arch` (80: A100, 90: H100/H200), with no GPU: returns
    Triton's compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.name`, `.metadata.shared`).
    T and KV_ROWS stay runtime int32 parameters (no value specialisation), as the plugin passes them.
    Not under TRITON_INTERPRET=1 (the interpreter replaces Triton's language: nothing compiles)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ty = DTYPES[dtype]
    signature = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "mask_ptr": "*i1", "prefix_ptr": "*i64",
                 "T": "i32", "KV_ROWS": "i32", "out_ptr": f"*{ty}"}
    constexprs = dict(GROUPS=groups, HEAD_DIM=head_dim, SCALE=float(scale), **blocks(head_dim, dtype))
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn=tree_attention_kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": NUM_WARPS, "num_stages": stages(head_dim, dtype), "ptx_version": PTX_VERSION,
               "enable_fp_fusion": True}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


PTX_PARAM = {"ptr": "u64", "i32": "u32"}
HIDDEN = ("global_scratch_size", "profile_scratch_size")  # Triton >= 3.3 appends one pointer param per kind


def check_abi(ptx: str, name: str, shared: int, scratch: dict) -> list[str]:
    """Check a compiled kernel (its PTX, entry name, shared memory bytes and Triton's hidden scratch
    sizes, as `describe` gives them) against the launch ABI the TensorRT plugin declares: the PTX
    entry takes the ABI's parameters in order (pointers as .u64, int32 extras as .u32), then only
    Triton's hidden scratch pointers, whose sizes must be 0 (the kernel never dereferences them;
    TensorRT allocates no scratch), and the shared memory fits a launch without opt-in. Returns the
    PTX parameter types; raises ValueError naming the mismatch."""
    import re

    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    if entry is None or entry.group(1) != name:
        raise ValueError(f"no .entry {name} in the PTX")
    types = [re.match(r"\s*\.param\s+\.(\w+)", p).group(1) for p in entry.group(2).split(",") if p.strip()]
    want = [PTX_PARAM["ptr"]] * len(INPUTS) + [PTX_PARAM["i32"]] * len(EXTRAS) + [PTX_PARAM["ptr"]] * len(OUTPUTS)
    if types[: len(want)] != want:
        raise ValueError(f"PTX parameters {types} do not start with the ABI's {want} ({', '.join(ABI)})")
    extra = types[len(want) :]
    if len(extra) > len(HIDDEN) or any(t != PTX_PARAM["ptr"] for t in extra):
        raise ValueError(f"PTX parameters past the ABI's are not Triton's hidden scratch pointers: {extra}")
    if any(scratch.values()):
        raise ValueError(f"the kernel needs scratch memory the plugin does not allocate: {scratch}")
    if shared > 48 * 1024:
        raise ValueError(f"{shared} bytes of shared memory: more than a launch gets without opt-in")
    return types


def describe(kernel) -> dict:
    """What `check_abi` and the plugin read from a compiled kernel."""
    meta = kernel.metadata
    return {"name": meta.name, "ptx": kernel.asm["ptx"], "cubin_bytes": len(kernel.asm.get("cubin", b"")),
            "shared": meta.shared, "num_warps": meta.num_warps,
            "scratch": {h: getattr(meta, h, 0) for h in HIDDEN}}


def plugin_ptx(described: dict, name: str) -> str:
    """The compiled kernel's PTX as the TensorRT plugin ships it: the entry renamed to `name` (TensorRT
    keys loaded kernels by name, so every dtype/shape variant gets its own), and Triton's hidden scratch
    parameters dropped from the entry, so it takes exactly the ABI's parameters whatever TensorRT does
    with missing ones. Refuses a kernel that uses scratch, or whose body reads a dropped parameter."""
    import re

    old, ptx = described["name"], described["ptx"]
    types = check_abi(ptx, old, described["shared"], described["scratch"])
    for i in range(len(ABI), len(types)):
        if len(re.findall(rf"\b{old}_param_{i}\b", ptx)) != 1:  # its declaration alone
            raise ValueError(f"the kernel body reads hidden parameter {i}: it cannot be dropped")
    head, params, tail = re.match(r"(.*?\.entry\s+\w+\s*\()([^)]*)(\).*)", ptx, re.S).groups()
    kept = ",".join(params.split(",")[: len(ABI)]).rstrip() + "\n"
    return re.sub(rf"\b{old}\b", name, head + kept + tail)

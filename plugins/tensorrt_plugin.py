"""`glance::TreeAttention` as a TensorRT plugin: the Python plugin API (`tensorrt.plugin`) with an
ahead-of-time implementation, so engines carry the compiled Triton kernel
(`tree_attention_triton.tree_attention_kernel`) as PTX and run in TensorRT's C++ runtime with no Python.
It is the direct kernel, not the split-KV pair the torch op runs: an AOT implementation hands TensorRT
one kernel and gets no workspace, so this plugin declares no scratch (docs/engines.md).

Importing this module registers the plugin (do it before parsing ONNX). The ONNX parser maps a node
to it by op_type "TreeAttention" with attribute plugin_namespace="glance"; `aot=1` on the node picks
this AOT implementation (see `glance_rt.engines.tensorrt.tensorrt_onnx`). Written to TensorRT 10.12+'s
documented API; TensorRT cannot be installed where glance-rt is developed, so this module has not
run (docs/engines.md says what is and is not verified).
"""

import struct
from typing import Tuple, Union  # noqa: UP035  (tensorrt.plugin checks the annotations it is given)

import tensorrt as trt
import tensorrt.plugin as trtp

from glance_rt.plugins import TENSORRT_PLUGIN
from glance_rt.plugins import tree_attention_triton as kernel

NAME = TENSORRT_PLUGIN
DTYPES = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
FLOAT_IO = "FP32|FP16|BF16"


@trtp.register(NAME)
def tree_attention_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                        prefix_len: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
    """out [B, H, T, D], q's shape and dtype."""
    return q.like()


@trtp.autotune(NAME)
def tree_attention_autotune(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                            prefix_len: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]) -> list:  # noqa: UP006
    """q, k, v and out share one float type ('|' ties them); the mask is bool, prefix_len int64; linear."""
    return [trtp.AutoTuneCombination(f"{FLOAT_IO}, {FLOAT_IO}, {FLOAT_IO}, BOOL, INT64, {FLOAT_IO}", "LINEAR")]


def device_arch() -> int:
    """Compute capability of the GPU the engine is built on (80: A100, 90: H100/H200)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


@trtp.aot_impl(NAME)
def tree_attention_aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                       prefix_len: trtp.TensorDesc, scale: float, outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
                       tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes],  # noqa: UP006, UP007
                                             trtp.KernelLaunchParams, trtp.SymExprs]:
    """Compile the kernel for this node's dtype and shapes: (name, PTX, launch, extra int32 args).
    TensorRT launches it as (q, k, v, tree_mask, prefix_len, T, KV_ROWS, KV_BATCH, out), the kernel's ABI,
    over `kernel.direct_launch`: a program grid over (query tiles, KV heads, sequences). B, T and L may
    be symbolic (a batched engine's slots, the verify engine's rows, one profile per bucket): the grid
    and extras are then expressions of them, evaluated by TensorRT per launch. A batched graph hands
    the plugin its slots' cache rows as one packed [B, KVH, L, D] tensor, so a sequence's stride is
    KVH * L rows."""
    dtype = DTYPES[q.dtype]
    heads, head_dim = int(q.shape[1]), int(q.shape[3])
    kv_heads = int(k.shape[1])
    groups = heads // kv_heads
    arch = device_arch()
    compiled = kernel.describe(kernel.compile_aot(dtype, head_dim, groups, scale, arch))
    scale_bits = struct.unpack("<I", struct.pack("<f", scale))[0]
    name = f"glance_tree_attention_{dtype}_d{head_dim}_g{groups}_s{scale_bits:08x}_sm{arch}"
    ptx = kernel.plugin_ptx(compiled, name)
    launch = trtp.KernelLaunchParams()
    block_m = kernel.blocks(head_dim, dtype)["BLOCK_M"]
    grid, extras = kernel.direct_launch(q.shape_expr[0], heads, q.shape_expr[2], kv_heads, k.shape_expr[2], block_m)
    launch.grid_x, launch.grid_y, launch.grid_z = grid
    launch.block_x = compiled["num_warps"] * 32
    launch.shared_mem = compiled["shared"]
    extra = trtp.SymIntExprs(len(kernel.EXTRAS))
    for i, value in enumerate(extras):  # T, KV_ROWS, KV_BATCH
        extra[i] = trtp.SymInt32(value)
    return name.encode(), ptx.encode(), launch, extra

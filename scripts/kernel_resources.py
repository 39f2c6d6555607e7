"""Registers, spills and shared memory of the split-KV tree-attention kernel per launch setting, and of exact
numerics' path kernel per query rows a program, with no GPU.

Triton compiles the kernel for sm_90 (H100/H200) as its JIT would for a launch on torch tensors (16-byte
aligned pointers), and `ptxas -v` says what each program needs. A kernel that spills registers, or needs
so many that one program fills an SM, is slow whatever its tiles do; the GPU check's launch-settings sweep
(`scripts/gpu_check.py`, `tune_configs`) measures the same settings in microseconds.

    python scripts/kernel_resources.py                 # the 3B's and 7B's shapes, bf16, T = 1 and 64
    python scripts/kernel_resources.py --json out.json

Not under TRITON_INTERPRET=1 (the interpreter replaces Triton's language: nothing compiles).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {"qwen2.5-vl-3b": (16, 2, 128), "qwen2.5-vl-7b": (28, 4, 128)}  # query heads, KV heads, head dim
SM_REGISTERS, SM_SHARED = 65536, 228 * 1024  # an H100/H200 SM's register file and shared memory


def settings(t: int) -> list[dict]:
    """The op's default launch at T query rows per head, then the sweep's alternatives of most interest."""
    from glance_rt.plugins import tree_attention_triton as kernel

    default = {"block_m": None, "num_warps": kernel.NUM_WARPS}
    more = [{"block_m": 64, "num_warps": 8}, {"block_m": 64, "BLOCK_N": 32, "num_warps": 4}] if t > 1 else [
        {"block_m": 16, "num_warps": 8}]
    return [default, *more]


def programs_per_sm(registers: int, num_warps: int, shared: int) -> int:
    """Programs of a kernel one SM holds at once, by its registers a thread and its shared memory bytes."""
    return min(SM_REGISTERS // (registers * 32 * num_warps), SM_SHARED // max(shared, 1))


def measure(shape: str, t: int, cfg: dict, tree_bits: bool, fused: bool = False, dtype: str = "bfloat16") -> dict:
    import triton

    from glance_rt.plugins import tree_attention_triton as kernel

    heads, kv_heads, d = SHAPES[shape]
    groups = heads // kv_heads
    block_m = cfg["block_m"] or kernel.split_block_m(groups * t)
    tune = {k: v for k, v in cfg.items() if k != "block_m"}
    split, _ = kernel.compile_split_aot(dtype, d, groups, d**-0.5, 90, kernel.SPLIT_ROWS, block_m, tree_bits,
                                        tune, aligned=True, fused=fused)
    res = kernel.ptxas_resources(split.asm["ptx"])
    per_sm = programs_per_sm(res["registers"], tune["num_warps"], split.metadata.shared)
    return {"triton": triton.__version__, "kernel": "split", "shape": shape, "T": t, "block_m": block_m,
            "num_warps": tune["num_warps"],
            "BLOCK_N": tune.get("BLOCK_N", kernel.blocks(d, dtype, kernel.SPLIT_ROWS)["BLOCK_N"]),
            "mask": "bits" if tree_bits else "gathered", "combine": "fused" if fused else "separate", **res,
            "shared": split.metadata.shared,
            "programs_per_sm": per_sm}


def measure_path(shape: str, path_rows: int, dtype: str = "bfloat16") -> dict:
    """Exact numerics' path kernel (split form, trees of up to 64 rows) at `path_rows` query rows a program."""
    import triton

    from glance_rt.plugins import tree_attention_triton as kernel

    heads, kv_heads, d = SHAPES[shape]
    k = kernel.compile_path_aot(dtype, d, heads // kv_heads, d**-0.5, 90, kernel.SPLIT_ROWS, True, 64, True,
                                path_rows)
    res = kernel.ptxas_resources(k.asm["ptx"])
    per_sm = programs_per_sm(res["registers"], kernel.NUM_WARPS, k.metadata.shared)
    return {"triton": triton.__version__, "kernel": "path", "shape": shape, "path_rows": path_rows, **res,
            "shared": k.metadata.shared, "programs_per_sm": per_sm}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    rows = []
    print("| shape | T | query rows / program | warps | tile rows | tree mask | combine | registers | spill bytes "
          "(stores / loads) | shared KiB | programs / SM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        for t in (1, 64):
            for i, cfg in enumerate(settings(t)):
                variants = [(False, False), (True, False)] + ([(True, True)] if i == 0 else [])  # (bits, fused)
                for bits, fused in variants:
                    r = measure(shape, t, cfg, bits, fused)
                    rows.append(r)
                    print(f"| {shape} | {t} | {r['block_m']} | {r['num_warps']} | {r['BLOCK_N']} | {r['mask']} | "
                          f"{r['combine']} | "
                          f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | {r['shared'] / 1024:.0f} | "
                          f"{r['programs_per_sm']} |", flush=True)
    print("\n| shape | path kernel: query rows / program | registers | spill bytes (stores / loads) | shared KiB | "
          "programs / SM |\n|---|---|---|---|---|---|")
    for shape in SHAPES:
        for path_rows in (1, 2, 4):
            r = measure_path(shape, path_rows)
            rows.append(r)
            print(f"| {shape} | {path_rows} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
                  f"{r['shared'] / 1024:.0f} | {r['programs_per_sm']} |", flush=True)
    if args.json:
        from glance_rt.files import write_json

        write_json(args.json, rows)


if __name__ == "__main__":
    main()

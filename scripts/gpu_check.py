"""The GPU check: ONE script for a lent GPU machine (10 minutes at most), printing figures and writing
them as JSON. Run it through `scripts/gpu_check.sh` there (it installs what travels with the tree).

    python scripts/gpu_check.py --out DIR       # on the GPU machine
    python scripts/gpu_check.py --cpu           # here: every section at toy sizes on CPU (checks the script)

Sections, in order, each under one deadline (a failure is recorded and the next section runs):
  kernel    the Triton tree-attention kernel == the torch reference (fp32/fp16/bf16, GQA, a NaN tail that
            must never be read); captured in a CUDA graph it follows prefix_len written on the device;
            its time against the reference op at real shapes
  lossless  tiny random models of every architecture in fp32: eager and compiled (CUDA graphs) GLANCE
            give Hugging Face greedy's tokens; the compiled decoder takes new prompts with no recompile
  timings   Qwen2.5-VL-3B's and -7B's text decoders (random weights: timing only) in bf16: AR step,
            draft pass, verify at budgets 16-128 and a whole round, eager and compiled
  tensorrt  when tensorrt imports: a TensorRT engine of a tiny model gives HF greedy's tokens
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # tests/ (tiny models) travel with the tree; glance_rt comes installed

QWEN25_VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, max_position_embeddings=32768)
QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, max_position_embeddings=32768)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
H200_BANDWIDTH = 4.8e12  # bytes/s (HBM3e)


class Run:
    """The deadline, the report, and where it is written after every section."""

    def __init__(self, args):
        self.args, self.start, self.report = args, time.perf_counter(), {}
        self.device = torch.device("cpu" if args.cpu else "cuda")
        self.out = Path(args.out) / "gpu_check.json"

    def left(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.start)

    def section(self, name: str, fn) -> None:
        t = time.perf_counter()
        print(f"\n== {name} ({self.left():.0f} s left)", flush=True)
        try:
            self.report[name] = fn(self)
        except Exception as e:  # record it and go on: one broken section must not hide the others' figures
            traceback.print_exc()
            self.report[name] = {"error": f"{type(e).__name__}: {e}"}
        self.report[name + "_wall_s"] = round(time.perf_counter() - t, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, reps: int | None = None) -> float:
        """Median seconds of fn() after two warm-up calls."""
        for _ in range(2):
            fn()
        out = []
        for _ in range(reps or self.args.reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out)


# ------------------------------------------------------------------------------------------------ kernel


def kernel_section(run: Run) -> dict:
    from glance_rt.models.attention import tree_attention_reference
    from glance_rt.plugins import tree_attention_triton as triton_kernel
    from tests.test_attention import random_tree_mask

    dev, fig, worst = run.device, {}, {}
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    if dev.type == "cpu":  # Triton's interpreter multiplies bf16 tiles as integers (tests/test_triton_kernel.py)
        del tol[torch.bfloat16]
    gen = torch.Generator().manual_seed(0)
    cases = [(4, 2, 1, 7, 16), (4, 4, 9, 13, 8), (12, 2, 17, 100, 32), (28, 4, 64, 1000, 128), (16, 2, 128, 513, 128)]
    for dtype in tol:
        for heads, kv_heads, t, prefix, d in cases:
            kv_len = prefix + t + 300  # spare splits past prefix + T
            q = torch.randn(1, heads, t, d, generator=gen)
            k, v = (torch.randn(1, kv_heads, kv_len, d, generator=gen) for _ in range(2))
            k[:, :, prefix + t :], v[:, :, prefix + t :] = float("nan"), float("nan")
            mask = random_tree_mask(t, gen)
            want = tree_attention_reference(q, k[:, :, : prefix + t], v[:, :, : prefix + t], mask,
                                            torch.tensor(prefix), d**-0.5)
            q, k, v, mask = (x.to(dev, dtype) if x.is_floating_point() else x.to(dev) for x in (q, k, v, mask))
            # the direct kernel (TensorRT's), the op's default splits, and many small splits
            for split_rows in (None, triton_kernel.SPLIT_ROWS, 32 if dev.type == "cuda" or prefix < 200 else None):
                got = triton_kernel.tree_attention(q, k, v, mask, torch.tensor(prefix, device=dev), d**-0.5,
                                                   split_rows)
                err = (got.float().cpu() - want).abs().max().item()
                key = str(dtype).removeprefix("torch.")
                worst[key] = max(worst.get(key, 0.0), err)
                if not err <= tol[dtype]:
                    raise AssertionError(f"kernel != reference: {key} H={heads} KVH={kv_heads} T={t} P={prefix} "
                                         f"D={d} split_rows={split_rows}: max error {err:.3g} (NaN: it read the "
                                         "cache tail)")
    fig["max_abs_error"] = worst
    if dev.type == "cuda":
        fig["cuda_graph_follows_prefix_len"] = captured_prefix_check(run)
        fig.update(kernel_timings(run))
    else:
        fig["cuda_graph_follows_prefix_len"] = "not checked (no GPU)"
    return fig


def captured_prefix_check(run: Run) -> bool:
    """The op captured in a CUDA graph with prefix_len a device tensor: replays after writing another
    prefix_len give that prefix's attention (nothing baked in at capture), across 1, 2 and 6 live splits."""
    from glance_rt.models.attention import tree_attention, tree_attention_reference

    dev = run.device
    q = torch.randn(1, 8, 4, 64, device=dev)
    k, v = (torch.randn(1, 2, 2048, 64, device=dev) for _ in range(2))
    mask = torch.ones(4, 4, dtype=torch.bool, device=dev).tril()
    prefix = torch.tensor(10, device=dev)
    tree_attention(q, k, v, mask, prefix, 0.125)  # warm-up: Triton compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, mask, prefix, 0.125)
    for p in (10, 300, 1500, 100):
        prefix.fill_(p)
        graph.replay()
        want = tree_attention_reference(q.cpu(), k.cpu()[:, :, : p + 4], v.cpu()[:, :, : p + 4], mask.cpu(),
                                        torch.tensor(p), 0.125)
        if not torch.allclose(out.cpu(), want, atol=2e-6, rtol=2e-6):
            return False
    return True


def graph_time_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Device time of fn() in microseconds: `calls` calls captured in one CUDA graph, the median replay
    over `reps`, divided by `calls` (no Python launch overhead, as the decoder's captured passes run)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


KERNEL_GOALS_US = {"T1_P1024": 10.0, "T1_P6000": 15.0, "T64_P6000": 20.0}  # issue 37, at the 7B's shapes


def kernel_timings(run: Run) -> dict:
    """The kernel at a 7B's attention shapes (28 query heads, 4 KV heads, head dim 128, bf16, an 8k-row
    cache) in CUDA graphs: the direct kernel (TensorRT's; the first run's 102/291 us), the op's default
    split-KV, a sweep of split sizes, and the reference op (SDPA over every row with a [T, L] mask)."""
    from glance_rt.models.attention import tree_attention_reference
    from glance_rt.plugins import tree_attention_triton as triton_kernel

    dev, fig = run.device, {}
    k, v = (torch.randn(1, 4, 8192, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for t in (1, 64):
        q = torch.randn(1, 28, t, 128, device=dev, dtype=torch.bfloat16)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        for prefix in (1024, 6000):
            args = (q, k, v, mask, torch.tensor(prefix, device=dev), 0.088)
            key = f"T{t}_P{prefix}"
            fig[f"direct_{key}_us"] = graph_time_us(lambda a=args: triton_kernel.tree_attention(*a, split_rows=None))
            for rows in (64, 128, 256, 512, 1024):
                fig[f"split{rows}_{key}_us"] = graph_time_us(lambda a=args, r=rows: triton_kernel.tree_attention(*a, r))
            fig[f"kernel_{key}_us"] = fig[f"split{triton_kernel.SPLIT_ROWS}_{key}_us"]  # the op's default
            fig[f"reference_{key}_us"] = graph_time_us(lambda a=args: tree_attention_reference(*a))
            if key in KERNEL_GOALS_US:
                fig[f"kernel_{key}_goal_us"] = KERNEL_GOALS_US[key]
            print(key, {n: round(x, 1) for n, x in fig.items() if key in n}, flush=True)
    return fig


# ---------------------------------------------------------------------------------------------- lossless


def lossless_section(run: Run) -> dict:
    import glance_rt
    from tests.conftest import hf_greedy
    from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs, make_tiny

    dev, res = run.device, {}
    archs = ARCHS if not run.args.cpu else ["llama", "qwen2_5_vl"]
    for backend in ("eager", "compile"):
        for arch in archs:
            if run.left() < run.args.reserve:  # the timings need their time too
                res[f"{arch}/{backend}"] = "skipped: deadline"
                continue
            t = time.perf_counter()
            torch._dynamo.reset()
            model, processor = make_tiny(arch)
            target = glance_rt.load_target(model, device=str(dev), processor=processor)
            drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
            dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, backend=backend, chunk=8)
            vlm = arch in VLM_ARCHS
            prompts = [("Describe it.", 1 if vlm else 0, 24), ("Hi", 0, 30),
                       ("Count the objects, then name their colours.", 2 if vlm else 0, 20)]
            ok, graphs = True, []
            for prompt, n_images, new in prompts:
                inputs = make_inputs(arch, processor, prompt=prompt, n_images=n_images, seed=new)
                inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
                ok &= dec.generate(max_new_tokens=new, **inputs).token_ids == hf_greedy(model, inputs, new)
                graphs.append(unique_graphs())
            entry = {"tokens_equal_hf": ok, "s": round(time.perf_counter() - t, 1)}
            if backend == "compile":
                entry["recompiles_after_first_prompt"] = graphs[-1] - graphs[0]
            res[f"{arch}/{backend}"] = entry
            print(arch, backend, entry, flush=True)
    res["all_equal_hf"] = all(e["tokens_equal_hf"] for e in res.values() if isinstance(e, dict))
    res["no_recompiles"] = all(e.get("recompiles_after_first_prompt", 0) == 0 for e in res.values()
                               if isinstance(e, dict))
    return res


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------------------------- timings


def build_target(cfg: dict, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import glance_rt

    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype).eval()
    return glance_rt.load_target(model, dtype=str(dtype).removeprefix("torch."), device=str(device))


def pass_figures(run: Run, target, drafter, backend: str, budgets) -> dict:
    """Latencies of one round's passes at a `--context`-row prefix."""
    import glance_rt
    from glance_rt.round.tree import build_tree

    args, dev, fig = run.args, run.device, {}
    prompt = torch.randint(0, target.vocab_size, (1, args.context), device=dev)
    max_length = args.context + args.new_tokens + max(budgets) + 64
    ar = glance_rt.Decoder(target, None, max_length=max_length, backend=backend)
    pre = target.prefill_inputs({"input_ids": prompt})
    ar.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None].to(dev))
    one = torch.ones(1, 1, dtype=torch.bool, device=dev)
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.tensor([[args.context]], device=dev)
    root = build_tree(None, 0, 0)
    fig["ar_step_ms"] = 1e3 * run.timed(lambda step=ar.passes.verify: step(root, tok, pos, args.context, one))
    ar = None  # its caches go before the tree decoders' come
    for budget in budgets:
        if run.left() < 60:
            fig[f"verify_{budget}"] = "skipped: deadline"
            continue
        dec = glance_rt.Decoder(target, drafter, tree_budget=budget, max_length=max_length, backend=backend)
        _, feats = dec.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None].to(dev))
        dec.passes.draft(feats, 0, 0, args.context)  # the prompt's context, once
        ctx = feats[-1:]

        def draft(dec=dec, ctx=ctx):
            return dec.passes.draft(ctx, args.context - 1, 0, args.context)

        tree = build_tree(draft(), 0, budget)
        tokens, mask = torch.from_numpy(tree.tokens).to(dev), torch.from_numpy(tree.mask).to(dev)
        positions = (torch.from_numpy(tree.depth).to(dev) + args.context)[None]

        def round_(dec=dec, budget=budget, positions=positions, draft=draft):
            t = build_tree(draft(), 0, budget)
            _, _, _, path = dec.passes.verify(t, torch.from_numpy(t.tokens).to(dev), positions, args.context,
                                              torch.from_numpy(t.mask).to(dev))
            dec.passes.commit(path, args.context)

        fig["draft_ms"] = 1e3 * run.timed(draft)
        fig[f"verify_{budget}_ms"] = 1e3 * run.timed(
            lambda dec=dec, tree=tree, tokens=tokens, positions=positions, mask=mask:
            dec.passes.verify(tree, tokens, positions, args.context, mask))
        fig[f"round_{budget}_ms"] = 1e3 * run.timed(round_)
        del dec
    return fig


def timings_section(run: Run) -> dict:
    import glance_rt

    res = {}
    dtype = torch.float32 if run.args.cpu else torch.bfloat16
    models = {"toy": TOY} if run.args.cpu else {"qwen2.5-vl-3b": QWEN25_VL_3B_TEXT, "qwen2.5-vl-7b": QWEN25_VL_7B_TEXT}
    budgets = [4, 8] if run.args.cpu else [16, 32, 64, 128]
    for name, cfg in models.items():
        if run.left() < 150:
            res[name] = "skipped: deadline"
            continue
        target = build_target(cfg, dtype, run.device)
        drafter = glance_rt.init_drafter(target, num_layers=1, block_size=16).to(dtype)
        fig = {"context": run.args.context, "dtype": str(dtype)}
        for backend in ("eager", "compile"):
            torch._dynamo.reset()
            t = time.perf_counter()
            fig[backend] = pass_figures(run, target, drafter, backend, budgets)
            fig[backend]["wall_s"] = round(time.perf_counter() - t, 1)
            print(name, backend, json.dumps(fig[backend]), flush=True)
        text = target.parts
        weight_bytes = sum(p.numel() * p.element_size() for p in text.text_model.parameters())
        if text.lm_head.weight.data_ptr() != text.text_model.embed_tokens.weight.data_ptr():
            weight_bytes += text.lm_head.weight.numel() * text.lm_head.weight.element_size()
        c = target.text_config
        kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * run.args.context
        kv_bytes *= (c.hidden_size // c.num_attention_heads) * (torch.finfo(dtype).bits // 8)
        fig["ar_bandwidth_bound_ms"] = 1e3 * (weight_bytes + kv_bytes) / H200_BANDWIDTH
        res[name] = fig
        del target, drafter
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------- tensorrt


def tensorrt_section(run: Run) -> dict:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return {"status": "not run: tensorrt is not installed on this machine"}
    import subprocess

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_tensorrt.py"),
           "-m", "tensorrt", "-rs"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, int(run.left()) - 30))
    print(done.stdout[-3000:], done.stderr[-2000:])
    return {"status": "passed" if done.returncode == 0 else f"failed (rc {done.returncode})",
            "tail": done.stdout[-1500:]}


def summary(report: dict) -> None:
    print("\n== summary")
    k = report.get("kernel", {})
    print("kernel max |error| vs reference:", k.get("max_abs_error"), "| CUDA graph follows prefix_len:",
          k.get("cuda_graph_follows_prefix_len"))
    lo = report.get("lossless", {})
    print("lossless: all == HF:", lo.get("all_equal_hf"), "| no recompiles:", lo.get("no_recompiles"))
    for name, fig in report.get("timings", {}).items():
        if not isinstance(fig, dict) or "eager" not in fig:
            continue
        for backend in ("eager", "compile"):
            f = fig[backend]
            cells = "  ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in f.items()
                              if k.endswith("_ms") and isinstance(v, float))
            print(f"{name:14} {backend:8} ms: {cells}")
        print(f"{name:14} AR bandwidth bound {fig['ar_bandwidth_bound_ms']:.2f} ms")
    print("tensorrt:", report.get("tensorrt", {}).get("status"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="toy sizes on CPU: checks the script itself")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for all sections together")
    ap.add_argument("--reserve", type=float, default=300, help="seconds the lossless sweep leaves for the timings")
    ap.add_argument("--context", type=int, default=1024, help="prefix rows already in the cache (timings)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sections", default="kernel,lossless,timings,tensorrt")
    args = ap.parse_args()
    if args.cpu:
        args.context, args.reps, args.reserve = 64, 3, 60
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors (read when triton is imported)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or with --cpu to check the script")
    run = Run(args)
    run.report["env"] = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "torch": torch.__version__,
                         "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    try:
        import triton

        run.report["env"]["triton"] = triton.__version__
    except ImportError:
        run.report["env"]["triton"] = None
    sections = {"kernel": kernel_section, "lossless": lossless_section, "timings": timings_section,
                "tensorrt": tensorrt_section}
    for name in args.sections.split(","):
        run.section(name, sections[name])
    summary(run.report)
    print(f"\nwritten: {run.out}")


if __name__ == "__main__":
    main()

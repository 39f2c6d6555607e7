"""GPU figures for the compiled passes (run once on a lent GPU machine; prints a table and JSON).

A random-weight model with a real VLM's text shapes (Qwen2.5-VL-3B's text decoder; weights do not
matter for timing) in bf16: AR step, draft pass, verify at budgets 16-128 and a whole GLANCE round,
each as eager static passes and as compiled passes (CUDA graphs via torch.compile
"reduce-overhead"); the AR step against the memory-bandwidth bound; tokens compiled vs eager.

    python scripts/gpu_check.py                 # on the GPU machine
    python scripts/gpu_check.py --tiny          # a 2-layer model on CPU: checks the script itself
"""

import argparse
import json
import statistics
import time

import torch

QWEN25_VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, max_position_embeddings=32768)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
H200_BANDWIDTH = 4.8e12  # bytes/s (HBM3e)


def timed(fn, reps: int, device) -> float:
    """Median seconds of fn() over reps calls after two warm-up calls."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def build_target(cfg: dict, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import glance_rt

    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype).eval()
    return glance_rt.load_target(model, dtype=str(dtype).removeprefix("torch."), device=str(device))


def pass_figures(target, drafter, backend: str, args, device) -> dict:
    """Latencies of one round's passes at a `args.context`-row prefix."""
    import glance_rt
    from glance_rt.round.tree import build_tree

    fig = {}
    prompt = torch.randint(0, target.vocab_size, (1, args.context), device=device)
    ar = glance_rt.Decoder(target, None, max_length=args.max_length, backend=backend)
    pre = target.prefill_inputs({"input_ids": prompt})
    ar.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None].to(device))
    one = torch.ones(1, 1, dtype=torch.bool, device=device)
    tok = torch.zeros(1, dtype=torch.long, device=device)
    pos = torch.tensor([[args.context]], device=device)
    root = build_tree(None, 0, 0)
    fig["ar_step_s"] = timed(lambda: ar.passes.verify(root, tok, pos, args.context, one), args.reps, device)
    for budget in args.budgets:
        fig.update(budget_figures(target, drafter, backend, budget, pre, args, device))
    return fig


def budget_figures(target, drafter, backend: str, budget: int, pre, args, device) -> dict:
    """Draft, verify and whole-round latencies at one tree budget."""
    import glance_rt
    from glance_rt.round.tree import build_tree

    fig = {}
    dec = glance_rt.Decoder(target, drafter, tree_budget=budget, max_length=args.max_length, backend=backend)
    logits, feats = dec.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None].to(device))
    b = dec.drafter.block_size
    dec.passes.draft(feats, 0, 0, args.context)  # the prompt's context, once
    ctx = feats[-b:]

    def draft():
        return dec.passes.draft(ctx[:1], args.context - 1, 0, args.context)

    draft_logits = draft()
    tree = build_tree(draft_logits, 0, budget)
    tokens = torch.from_numpy(tree.tokens).to(device)
    mask = torch.from_numpy(tree.mask).to(device)
    positions = (torch.from_numpy(tree.depth).to(device) + args.context)[None]

    def verify():
        return dec.passes.verify(tree, tokens, positions, args.context, mask)

    def round_():
        t = build_tree(draft(), 0, budget)
        _, _, _, path = dec.passes.verify(t, torch.from_numpy(t.tokens).to(device), positions,
                                          args.context, torch.from_numpy(t.mask).to(device))
        dec.passes.commit(path, args.context)

    fig["draft_s"] = timed(draft, args.reps, device)
    fig[f"verify_{budget}_s"] = timed(verify, args.reps, device)
    fig[f"round_{budget}_s"] = timed(round_, args.reps, device)
    return fig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="2-layer model on CPU (checks the script)")
    ap.add_argument("--budgets", default="16,32,64,128")
    ap.add_argument("--context", type=int, default=1024, help="prefix rows already in the cache")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.max_length = args.context + args.new_tokens + max(args.budgets) + 64
    import glance_rt

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = build_target(TINY if args.tiny else QWEN25_VL_3B_TEXT, dtype, device)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=args.block_size).to(dtype)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "context": args.context, "block_size": args.block_size, "torch": torch.__version__}
    for backend in ("eager", "compile"):
        t = time.perf_counter()
        report[backend] = pass_figures(target, drafter, backend, args, device)
        report[backend]["wall_s"] = time.perf_counter() - t
        print(backend, json.dumps(report[backend]), flush=True)
    text = target.parts
    weight_bytes = sum(p.numel() * p.element_size() for p in text.text_model.parameters())
    if text.lm_head.weight.data_ptr() != text.text_model.embed_tokens.weight.data_ptr():
        weight_bytes += text.lm_head.weight.numel() * text.lm_head.weight.element_size()
    c = target.text_config
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * args.context * (c.hidden_size // c.num_attention_heads)
    kv_bytes *= torch.finfo(dtype).bits // 8
    bound = (weight_bytes + kv_bytes) / H200_BANDWIDTH
    ar = report["compile"]["ar_step_s"]
    report["ar_bandwidth_bound_s"] = bound
    report["ar_step_fraction_of_bound"] = bound / ar
    report["round_64_over_ar_step"] = report["compile"].get("round_64_s", float("nan")) / ar
    prompt = {"input_ids": torch.randint(0, target.vocab_size, (1, 64), device=device)}
    outs = {b: glance_rt.Decoder(target, drafter, tree_budget=64, max_length=args.max_length, backend=b).generate(
        max_new_tokens=args.new_tokens, **prompt).token_ids for b in ("eager", "compile")}
    first = next((i for i, (a, b) in enumerate(zip(outs["eager"], outs["compile"], strict=False)) if a != b), None)
    report["tokens_compiled_vs_eager"] = "identical" if first is None else f"first difference at token {first}"
    print(json.dumps(report, indent=2))
    print(f"\nAR step (compiled): {ar * 1e3:.2f} ms = {report['ar_step_fraction_of_bound']:.0%} of the "
          f"{bound * 1e3:.2f} ms bandwidth bound; GLANCE round at N=64: {report['round_64_over_ar_step']:.2f}x AR step")
    for backend in ("eager", "compile"):
        f = report[backend]
        print(f"{backend:8} AR {f['ar_step_s'] * 1e3:7.2f} ms  draft {f['draft_s'] * 1e3:7.2f} ms  " + "  ".join(
            f"verify@{b} {f[f'verify_{b}_s'] * 1e3:7.2f} ms round@{b} {f[f'round_{b}_s'] * 1e3:7.2f} ms"
            for b in args.budgets))


if __name__ == "__main__":
    main()

"""What torch.compile's guards cost a compiled AR step: a toy Qwen2 (width 64) with many layers, so the
step's compute is small and the per-call host cost shows. Times the compiled one-row verify graph
(median of --reps calls, one thread) with guards evaluated, then under
`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: the difference is the guards' cost per call,
which a CUDA graph replayed by torch.compile ("reduce-overhead") pays at every step and a
`glance_rt.round.graphs.GraphRunner` pays once, at capture. Then a Decoder's whole AR step, per generated
token (from two generation lengths), with the step's host work (a host tree of one row, five uploads,
read-backs of the argmax, the path and two entropies) and as one graph on the device (`Decoder(device_round=
True)`, `StaticGraphs.step`: one copy in, one back). Run it alone (no tests or training beside).

    python scripts/guard_cost.py --layers 2,36
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402


def median_us(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e6 * statistics.median(out)


def step_costs(layers: int, reps: int, tokens: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import glance_rt
    from glance_rt.round.tree import build_tree

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, eos_token_id=None)
    target = glance_rt.load_target(Qwen2ForCausalLM(cfg).eval())
    ctx = 64
    ids = torch.randint(0, cfg.vocab_size, (1, ctx))
    decs = {on: glance_rt.Decoder(target, None, max_length=ctx + tokens + 64, backend="compile", device_round=on)
            for on in (False, True)}
    per_token = {on: round(token_us(dec, ids, long=tokens)) for on, dec in decs.items()}
    dec = decs[False]
    pre = target.prefill_inputs({"input_ids": ids})
    root = build_tree(None, 0, 0)
    t = torch.from_numpy
    args = (t(root.tokens), (t(root.depth) + ctx)[None].clone(), torch.tensor(ctx), t(root.mask), t(root.parent))
    verify = dec.passes.fns["verify"]
    with torch.inference_mode():
        dec.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None])
        for _ in range(3):
            verify(*args)
        guarded = median_us(lambda: verify(*args), reps)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            unguarded = median_us(lambda: verify(*args), reps)
    return {"layers": layers, "step_us": round(guarded), "step_without_guards_us": round(unguarded),
            "guards_us": round(guarded - unguarded), "decoder_token_host_step_us": per_token[False],
            "decoder_token_device_step_us": per_token[True]}


def token_us(dec, ids, short: int = 16, long: int = 80) -> float:
    """A Decoder's time per generated token: the difference of a `short` and a `long` generation (best of
    3 each, after a warm-up), so the prompt's prefill cancels out."""

    def gen(n: int) -> float:
        t = time.perf_counter()
        out = dec.generate(max_new_tokens=n, input_ids=ids)
        assert len(out.token_ids) == n  # (no EOS: the config has none)
        return time.perf_counter() - t

    gen(short), gen(short)  # compiles
    a, b = min(gen(short) for _ in range(3)), min(gen(long) for _ in range(3))
    return 1e6 * (b - a) / (long - short)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,36")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=80, help="the longer generation (the shorter: 16 tokens)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for n in args.layers.split(","):
        torch._dynamo.reset()
        print(step_costs(int(n), args.reps, args.tokens), flush=True)


if __name__ == "__main__":
    main()

"""Compile regions (each verifier layer one nested compile region) against inline layers, on the default
target and drafter (SmolLM2-135M-Instruct, fp32, the compile backend on this CPU): warm-up time (compiling
every graph a GLANCE decoder at budget 8 + lookup runs), and tokens/s over held-out prompts, the two
decoders interleaved per prompt (order alternating), medians; tokens compared with each other and with HF
greedy. Run alone (nothing else on the machine):

    python docs/compile-2026-12-07/ab_regions.py [--per-kind 2] [--new 64] [--json FILE] [--inline-first]

With TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 in the environment, nothing comes from Inductor's caches (the
report records it). On a CPU Inductor's on-disk cache is bypassed anyway for graphs holding
oneDNN-packed weights ("mkldnn tensors unpickleable"), so warm-up compiles every graph in every process.
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--inline-first", action="store_true", help="warm the inline decoder up first")
    args = ap.parse_args()

    import glance_rt
    from glance_rt.round.verify import named_backend
    from glance_rt.tools.suites import suite_rows

    torch.set_num_threads(2)
    target = glance_rt.load_target(None)
    drafter = glance_rt.load_drafter(None, target)
    decs, warm = {}, {}
    for regions in (False, True) if args.inline_first else (True, False):
        t = time.perf_counter()
        backend = replace(named_backend("compile"), regions=regions)
        decs[regions] = glance_rt.Decoder(target, drafter, backend=backend, max_length=1024)
        decs[regions].warmup()
        warm[regions] = round(time.perf_counter() - t, 1)
        print(f"regions={regions}: warm-up {warm[regions]} s", flush=True)
    prompts = [r["prompt"] for r in suite_rows("all", per_kind=args.per_kind)]
    rates = {True: [], False: []}
    same = equal_hf = 0
    for i, prompt in enumerate(prompts):
        enc = target.encode_chat(prompt)
        order = (True, False) if i % 2 == 0 else (False, True)
        toks = {}
        for regions in order:
            t = time.perf_counter()
            out = decs[regions].generate(**enc, max_new_tokens=args.new)
            rates[regions].append(len(out.token_ids) / (time.perf_counter() - t))
            toks[regions] = out.token_ids
        ref = target.hf_model.generate(**enc, max_new_tokens=args.new, do_sample=False)[0, enc["input_ids"].shape[1]:]
        same += toks[True] == toks[False]
        equal_hf += toks[True] == ref.tolist()
        print(f"prompt {i}: {rates[True][-1]:.2f} vs {rates[False][-1]:.2f} tok/s", flush=True)
    res = {"warmup_s": {"regions": warm[True], "inline": warm[False]},
           "tok_s_median": {"regions": round(statistics.median(rates[True]), 2),
                            "inline": round(statistics.median(rates[False]), 2)},
           "prompts": len(prompts), "new_tokens": args.new, "regions_tokens_equal_inline": same,
           "regions_tokens_equal_hf": equal_hf,
           "warmed_first": "inline" if args.inline_first else "regions",
           "cold_caches": os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1", "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json + ".part", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(args.json + ".part", args.json)


if __name__ == "__main__":
    main()

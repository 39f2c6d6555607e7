"""Row invariance on this machine: are torch's CPU kernels row-invariant, does a verify row
get an AR step's bits, and how often does GLANCE commit other tokens than the same engine's AR?

    .venv/bin/python scripts/row_invariance.py --out runs/numerics   [--quick]

Three tables, in fast and exact numerics (`glance_rt.models.exact`):
1. linear: elements of F.linear(x[:T], w) that differ from the rows computed one per call, for the
   default target's layer shapes (SmolLM2-135M: 576 -> 1536, 1536 -> 576, 576 -> 192, the 49,152-row
   head) in fp32, bf16 and fp16;
2. rows: tree rows of a verify pass whose logits equal the AR step's bit for bit (`row_agreement`), on
   every tiny architecture, per dtype;
3. tokens: GLANCE (every round drafting) against the same engine's AR, greedy and sampled, on the six
   text decoders exact numerics covers (Llama, Qwen2, Qwen3, Qwen2-VL, Qwen2.5-VL, LLaVA) with an untrained
   drafter at budgets 8, 32 and 16 + lookup 3: runs whose tokens differ.
Writes row_invariance.json and row_invariance.md into --out (write, then rename).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "bfloat16", "float16")
SHAPES = ((576, 1536), (1536, 576), (576, 192), (576, 49152))  # (in, out): the default target's
TOKEN_ARCHS = ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "llava")
CONFIGS = ({"tree_budget": 8, "lookup": 0}, {"tree_budget": 32, "lookup": 0}, {"tree_budget": 16, "lookup": 3})
TREE = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [-1, 0, 0, 1, 1, 2, 3, 6, 7, 8, 9])


def linear_table(shapes, rows) -> list[dict]:
    from glance_rt.models.exact import RowBlockLinear
    from glance_rt.models.kernels import linear_invariance

    out = []
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        dt = getattr(torch, dtype)
        for k, n in shapes:
            w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
            x = torch.randn(max(rows), k, generator=g).to(dt)
            lin = torch.nn.Linear(k, n, bias=False, dtype=dt)
            lin.weight.data = w
            block = RowBlockLinear(lin)
            for numerics, fn in (("fast", F.linear), ("exact", lambda x, w, b=block: b(x))):
                diff = linear_invariance(fn, x, w, rows)
                out.append({"dtype": dtype, "in": k, "out": n, "numerics": numerics, "differing": diff})
    return out


def rows_table(archs) -> list[dict]:
    import glance_rt
    from glance_rt.tools.numerics import row_agreement
    from tests.tiny_models import make_tiny

    out = []
    for arch in archs:
        model, processor = make_tiny(arch)
        for dtype in DTYPES:
            target = glance_rt.load_target(model, processor=processor, dtype=dtype)
            for numerics in ("fast", "exact"):
                checks = row_agreement(target, list(range(5, 40)), *TREE, numerics=numerics)
                out.append({"arch": arch, "dtype": dtype, "numerics": numerics, "rows": len(checks),
                            "equal": sum(c.equal for c in checks), "max_diff": max(c.max_diff for c in checks)})
    return out


def tokens_table(archs, dtypes, new: int) -> list[dict]:
    import glance_rt
    from tests.tiny_models import make_inputs, make_tiny

    out = []
    for arch in archs:
        model, processor = make_tiny(arch)
        inputs = make_inputs(arch, processor, prompt="Say something long about the sea.", n_images=0)
        for dtype in dtypes:
            target = glance_rt.load_target(model, processor=processor, dtype=dtype)
            drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
            for numerics in ("fast", "exact"):
                for sampled in (False, True):
                    s = glance_rt.Sampling(do_sample=True, temperature=1.5, seed=7) if sampled else glance_rt.Sampling()
                    ar = glance_rt.Decoder(target, None, max_length=256, numerics=numerics, backend="eager")
                    want = ar.generate(max_new_tokens=new, sampling=s, **inputs).token_ids
                    for cfg in CONFIGS:
                        dec = glance_rt.Decoder(target, drafter, max_length=256, gate=False, numerics=numerics,
                                                backend="eager", **cfg)
                        got = dec.generate(max_new_tokens=new, sampling=s, **inputs).token_ids
                        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
                        out.append({"arch": arch, "dtype": dtype, "numerics": numerics, "sampled": sampled, **cfg,
                                    "equal": got == want, "first_difference": first})
                        print(json.dumps(out[-1]), flush=True)
    return out


def markdown(res: dict) -> str:
    lines = [f"# Row invariance ({res['date']}, {res['machine']})", "", f"Command: `{res['command']}`", "",
             "## 1. torch's linear: elements differing from one-row calls (rows T: count)", "",
             "| dtype | in -> out | fast | exact |", "|---|---|---|---|"]
    lin = {(r["dtype"], r["in"], r["out"], r["numerics"]): r["differing"] for r in res["linear"]}
    for dtype, k, n, numerics in lin:
        if numerics == "fast":
            fast = ", ".join(f"{t}: {d}" for t, d in lin[dtype, k, n, "fast"].items())
            exact = sum(lin[dtype, k, n, "exact"].values())
            lines.append(f"| {dtype} | {k} -> {n} | {fast} | {exact} differing |")
    lines += ["", "## 2. Verify rows bit-equal to AR steps (tree of 11 rows, depth up to 5)", "",
              "| arch | dtype | fast | exact |", "|---|---|---|---|"]
    rows = {(r["arch"], r["dtype"], r["numerics"]): r for r in res["rows"]}
    for arch, dtype, numerics in rows:
        if numerics == "fast":
            f, e = rows[arch, dtype, "fast"], rows[arch, dtype, "exact"]
            lines.append(f"| {arch} | {dtype} | {f['equal']}/{f['rows']} (max diff {f['max_diff']:.2g}) | "
                         f"{e['equal']}/{e['rows']} |")
    lines += ["", "## 3. GLANCE tokens against the same engine's AR (runs that differ / runs)", "",
              "| dtype | numerics | greedy | sampled |", "|---|---|---|---|"]
    for dtype in sorted({r["dtype"] for r in res["tokens"]}):
        for numerics in ("fast", "exact"):
            cells = []
            for sampled in (False, True):
                runs = [r for r in res["tokens"] if r["dtype"] == dtype and r["numerics"] == numerics
                        and r["sampled"] == sampled]
                cells.append(f"{sum(not r['equal'] for r in runs)}/{len(runs)}")
            lines.append(f"| {dtype} | {numerics} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from glance_rt.models.kernels import cpu_model
    from tests.tiny_models import ARCHS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", type=int, default=40, help="new tokens per token-agreement run")
    ap.add_argument("--quick", action="store_true", help="one shape, three architectures, bf16 tokens only")
    a = ap.parse_args()
    t0 = time.time()
    quick = a.quick
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_model(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "command": "python scripts/row_invariance.py " + " ".join(sys.argv[1:])}
    res["linear"] = linear_table(SHAPES[:1] if quick else SHAPES, (2, 3, 8, 9, 16, 17, 33))
    res["rows"] = rows_table(ARCHS[:3] if quick else ARCHS)
    res["tokens"] = tokens_table(TOKEN_ARCHS[:3] if quick else TOKEN_ARCHS,
                                 ("bfloat16",) if quick else ("bfloat16", "float16"), a.new)
    res["seconds"] = round(time.time() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("row_invariance.json", json.dumps(res, indent=1)), ("row_invariance.md", markdown(res))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    print(markdown(res))


if __name__ == "__main__":
    main()

"""A/B in one process, interleaved per prompt (order rotating): exact numerics' eager CPU attention as it is
now (`row_attention`: a scratch prefix, each row's path written behind it; an AR step over the cache's own
rows) against the form before (`gathered`, below: each row's prefix and path gathered by index for its own
call). fp32, default target and drafter, 10 held-out prompts, 64 new tokens; the same Decoders both ways."""
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

import glance_rt
import glance_rt.models.exact as exact
from glance_rt.cli import _load
from glance_rt.tools.suites import encode_rows, suite_rows


def gathered(q, k, v, tree_mask, prefix_len, scale):  # the form before 2026-12-06 (07:30)
    kv_heads, d = k.shape[1], q.shape[3]
    groups, t = q.shape[1] // kv_heads, q.shape[2]
    p = int(prefix_len)
    prefix = torch.arange(p, device=q.device)
    out = []
    for i in range(t):
        seen = torch.cat([prefix, p + tree_mask[i].nonzero()[:, 0]])
        qi = q[:, :, i].reshape(1, kv_heads, groups, d)
        oi = F.scaled_dot_product_attention(qi, k[:, :, seen], v[:, :, seen], scale=scale)
        out.append(oi.reshape(1, kv_heads * groups, 1, d))
    return torch.cat(out, 2)


target, drafter = _load(None, None, "float32", "cpu")
enc = encode_rows(target, suite_rows("all", 2))
decs = {"ar": glance_rt.Decoder(target, None, max_length=1024),
        "tree": glance_rt.Decoder(target, drafter, max_length=1024),
        "ar+exact": glance_rt.Decoder(target, None, max_length=1024, numerics="exact"),
        "tree+exact": glance_rt.Decoder(target, drafter, max_length=1024, numerics="exact")}
runs = list(decs) + ["ar+exact@gathered", "tree+exact@gathered"]


def generate(name, n, inputs):
    if name.endswith("@gathered"):
        with mock.patch.object(exact, "row_attention", gathered):
            return decs[name.removesuffix("@gathered")].generate(max_new_tokens=n, **inputs)
    return decs[name].generate(max_new_tokens=n, **inputs)


for name in runs:
    generate(name, 8, enc[0])
tps, toks = {n: [] for n in runs}, {n: [] for n in runs}
for i, inputs in enumerate(enc):
    for name in runs[i % len(runs):] + runs[: i % len(runs)]:
        t0 = time.perf_counter()
        out = generate(name, 64, inputs)
        tps[name].append(len(out.token_ids) / (time.perf_counter() - t0))
        toks[name].append(out.token_ids)
for name in runs:
    ratio = [a / b for a, b in zip(tps[name], tps["ar"], strict=True)]
    print(f"{name:22s} tok/s {statistics.median(tps[name]):6.2f}  x fast AR {statistics.median(ratio):.2f}")
print("exact GLANCE == exact AR:", toks["tree+exact"] == toks["ar+exact"],
      " now == gathered:", toks["tree+exact"] == toks["tree+exact@gathered"] and toks["ar+exact"] == toks["ar+exact@gathered"],
      " exact == fast (fp32, == HF):", toks["ar+exact"] == toks["ar"])

"""A/B in one process, interleaved per prompt (order rotating): exact numerics with whole calls of the
row-invariant oneDNN kernel (the default where the probe passes) against 8-row padded blocks
(invariant_rows=0), fp32, default target and drafter, 10 held-out prompts, 64 new tokens."""
import statistics, time
from unittest import mock
import glance_rt
from glance_rt.cli import _load
from glance_rt.models.exact import ExactNumerics
from glance_rt.round import loop
from glance_rt.tools.suites import suite_rows, encode_rows

target, drafter = _load(None, None, "float32", "cpu")
rows = suite_rows("all", 2)
enc = encode_rows(target, rows)
ml = 1024
decs = {}
decs["ar"] = glance_rt.Decoder(target, None, max_length=ml)
decs["tree"] = glance_rt.Decoder(target, drafter, max_length=ml)
decs["ar+exact"] = glance_rt.Decoder(target, None, max_length=ml, numerics="exact")
decs["tree+exact"] = glance_rt.Decoder(target, drafter, max_length=ml, numerics="exact")
blocks = lambda static=False: ExactNumerics(static=static, invariant_rows=0)
with mock.patch.object(loop, "ExactNumerics", blocks):
    decs["ar+exact@blocks"] = glance_rt.Decoder(target, None, max_length=ml, numerics="exact")
    decs["tree+exact@blocks"] = glance_rt.Decoder(target, drafter, max_length=ml, numerics="exact")
names = list(decs)
for d in decs.values():
    d.generate(max_new_tokens=8, **enc[0])
tps = {n: [] for n in names}
toks = {n: [] for n in names}
for i, inputs in enumerate(enc):
    for n in names[i % len(names):] + names[: i % len(names)]:
        t0 = time.perf_counter()
        out = decs[n].generate(max_new_tokens=64, **inputs)
        dt = time.perf_counter() - t0
        tps[n].append(len(out.token_ids) / dt)
        toks[n].append(out.token_ids)
for n in names:
    r = [a / b for a, b in zip(tps[n], tps["ar"])]
    print(f"{n:20s} tok/s {statistics.median(tps[n]):6.2f}  x fast AR {statistics.median(r):.2f}")
print("exact GLANCE == exact AR (whole):", toks["tree+exact"] == toks["ar+exact"],
      " (blocks):", toks["tree+exact@blocks"] == toks["ar+exact@blocks"],
      " fast == HF-equal ar:", toks["tree"] == toks["ar"], " whole == blocks:", toks["ar+exact"] == toks["ar+exact@blocks"])

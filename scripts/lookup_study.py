"""How long a prompt-lookup chain should be (docs/benchmarks.md, "Lookup chain length").

    python scripts/lookup_study.py runs              # how far the chain lookup proposes is right, per kind
    python scripts/lookup_study.py caps 8:4,8:6 20   # held-out tau with the chain capped at CAP rows
    python scripts/lookup_study.py caps 8:6 20 runs/smollm2-v7/drafter   # ... of another drafter
    python scripts/lookup_study.py caps 8:6:3,8:6:8 20   # ... matching n-grams of up to 3, then 8 tokens

`runs` reads the response store of the default target: at every response position, the chain
`prompt_lookup` (n <= 3) proposes there is compared with the response, and the number of its leading
tokens that are right is counted (the chain a round could accept, up to 4, 7 or 15 rows).

`caps` decodes held-out prompts of the shipped corpus (PER_KIND of each kind, 128 new tokens, the
shipped drafter or the drafter folder given, eager) at tree budget BUDGET with the chain capped at
CAP rows (deeper than the block where CAP > B-1), each pair in turn, and prints tau overall and per
kind. A third number NGRAM is the longest n-gram lookup matches (`Decoder(lookup=NGRAM)`, default 3).
CAP may depend on how long the match was: `2-6-6-6-6-6-8` gives a chain matched on 1 token 2 rows,
on 2..6 tokens 6 rows, on 7 or more 8 rows (the last value holds for every longer match):

    python scripts/lookup_study.py caps 8:6:8,8:2-6:8,8:6-6-6-6-6-6-8:8 20

A fourth number is the rows a round whose chain fills the tree verifies (`Decoder(lookup_budget=...)`,
default `DEFAULT_LOOKUP_BUDGET` within max_depth): `8:2-6-6-6-8:8:8` against `8:2-6-6-6-8:8:15`.

This experiment swaps `glance_rt.round.tree.lookup_rows` (the one rule the decoder asks) for each
pair; the library's rule is what the measurements chose. Tau does not depend on timing, so this may
run beside other work.
"""

import collections
import json
import sys
import time
from pathlib import Path

import numpy as np


def chain_runs(store: str = "data/responses/smollm2-135m-instruct", per_kind: int = 30000) -> None:
    from glance_rt.round.tree import prompt_lookup

    runs = collections.defaultdict(list)
    for f in sorted(Path(store).glob("part-*.npz")):
        with np.load(f) as z:
            meta, ids = json.loads(str(z["meta"])), z["ids"].astype(np.int64)
            plens, rlens = z["prompt_lens"], z["response_lens"]
        at = 0
        for row, p, r in zip(meta["rows"], plens, rlens, strict=True):
            seq, at = ids[at : at + p + r], at + p + r
            if len(runs[row["kind"]]) >= per_kind:
                continue
            for t in range(p, p + r - 1):
                chain = prompt_lookup(seq[: t + 1], 3, 16)  # history ends with the round's root, token t
                right = next((i for i, (a, b) in enumerate(zip(chain, seq[t + 1 :], strict=False)) if a != b),
                             None)
                runs[row["kind"]].append(min(len(chain), len(seq) - t - 1) if right is None else right)
    print("| kind | positions | chain right >= 1 | >= 4 | >= 7 | >= 15 | mean right, capped at 4 / 7 / 15 |")
    print("|---|---|---|---|---|---|---|")
    for kind, v in runs.items():
        v = np.array(v)
        print(f"| {kind} | {len(v)} | {np.mean(v >= 1):.2f} | {np.mean(v >= 4):.2f} | {np.mean(v >= 7):.2f} | "
              f"{np.mean(v >= 15):.2f} | {np.minimum(v, 4).mean():.2f} / {np.minimum(v, 7).mean():.2f} / "
              f"{np.minimum(v, 15).mean():.2f} |")


def cap_rule(spec: str):
    """`6` -> 6 rows for any match; `2-6-8` -> 2 rows for a 1-token match, 6 for 2, 8 for 3 or more."""
    caps = [int(x) for x in spec.split("-")]
    return lambda block, budget, n: min(caps[min(n, len(caps)) - 1], budget)


def capped_tau(specs: list[str], per_kind: int, drafter_dir: str | None = None) -> None:
    import glance_rt
    import glance_rt.round.tree as tree
    from glance_rt.tools.suites import default_corpus_path, read_prompts
    from glance_rt.tools.training.data import heldout_rows

    target = glance_rt.load_target(None)
    drafter = glance_rt.load_drafter(drafter_dir, target)
    rows = heldout_rows(read_prompts(default_corpus_path()), per_kind)
    for spec in specs:
        budget, cap, *rest = spec.split(":")  # BUDGET:CAP[:NGRAM[:ROWS]]
        budget, ngram, rounds = int(budget), int(rest[0]) if rest else 3, int(rest[1]) if len(rest) > 1 else None
        tree.lookup_rows = cap_rule(cap)  # this experiment's rule (see the docstring)
        dec = glance_rt.Decoder(target, drafter, tree_budget=budget, lookup=ngram, gate=False,  # tau of every round
                                lookup_budget=rounds)
        by_kind, start = collections.defaultdict(list), time.perf_counter()
        for r in rows:
            out = dec.generate(max_new_tokens=128, **target.encode_chat(r["prompt"]))
            by_kind[r["kind"]] += out.stats.accepted_lengths
        every = [n for v in by_kind.values() for n in v]
        kinds = " ".join(f"{k} {np.mean(v):.2f}" for k, v in by_kind.items())
        print(f"budget {budget} cap {cap} ngram {ngram} lookup rounds {dec.lookup_budget}: "
              f"tau {np.mean(every):.3f} ({kinds}; {len(rows)} prompts, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["runs"]:
        chain_runs()
    elif argv[:1] == ["caps"] and len(argv) in (3, 4):
        capped_tau(argv[1].split(","), int(argv[2]), *argv[3:])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

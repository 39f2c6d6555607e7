"""Replay the draft gate offline over recorded rounds, at several cost ratios.

    python scripts/gate_replay.py collect N OUT.json   # N held-out prompts per kind, drafting every round
    python scripts/gate_replay.py replay OUT.json [RATIOS]   # e.g. 1.7,2.1,2.4,3.0

`collect` decodes held-out prompts (index 10 on, so not the bench's first ones) with the default
target, its shipped drafter and the default method drafting every round (`gate=False`), 96 new
tokens, and records per round what the gate sees before it (the prior entropy and the prompt-lookup
n-gram size) and the tokens it committed. `replay` runs `glance_rt.round.gate.DraftGate` over each
prompt's rounds with costs set to the ratio (a drafted round r, an autoregressive step 1): a round it
skips is replaced by the autoregressive steps that commit the same tokens (one each; the gate is
asked again at the next recorded round). It prints, per
kind, the median speed over autoregression of drafting always, of the gate, and of an oracle that
drafts exactly the rounds committing more than r tokens. One gate runs across the prompts (in a
shuffled order), as in a server or a bench run.
"""

import json
import sys

import numpy as np

KINDS = ("extraction", "conversion", "grounded_qa", "code", "chat")


def collect(per_kind: int, out: str) -> None:
    import torch

    import glance_rt
    from glance_rt.round.tree import lookup_match
    from glance_rt.tools.suites import default_corpus_path, read_prompts

    torch.set_num_threads(2)
    held = [r for r in read_prompts(default_corpus_path()) if r["split"] == "heldout"]
    target = glance_rt.load_target()
    dec = glance_rt.Decoder(target, glance_rt.load_drafter(target=target), max_length=1024, gate=False)
    dec.warmup()
    prompts = []
    for kind in KINDS:
        for row in [r for r in held if r["kind"] == kind][10 : 10 + per_kind]:
            inputs = target.encode_chat(row["prompt"])
            res = dec.generate(96, **inputs)
            prompt = inputs["input_ids"].reshape(-1).tolist()
            history, rounds = prompt + res.token_ids[:1], []
            for h, n in zip(res.stats.prior_entropy, res.stats.accepted_lengths, strict=True):
                ngram, _ = lookup_match(np.asarray(history), dec.lookup, 8)
                rounds.append((h, ngram, n))
                done = len(history) - len(prompt)
                history += res.token_ids[done : done + n]
            prompts.append({"id": row["id"], "kind": kind, "rounds": rounds})
            print(f"{row['id']}: tau {res.stats.tau:.2f}, {res.stats.rounds} rounds", flush=True)
    with open(out, "w") as f:
        json.dump(prompts, f)


def replay(path: str, ratios: list[float]) -> None:
    from glance_rt.round.gate import DraftGate

    prompts = json.load(open(path))
    order = np.random.default_rng(0).permutation(len(prompts))
    print("| cost ratio | policy | all | " + " | ".join(KINDS) + " |")
    print("|---|---|---|" + "---|" * len(KINDS))
    for r in ratios:
        speed = {"always": {}, "gate": {}, "oracle": {}}
        gate = DraftGate()
        for i in order:
            p = prompts[i]
            tokens = sum(n for *_, n in p["rounds"])
            speed["always"].setdefault(p["kind"], []).append(tokens / (r * len(p["rounds"])))
            speed["oracle"].setdefault(p["kind"], []).append(tokens / sum(min(n, r) for *_, n in p["rounds"]))
            gate.start()
            cost = 0.0
            for h, ngram, n in p["rounds"]:
                if gate.draft(h, ngram):
                    cost += r
                    gate.record(True, h, ngram, n, r)
                else:  # the n autoregressive steps that commit the same tokens
                    cost += n
                    for _ in range(n):
                        gate.record(False, h, ngram, 1, 1.0)
            speed["gate"].setdefault(p["kind"], []).append(tokens / cost)
        for policy, by_kind in speed.items():
            every = [x for v in by_kind.values() for x in v]
            cells = " | ".join(f"{np.median(by_kind[k]):.2f}" for k in KINDS)
            print(f"| {r} | {policy} | {np.median(every):.2f} (worst {min(every):.2f}) | {cells} |")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(int(sys.argv[2]), sys.argv[3])
    else:
        replay(sys.argv[2], [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1.7,2.1,2.4,3.0").split(",")])

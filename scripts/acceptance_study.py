"""What limits acceptance: the drafter's accuracy at each depth of its block, on held-out answers.

    python scripts/acceptance_study.py [PER_KIND] [DRAFTER_DIR]     # default: 20 per kind, the shipped drafter

For PER_KIND held-out prompts of each kind of the shipped corpus (the rows `lookup_study.py caps` and
train's eval use), the target's greedy answer (96 tokens, from the response store, which gains the
ones it lacks) is teacher-forced: a block is drafted at every answer position from the target's own
features of the rows before it (`block_forward`, the pass inference runs, all blocks of an answer in
one forward), and at each depth k = 1..B-1 of the block this counts, over all positions:

- top-1: the depth's most likely token is the answer's token,
- chain: depths 1..k are all right (what a chain of B-1 drafted tokens accepts through depth k),
- top-4, top-8: the answer's token is among the depth's 4 or 8 most likely (what a wider tree can
  still catch at that depth, given the depths above it right),
- lookup: prompt lookup's chain (n-grams up to `DEFAULT_LOOKUP`, what `generate` grafts) is right
  through depth k.

"Copies" as a number: a position is a *copy position* when lookup's chain is right at depth 1 there
(the answer goes on as the text before it did). A second table gives, per kind, the share of copy
positions and the drafter's depth-1 top-1 and top-8 rates and its chain tau at copy positions and
elsewhere, beside lookup's chain tau at the copy positions: a drafter that copies matches lookup there.

A chain's expected tokens per round is 1 + the sum of its chain column (the bonus token plus each
depth reached): printed per kind for the drafter alone, lookup alone, and the better of the two at
each position (an oracle that knows which to follow; the tree gets part of this by grafting both).
Teacher forcing drafts at every position; a decoder drafts only at round starts, so the rates are
per position, not per round. Only the drafter and the store are read; timing plays no part.
"""

import collections
import sys
import time

STORE = "data/responses/smollm2-135m-instruct"
TOPS = (4, 8)


def answers(target, per_kind: int) -> list[dict]:
    """The held-out rows with `prompt_ids` and `response_ids` (the target's greedy 96-token answers)."""
    from glance_rt.tools.suites import default_corpus_path, read_prompts
    from glance_rt.tools.train import TrainConfig
    from glance_rt.tools.training.data import _stored_batch, heldout_rows, open_store

    cfg = TrainConfig(out="", store=STORE, response_tokens=96, response_batch=16)  # out: unused here
    rows = heldout_rows(read_prompts(default_corpus_path()), per_kind)
    return _stored_batch(open_store(target, cfg), rows, cfg, target)


def depth_hits(target, drafter, row: dict) -> dict:
    """{metric: [K, B-1] bool} for the blocks at every answer position of `row`."""
    import torch
    import torch.nn.functional as F

    from glance_rt.hf.arch import extend_inputs
    from glance_rt.method import DEFAULT_LOOKUP
    from glance_rt.round.tree import prompt_lookup
    from glance_rt.tools.training.data import Sequence, capture_features
    from glance_rt.tools.training.glance import block_forward, copy_logprobs

    ids = torch.tensor(row["prompt_ids"] + row["response_ids"])  # [L]
    p, length, b = len(row["prompt_ids"]), ids.shape[0], drafter.config.block_size
    inputs = extend_inputs(target.encode_chat(row["prompt"]), row["response_ids"])
    feats = capture_features(target, inputs, tuple(drafter.target_layer_ids))  # [L, F]
    anchors = torch.arange(p, length - 1)  # each round's root: an answer token, its features not yet computed
    embed = target.parts.text_model.embed_tokens.weight
    with torch.no_grad():
        hidden = block_forward(drafter, embed, feats.to(embed.dtype), ids, anchors)  # [K, B-1, H]
        logits = F.linear(hidden, target.parts.lm_head.weight)  # [K, B-1, V]
        if drafter.config.copy_head:  # the pointer mixed in, as the draft pass drafts
            seq = Sequence(feats.to(embed.dtype), ids, p, row["kind"])
            logits = copy_logprobs(drafter, hidden, logits, seq, anchors)
    pos = anchors[:, None] + torch.arange(1, b)  # [K, B-1]
    valid = pos < length
    want = ids[pos.clamp(max=length - 1)]  # [K, B-1]
    top = logits.topk(max(TOPS), -1).indices  # [K, B-1, 8]
    out = {"valid": valid, "top-1": (top[..., 0] == want) & valid}
    out["chain"] = out["top-1"].long().cumprod(1).bool()
    for k in TOPS:
        out[f"top-{k}"] = (top[..., :k] == want[..., None]).any(-1) & valid
    seq = ids.numpy()
    look = torch.zeros_like(valid)
    for i, a in enumerate(anchors.tolist()):
        chain = prompt_lookup(seq[: a + 1], DEFAULT_LOOKUP, b - 1)  # history ends with the root
        right = 0
        while right < len(chain) and a + 1 + right < length and chain[right] == seq[a + 1 + right]:
            right += 1
        look[i, :right] = True
    out["lookup"] = look
    return out


def study(per_kind: int, drafter_dir: str | None) -> None:
    import torch

    import glance_rt

    torch.set_grad_enabled(False)
    target = glance_rt.load_target(None)
    drafter = glance_rt.load_drafter(drafter_dir, target).eval()
    start = time.perf_counter()
    rows = answers(target, per_kind)
    by_kind: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for i, row in enumerate(rows):
        for name, hits in depth_hits(target, drafter, row).items():
            by_kind[row["kind"]][name].append(hits)
        print(f"\r{i + 1}/{len(rows)} answers, {time.perf_counter() - start:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    b = drafter.config.block_size
    print(f"Held-out answers: {len(rows)} ({per_kind} per kind), 96 tokens, drafter "
          f"{drafter_dir or 'shipped'}, block {b}. Rates per answer position (teacher-forced); depth k = 1..{b - 1}.\n")
    print("| kind | positions | metric | " + " | ".join(f"d{k}" for k in range(1, b)) + " |")
    print("|---|---|---|" + "---|" * (b - 1))
    summary = []
    for kind, metrics in [*by_kind.items(), ("all", None)]:
        if metrics is None:  # every kind's positions together
            metrics = {m: [h for v in by_kind.values() for h in v[m]] for m in next(iter(by_kind.values()))}
        m = {name: torch.cat(v) for name, v in metrics.items()}
        n = int(m["valid"][:, 0].sum())
        for name in ("top-1", "chain", *(f"top-{k}" for k in TOPS), "lookup"):
            rate = m[name].float().sum(0) / m["valid"].float().sum(0).clamp(min=1)
            print(f"| {kind} | {n} | {name} | " + " | ".join(f"{r:.2f}" for r in rate.tolist()) + " |")
        drafted = 1 + m["chain"].sum(1).float()  # tokens a chain of the drafter's top-1 commits at each position
        looked = 1 + m["lookup"].sum(1).float()
        best = torch.maximum(drafted, looked)
        copy = m["lookup"][:, 0] & m["valid"][:, 0]  # [positions] the answer copies the text before it
        split = [copy.float().mean().item()]
        for where in (copy, ~copy & m["valid"][:, 0]):
            split += [m["top-1"][where, 0].float().mean().item(), m["top-8"][where, 0].float().mean().item(),
                      drafted[where].mean().item()]
            if where is copy:
                split.append(looked[where].mean().item())
        summary.append((kind, drafted.mean().item(), looked.mean().item(), best.mean().item(), split))
    print("\n| kind | chain tau: drafter | lookup | better of the two per position |\n|---|---|---|---|")
    for kind, d, look, best, _ in summary:
        print(f"| {kind} | {d:.2f} | {look:.2f} | {best:.2f} |")
    print("\nCopy positions (lookup's chain right at depth 1) and the rest:\n")
    print("| kind | copy share | copy: d1 top-1 | d1 top-8 | drafter chain tau | lookup chain tau | "
          "elsewhere: d1 top-1 | d1 top-8 | drafter chain tau |\n" + "|---" * 9 + "|")
    for kind, *_, split in summary:
        print(f"| {kind} | " + " | ".join(f"{v:.2f}" for v in split) + " |")
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) > 2 or (argv and not argv[0].isdigit()):
        print(__doc__)
        return 2
    study(int(argv[0]) if argv else 20, argv[1] if len(argv) > 1 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

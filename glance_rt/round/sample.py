"""Choosing tokens: greedy, or sampled with Hugging Face's semantics, and the lossless tree walk.

`Sampling` holds the parameters (HF's names and defaults); its logits processors are transformers'
own classes, in the order `generate` applies them. A sampled token is chosen by Gumbel-max with noise
keyed by (seed, the token's absolute position): argmax(processed scores + g), g ~ Gumbel(0, 1) drawn
from a generator seeded with a hash of (seed, position). That draws exactly from softmax(processed
scores), and the draw for position i depends only on the seed and i. So the walk below, which at each
tree row draws the token the target samples there and descends into the child carrying it (stopping
with that token as the bonus when no child does), commits token for token what autoregressive
sampling with the same seed commits, whatever the drafter, budget, chain or lookup.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from glance_rt.errors import GlanceError


@dataclass(frozen=True)
class Sampling:
    """How each token is chosen. do_sample=False (the default) is greedy decoding, like HF's;
    repetition_penalty applies in both modes, the warpers (temperature, top_k, top_p, min_p) only when
    sampling. Defaults are HF GenerationConfig's. `stop`: strings that end generation after the token
    completing one (HF's StopStringCriteria). `seed` keys every draw (see the module docstring)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        def bad(what: str, hint: str):
            raise GlanceError(f"{what}: {hint}")

        if not self.temperature > 0 or self.temperature != self.temperature:
            bad(f"temperature must be > 0, got {self.temperature}",
                "use do_sample=False (--greedy / no --temperature) for greedy decoding")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            bad(f"top_k must be a non-negative integer, got {self.top_k!r}", "0 or None turns it off")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "1.0 turns it off")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "None turns it off")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}", "1.0 turns it off")
        if not isinstance(self.seed, int) or self.seed < 0:
            bad(f"seed must be a non-negative integer, got {self.seed!r}", "pick any integer >= 0")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a tuple of non-empty strings, got {self.stop!r}", 'e.g. stop=("\\n\\n",)')

    @property
    def greedy_only(self) -> bool:
        """True when the target's raw argmax is the choice (the fast path: acceptance inside the graph)."""
        return not self.do_sample and self.repetition_penalty == 1.0

    def processors(self):
        """transformers' logits processors for these parameters, in `generate`'s order."""
        from transformers import LogitsProcessorList
        from transformers.generation import logits_process as lp

        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(lp.RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.do_sample:
            if self.temperature != 1.0:
                out.append(lp.TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(lp.TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
            if self.top_p < 1.0:
                out.append(lp.TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
            if self.min_p is not None:
                out.append(lp.MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return out


GREEDY = Sampling()


def draw_key(seed: int, position: int) -> int:
    """A 63-bit generator seed for the draw at `position` (splitmix64 of the pair): distinct positions
    get unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def gumbel(seed: int, position: int, vocab: int, device) -> Tensor:
    """Gumbel(0, 1) noise [V] for the draw at `position`; the same on every call (per device type)."""
    gen = torch.Generator(device=device).manual_seed(draw_key(seed, position))
    u = torch.rand(vocab, generator=gen, device=device, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_min(1e-300)))


class Chooser:
    """Chooses the token after a prefix: `choose(logits [V], ids [L], position)`. Built once per
    generation (transformers' processors keep no state between calls)."""

    def __init__(self, sampling: Sampling):
        self.sampling, self.processors = sampling, sampling.processors()

    def scores(self, logits: Tensor, ids: Tensor) -> Tensor:
        """Processed scores [V] (fp32) for the next token after ids [L] (HF's processors, batch 1)."""
        scores = logits.float()[None]
        if len(self.processors):
            scores = self.processors(ids[None].to(logits.device), scores)
        return scores[0]

    def choose(self, logits: Tensor, ids: Tensor, position: int) -> int:
        scores = self.scores(logits, ids)
        if self.sampling.do_sample:
            scores = scores.double() + gumbel(self.sampling.seed, position, scores.shape[0], scores.device)
        return int(scores.argmax())


def walk(tree, logits: Tensor, ids: Tensor, position: int, chooser: Chooser) -> tuple[list[int], int]:
    """The lossless walk of a verified tree: at row path[-1] choose the target's token (its processed
    distribution given prompt + committed + the path's tokens; drawn at its absolute position), then
    descend into the child carrying it, or stop with it as the bonus. `ids` [L]: every token before the
    root's (the root's own included); `position`: the absolute position of the token chosen at the root.
    Returns (accepted path of rows, root first; the bonus token)."""
    path, prefix = [0], ids
    while True:
        tok = chooser.choose(logits[path[-1]], prefix, position + len(path) - 1)
        child = tree.children.get((path[-1], tok))
        if child is None:
            return path, tok
        path.append(child)
        prefix = torch.cat([prefix, prefix.new_tensor([tok])])


def stop_criteria(sampling: Sampling, tokenizer):
    """HF's StopStringCriteria for `sampling.stop` (None without stop strings)."""
    if not sampling.stop:
        return None
    if tokenizer is None:
        raise GlanceError("stop strings need the target's tokenizer: load a target with one")
    from transformers import StopStringCriteria

    return StopStringCriteria(tokenizer=tokenizer, stop_strings=list(sampling.stop))

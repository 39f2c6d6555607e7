"""`glance-rt train`'s configuration: one frozen dataclass for every stage and both heads."""

from dataclasses import dataclass

from glance_rt.method import DEFAULT_LOOKUP

TTT_POSITIONS = ("all", "anchors")
HEADS = ("glance", "eagle3")  # the drafter trained: GLANCE's block drafter, or the EAGLE-3 baseline head
FEATURE_MODES = ("cached", "online")
STAGES = ("responses", "features", "train")  # in order; TrainConfig.until names the last one to run
PART_SIZE = 64  # prompts per response/feature part file
PACK_ROWS = 32  # the row class timed for the response and feature stages (and oneDNN's layout hint)


@dataclass(frozen=True)
class TrainConfig:
    out: str
    prompts: str | None = None  # JSONL; None = the corpus shipped for the default target
    images: str | None = None  # folder that the prompts' image paths are relative to
    num_layers: int = 1
    block_size: int = 8
    target_layer_ids: tuple[int, ...] | None = None  # None = DFlash's default for num_layers
    response_tokens: int = 128
    response_batch: int = 16
    max_seq_len: int = 768
    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, over all ranks
    blocks_per_seq: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0  # loss weight of depth k: exp(-(k-1)/gamma)
    bf16: bool | None = None  # bf16 autocast and a bf16 lm_head copy; None: where bf16 is measured faster (`use_bf16`)
    draft_vocab: int | None = None  # the N most frequent response tokens form the draft vocabulary
    mask_token_id: int | None = None  # None: `default_mask_token_id(target)`
    learned_mask: bool = False  # glance-only: a learned mask embedding instead of a mask token's
    init_from: str | None = None  # a drafter folder to start from (its matching tensors), instead of a random init
    init_layers: tuple[int, ...] | None = None  # glance: drafter layer i starts from target layer init_layers[i]
    distill: int = 0  # glance: 0 = CE on the target's greedy token; K > 0 = soft CE on its top-K distribution
    copy_head: bool = False  # glance-only: a pointer over the context rows mixed into each depth (`copy_mix`)
    copy_span: bool = False  # the copy head's span form: one pointer, depth d copies the d-th token after it
    store: str | None = None  # a response store folder (glance_rt.tools.store): responses read from and added to it
    seed: int = 0
    save_every: int = 100
    eval_every: int = 0  # 0: evaluate at the end only
    eval_per_kind: int = 8
    eval_budget: int = 8  # `glance-rt generate`'s defaults: tree budget 8 with lookup chains of n-grams up to 8
    eval_lookup: int = DEFAULT_LOOKUP
    eval_tokens: int = 128
    limit: int | None = None  # use only the first N prompts (smoke runs)
    per_kind: int | None = None  # train on at most N prompts of each kind (held-out prompts are never trained on)
    head: str = "glance"  # "glance": a GLANCE block drafter; "eagle3": the EAGLE-3 baseline head (issue 38)
    ttt_steps: int = 7  # eagle3-only: training-time test's unroll (SpecForge's ttt_length)
    ttt_decay: float = 0.8  # eagle3-only: step k's loss weight decay**k (EAGLE-3's)
    ttt_positions: str = "all"  # eagle3-only: "all" response positions (EAGLE-3's), or GLANCE's "anchors" only
    features: str = "cached"  # "cached": stage 2 writes them to disk; "online": the target computes them in the step
    until: str = "train"  # the last stage to run: "responses" (fill a store), "features" or "train"
    resume: bool = False

    def identity(self) -> dict:
        """What must match for --resume to continue a run in the same folder."""
        keys = ("prompts", "images", "num_layers", "block_size", "target_layer_ids", "response_tokens",
                "max_seq_len", "seed", "limit", "per_kind", "draft_vocab", "mask_token_id", "learned_mask", "init_from",
                "head", "ttt_steps", "ttt_positions")
        # options added since: named only when set, so older runs resume
        later = {"init_layers": None, "distill": 0, "copy_head": False, "copy_span": False}
        return {**{k: getattr(self, k) for k in keys}, **{k: getattr(self, k) for k, v in later.items()
                                                          if getattr(self, k) != v}}

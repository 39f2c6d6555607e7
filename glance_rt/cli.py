"""The `glance-rt` command. Commands import the runtime (torch, transformers) when they run, so that
`glance-rt --help` stays instant."""

import functools
import sys
import time

import click

from glance_rt.errors import GlanceError
from glance_rt.method import DEFAULT_LOOKUP, DEFAULT_LOOKUP_BUDGET, DEFAULT_TREE_BUDGET, Method, job_max_length

DEFAULT_SERVE_BATCH = 8  # serve's --max-batch where batched rounds run
ALONE_UNTRAINED = 1.3  # a drafter alone below this many tokens a round is barely trained (train warns)

# options shared by several commands
TARGET = click.option("--target", "target_path", type=click.Path(), default=None,
                      help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
DRAFTER = click.option("--drafter", "drafter_path", type=click.Path(), default=None, help="Drafter folder.")
DTYPE = click.option("--dtype", default="float32", show_default=True,
                     type=click.Choice(["float32", "bfloat16", "float16"]))
DEVICE = click.option("--device", default="cpu", show_default=True)
MAX_LENGTH = click.option("--max-length", default=None, type=int,
                          help="Static cache rows (default: sized to the job: longest prompt + new tokens + a round).")


def method_options(command):
    """The options that say what to run, shared by generate and audit (bench names methods instead,
    `--methods`): they become one `glance_rt.method.Method` with the Python API's defaults."""

    @functools.wraps(command)
    def wrapper(*args, tree_budget, chain, lookup, lookup_budget, backend, engine_dir, always_draft, exact, **kw):
        try:
            if tree_budget is None and engine_dir is None and not chain:  # a chain: the drafter's whole block
                tree_budget = DEFAULT_TREE_BUDGET
            method = Method(kind="chain" if chain else "tree", tree_budget=tree_budget, lookup=lookup,
                            backend=backend, engine=engine_dir, gate=not always_draft, lookup_budget=lookup_budget,
                            numerics="exact" if exact else "fast")
        except GlanceError as e:
            raise click.ClickException(str(e)) from e
        return command(*args, method=method, **kw)

    options = [
        click.option("--tree-budget", default=None, type=int,
                     help=f"Draft nodes verified per round (default: {DEFAULT_TREE_BUDGET}; an engine's largest; "
                          "a chain's: the drafter's whole block)."),
        click.option("--chain", is_flag=True, help="Verify a width-1 chain (DFlash-style) instead of a tree: the "
                     "drafter's whole block (B-1 tokens) unless --tree-budget caps it."),
        click.option("--lookup", default=None, type=int,
                     help=f"Graft a prompt-lookup chain (n-grams up to N) into each tree; 0: the drafter alone "
                          f"(default: {DEFAULT_LOOKUP} on a drafter's trees, none for chains and autoregression)."),
        click.option("--lookup-budget", default=None, type=int,
                     help=f"Rows a round whose lookup chain fills the tree verifies (the chain alone, no draft "
                          f"pass; default: {DEFAULT_LOOKUP_BUDGET} within the drafter's 2B-1; an engine needs "
                          "that budget bucket)."),
        click.option("--backend", default=None, type=click.Choice(["eager", "compile"]),
                     help="compile: fixed-shape passes under torch.compile (CUDA graphs on a GPU). Default: "
                          "compile on a CUDA device, eager on a CPU."),
        click.option("--engine", "engine_dir", type=click.Path(), default=None,
                     help="Run a built engine (glance-rt build-engine); its manifest sets budgets, shapes and "
                          "sources (--target/--drafter override them)."),
        click.option("--always-draft", is_flag=True,
                     help="Draft every round (no draft gate: by default a round takes one autoregressive step "
                          "where the entropy law and the round costs measured here predict drafting loses)."),
        click.option("--exact", is_flag=True,
                     help="Exact numerics: every verify row computed bit for bit as an autoregressive step, so "
                          "the tokens equal this engine's own AR tokens in bf16/fp16 too (eager or compile; slower)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def sampling_options(command):
    """Token choice, shared by generate, audit and bench: greedy unless --temperature > 0 (HF's
    semantics and defaults); they become one `glance_rt.Sampling`."""

    @functools.wraps(command)
    def wrapper(*args, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, **kw):
        from glance_rt.round.sample import Sampling

        if temperature < 0:
            raise click.ClickException(f"--temperature must be >= 0 (0: greedy), got {temperature}")
        try:
            sampling = Sampling(do_sample=temperature > 0, temperature=temperature or 1.0, top_k=top_k, top_p=top_p,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop))
        except GlanceError as e:
            raise click.ClickException(str(e)) from e
        return command(*args, sampling=sampling, **kw)

    options = [
        click.option("--temperature", default=0.0, show_default=True, type=float,
                     help="Sample at this temperature (0: greedy decoding). Lossless: the tokens equal the same "
                          "engine's autoregressive sampling with the same --seed."),
        click.option("--top-k", default=50, show_default=True, type=int,
                     help="Sampling: keep the k most likely (0: off)."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="Sampling: nucleus mass (1: off)."),
        click.option("--min-p", default=None, type=float,
                     help="Sampling: drop tokens below min_p x the top probability."),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float,
                     help="HF's repetition penalty (greedy too; 1: off)."),
        click.option("--seed", default=0, show_default=True, type=int,
                     help="Sampling seed: the draw for each position depends only on it and the position."),
        click.option("--stop", multiple=True, help="Stop after the token completing this string (repeatable)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


SUITE = click.option("--suite", default="all", show_default=True,
                     help="'all', a task kind (held-out prompts of the shipped corpus), or a JSONL file.")
def _image_size(ctx, param, values):
    sizes = []
    for v in values:
        try:
            w, h = (int(x) for x in v.lower().split("x"))
        except ValueError:
            raise click.BadParameter(f"{v!r}: give an image size as WxH pixels, e.g. 448x448") from None
        sizes.append((w, h))
    return tuple(sizes)


IMAGE_SIZES = click.option("--image-size", "image_sizes", multiple=True, callback=_image_size,
                           help="VLM targets: export a vision graph for images of WxH pixels (repeatable; one "
                                "static image bucket each). Without it the vision tower runs in torch.")
DYNAMIC_ROWS = click.option("--dynamic-rows/--graph-per-bucket", default=None,
                            help="ONNX graphs: one verify graph with a symbolic row dimension for every tree budget "
                                 "bucket (the default, but for --exact: one ONNX Runtime session and one prepacked "
                                 "copy of the weights for all; TensorRT builds it into one engine with an "
                                 "optimization profile per bucket), or a verify graph per bucket.")
SUITE_IMAGES = click.option("--images", type=click.Path(), default=None,
                            help="Folder the suite's image paths are relative to.")


@click.group()
@click.version_option(package_name="glance-rt")
def main():
    """glance-rt: lossless GLANCE speculative decoding for vision-language models."""


LOOKUP_BUCKET = click.option(
    "--lookup-budget", default=None, type=int,
    help=f"Rows of the lookup rounds' verify graph, built beside the tree budgets (default: "
         f"{DEFAULT_LOOKUP_BUDGET} within the drafter's 2B-1, what `generate` runs; 0: none, lookup rounds then "
         "verify the tree's rows).")


def _lookup_bucket(lookup_budget, drafter, chain) -> int:
    """The lookup rounds' verify rows to build (`--lookup-budget`; unset: the decoder's default)."""
    from glance_rt.round.tree import default_lookup_budget, grafts_lookup

    if lookup_budget is not None:
        return lookup_budget
    return default_lookup_budget(drafter.block_size) if grafts_lookup(drafter, chain) else 0


def _load(target_path, drafter_path, dtype, device):
    from glance_rt.hf.embedded import DEFAULT_NAME
    from glance_rt.hf.target import load_target
    from glance_rt.models.drafter import load_drafter

    target = load_target(target_path, dtype=dtype, device=device)
    if drafter_path is not None:
        from glance_rt.models.eagle3 import open_drafter

        return target, open_drafter(drafter_path, target)  # an EAGLE-3 head's folder, or GLANCE's
    if target_path is None:
        try:
            return target, load_drafter(None, target)
        except GlanceError as e:
            click.echo(f"[glance-rt] {e}", err=True)
            click.echo(f"[glance-rt] decoding {DEFAULT_NAME} autoregressively (same engine, no drafter)", err=True)
            return target, None
    click.echo("[glance-rt] no --drafter given: decoding autoregressively (same engine)", err=True)
    return target, None


@main.command()
@TARGET
@DRAFTER
@click.option("--image", "images", type=click.Path(), multiple=True, help="Image file (repeatable).")
@click.option("--prompt", required=True, help="The user message.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@method_options
@sampling_options
@MAX_LENGTH
@DTYPE
@DEVICE
@click.option("--stats", is_flag=True, help="Print acceptance and timing statistics after the answer.")
@click.option("--compare", is_flag=True,
              help="Warm up, then also run the same engine autoregressively: tokens/s of both, tau, and a check "
                   "that the tokens are identical.")
def generate(target_path, drafter_path, images, prompt, max_new_tokens, method, sampling, max_length, dtype, device,
             stats, compare):
    """Stream the target's exact answer to PROMPT (greedy, or sampled with --temperature), drafted and
    tree-verified."""
    from glance_rt.files import open_image

    try:
        pil = [open_image(p) for p in images]
        target, dec, (inputs,) = _method_decoder(method, target_path, drafter_path, dtype, device, max_length,
                                                 lambda t: [t.encode_chat(prompt, pil)], max_new_tokens)
        if compare:
            if dec.drafter is None:  # checked before any work: the answer is not generated only to fail
                raise GlanceError("--compare compares GLANCE with autoregression: it needs a drafter (--drafter "
                                  "PATH, or the default target, which ships one)")
            click.echo(f"[glance-rt] warming up {_describe(dec)} ...", err=True)
            dec.warmup()
        start = time.perf_counter()
        stream = dec.stream(max_new_tokens=max_new_tokens, sampling=sampling, **inputs)
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        elapsed = time.perf_counter() - start
        if compare:
            _compare_with_ar(dec, inputs, max_new_tokens, stream.result, elapsed, sampling)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    if stats:
        s = stream.result.stats
        n = len(stream.result.token_ids)
        click.echo(
            f"[stats] {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s); rounds {s.rounds}; "
            f"tokens per round {s.mean_accepted:.2f}; tau {s.tau:.2f} per drafted round; draft passes "
            f"{s.draft_passes}; prompt {s.prompt_tokens} tokens",
            err=True,
        )
        click.echo("[stats] seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in s.timings.items()), err=True)


def _describe(dec) -> str:
    what = ("autoregression" if dec.drafter is None else f"a chain of {dec.tree_budget}" if dec.chain
            else f"trees of {dec.tree_budget}")
    lookup = f" + prompt lookup {dec.lookup}" if dec.lookup else ""
    numerics = ", exact numerics" if dec.numerics == "exact" else ""
    return f"{what}{lookup}, {dec.backend.name}{numerics}"


def _compare_with_ar(dec, inputs, max_new_tokens, result, elapsed, sampling) -> None:
    """The same engine without a drafter (same backend, caches and shapes; eager for a built engine,
    whose manifest names its drafter), warmed up, on the same prompt: tokens/s of both, tau, and
    whether the tokens are identical (they must be)."""
    from glance_rt.round.loop import Decoder
    from glance_rt.round.verify import BACKENDS

    same_engine = dec.backend.name in BACKENDS  # an engine is loaded with its drafter
    ar = Decoder(dec.target, None, max_length=dec.max_length, backend=dec.backend if same_engine else "eager",
                 numerics=dec.numerics)
    if dec.numerics == "exact" and not same_engine:
        click.echo("[glance-rt] note: an engine's exact numerics are its own; the eager AR it is compared with may "
                   "differ at near ties (compare with an AR engine built with --no-drafter --exact)", err=True)
    click.echo(f"[glance-rt] warming up {_describe(ar)} ...", err=True)
    ar.warmup()
    start = time.perf_counter()
    ref = ar.generate(max_new_tokens=max_new_tokens, sampling=sampling, **inputs)
    ar_elapsed = time.perf_counter() - start
    n, m = len(result.token_ids), len(ref.token_ids)
    same = result.token_ids == ref.token_ids
    name = "EAGLE-3" if dec.grows_tree else "GLANCE"
    click.echo(f"{name} ({_describe(dec)}): {n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, "
               f"{result.stats.mean_accepted:.2f} tokens per round ({result.stats.rounds} rounds, "
               f"{result.stats.draft_passes} draft passes; tau {result.stats.tau:.2f})")
    where = "same engine" if same_engine else "eager: --compare runs an engine's autoregression eagerly; `bench` " \
        "times an AR engine built with --no-drafter against it"
    click.echo(f"autoregressive ({where}):   {m} tokens in {ar_elapsed:.2f} s, {m / ar_elapsed:.1f} tok/s")
    click.echo(f"speed-up {n / elapsed / (m / ar_elapsed):.2f}x; tokens identical: {'yes' if same else 'NO'}")
    if not same:
        raise GlanceError("GLANCE's tokens differ from autoregression's: this is a bug, please report it")


@main.command()
@TARGET
@click.option("--prompts", type=click.Path(), default=None,
              help="JSONL of {prompt, kind?, images?, split?} (default: the corpus shipped for the default target).")
@click.option("--images", type=click.Path(), default=None, help="Folder the prompts' image paths are relative to.")
@click.option("--out", required=True, type=click.Path(), help="Run folder (stages, checkpoints, drafter/, eval.json).")
@click.option("--head", type=click.Choice(["glance", "eagle3"]), default="glance", show_default=True,
              help="The drafter trained: a GLANCE block drafter, or the EAGLE-3 baseline head (one decoder layer "
                   "over 3 fused target layers, training-time test), from the same data by the same loop.")
@click.option("--num-layers", default=1, show_default=True, type=int, help="GLANCE: drafter decoder layers.")
@click.option("--block-size", default=8, show_default=True, type=int, help="GLANCE: tokens per drafted block.")
@click.option("--ttt-steps", default=7, show_default=True, type=int,
              help="EAGLE-3: training-time test's unroll (steps drafted on the head's own states).")
@click.option("--ttt-positions", type=click.Choice(["all", "anchors"]), default="all", show_default=True,
              help="EAGLE-3: the loss at every response position (EAGLE-3's), or at GLANCE's anchors only "
                   "(--blocks-per-seq of them: the same predicted tokens as a GLANCE run, at a fraction of the cost).")
@click.option("--target-layer-ids", default=None,
              help="Comma-separated target layers (default: DFlash's choice for GLANCE; EAGLE-3's 1, L//2-1, L-4).")
@click.option("--response-tokens", default=128, show_default=True, type=int)
@click.option("--response-batch", default=16, show_default=True, type=int)
@click.option("--steps", default=1000, show_default=True, type=int)
@click.option("--batch-size", default=8, show_default=True, type=int, help="Sequences per step (all ranks).")
@click.option("--blocks-per-seq", default=16, show_default=True, type=int)
@click.option("--lr", default=6e-4, show_default=True, type=float)
@click.option("--gamma", default=7.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--save-every", default=100, show_default=True, type=int)
@click.option("--eval-every", default=0, show_default=True, type=int,
              help="Also run the end-of-run eval (the default method and the drafter alone) every N steps: "
                   "tau against training steps, in history.json and history.png (0: at the end only).")
@click.option("--eval-per-kind", default=8, show_default=True, type=int)
@click.option("--eval-budget", default=8, show_default=True, type=int, help="Tree budget of the held-out eval.")
@click.option("--eval-lookup", default=DEFAULT_LOOKUP, show_default=True, type=int,
              help="Prompt-lookup n-gram of the held-out eval (0: the drafter alone).")
@click.option("--limit", default=None, type=int, help="Use only the first N prompts (smoke runs).")
@click.option("--per-kind", default=None, type=int, help="Train on at most N prompts of each kind.")
@click.option("--bf16/--no-bf16", default=None,
              help="bf16 autocast and a bf16 lm_head copy, or fp32 (default: bf16 where it is measured faster: "
                   "GPUs, CPUs with AVX512-BF16 or AMX).")
@click.option("--draft-vocab", default=0, show_default=True, type=int,
              help="Draft vocabulary: the N most frequent response tokens (0: the whole vocabulary, as DFlash "
                   "drafts). A GLANCE drafter with one is glance-rt only; an EAGLE-3 head maps it by d2t.")
@click.option("--mask-token-id", default=None, type=int,
              help="Target token whose embedding masks the block (default: one no text uses; docs/training.md).")
@click.option("--learned-mask", is_flag=True,
              help="Glance-only: learn the mask embedding instead (not DFlash-compatible).")
@click.option("--store", type=click.Path(), default=None,
              help="Response store folder: answers found there are reused, new ones are added (docs/training.md).")
@click.option("--init-from", type=click.Path(), default=None,
              help="Start from this drafter folder's weights (same shape and target layers) instead of a random init.")
@click.option("--init-layers", default=None,
              help="GLANCE: comma-separated target layers the drafter's layers start from, one per drafter layer "
                   "(the target's own circuits instead of a random init; docs/training.md).")
@click.option("--distill", default=0, show_default=True, type=int,
              help="GLANCE: 0 trains on the target's greedy token (CE); K > 0 on the target's top-K distribution "
                   "at each position (soft CE), which teaches the ranks a tree spends its rows on.")
@click.option("--copy-head", is_flag=True,
              help="Glance-only: a pointer over the context rows mixed into each depth's distribution, so answers "
                   "that copy what the target read are drafted by copying (eager backend only; not DFlash-compatible).")
@click.option("--copy-span", is_flag=True,
              help="The copy head in span form (implies --copy-head): one pointer finds where in the context the "
                   "block is, and depth d copies the d-th token after it, a learned prompt lookup.")
@click.option("--features", "feature_mode", type=click.Choice(["cached", "online"]), default="cached",
              show_default=True,
              help="'cached': the target's features are written to disk once (stage 2); 'online': the target "
                   "computes them inside each training step (no cache; for corpora larger than the disk).")
@click.option("--until", type=click.Choice(["responses", "features", "train"]), default="train", show_default=True,
              help="Last stage to run: 'responses' only fills --store (and --out) with the target's answers.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last complete stage/checkpoint.")
def train(target_path, prompts, images, out, head, num_layers, block_size, ttt_steps, ttt_positions, target_layer_ids,
          response_tokens,
          response_batch, steps, batch_size, blocks_per_seq, lr, gamma, seed, save_every, eval_every,
          eval_per_kind, eval_budget, eval_lookup, limit, per_kind, bf16, draft_vocab, mask_token_id,
          learned_mask, store, init_from, init_layers, distill, copy_head, copy_span, feature_mode, until,
          resume):
    """Train a GLANCE drafter (or an EAGLE-3 head) for a target by self-distillation (resumable; torchrun
    for data parallel)."""
    try:
        from glance_rt.hf.target import load_target
        from glance_rt.tools.train import TrainConfig
        from glance_rt.tools.train import train as run_training

        ids = tuple(int(x) for x in target_layer_ids.split(",")) if target_layer_ids else None
        cfg = TrainConfig(out=out, prompts=prompts, images=images, head=head, ttt_steps=ttt_steps,
                          ttt_positions=ttt_positions, num_layers=num_layers, block_size=block_size,
                          target_layer_ids=ids, response_tokens=response_tokens, response_batch=response_batch,
                          steps=steps, batch_size=batch_size, blocks_per_seq=blocks_per_seq, lr=lr, gamma=gamma,
                          seed=seed, save_every=save_every, eval_every=eval_every, eval_per_kind=eval_per_kind,
                          eval_budget=eval_budget, eval_lookup=eval_lookup, limit=limit, per_kind=per_kind,
                          bf16=bf16, draft_vocab=draft_vocab or None, mask_token_id=mask_token_id,
                          learned_mask=learned_mask, store=store, init_from=init_from, distill=distill,
                          copy_head=copy_head or copy_span, copy_span=copy_span,
                          init_layers=tuple(int(x) for x in init_layers.split(",")) if init_layers else None,
                          features=feature_mode,
                          until=until, resume=resume)
        target = load_target(target_path)
        drafter, result = run_training(target, cfg)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    if until != "train":
        click.echo(f"stopped after the {until} stage in {out}" + (f"; response store: {store}" if store else ""))
    if result is not None and head == "eagle3":
        click.echo(f"EAGLE-3 head: {out}/drafter (the format SpecForge writes and vLLM / SGLang load; "
                   f"glance-rt generate/bench --drafter or --eagle3)")
    elif result is not None:
        problems = drafter.config.dflash_problems()
        click.echo(f"drafter: {out}/drafter (DFlash-compatible: "
                   + ("yes)" if not problems else "no, glance-rt only: " + "; ".join(problems) + ")"))
        for name, res in (("default method", result), ("drafter alone", result.get("drafter_alone"))):
            if res is not None:
                click.echo(f"tau, {name} (held-out, tree budget {result['tree_budget']}, lookup {res['lookup']}, "
                           f"every round drafting): overall {res['overall']['tau']:.2f}; "
                           + ", ".join(f"{k} {v['tau']:.2f}" for k, v in res["kinds"].items()))
        alone = result.get("drafter_alone")
        if alone is not None and alone["overall"]["tau"] < ALONE_UNTRAINED:
            click.echo(f"warning: the drafter alone commits {alone['overall']['tau']:.2f} tokens a round: it is "
                       "barely trained, and the default method's tau is mostly prompt lookup. Train longer or on "
                       "more answers (docs/training.md, 'Training a drafter for your own model').", err=True)


@main.command()
@TARGET
@click.option("--out", required=True, type=click.Path(), help="Prompts JSONL to write (for train --prompts).")
@click.option("--count", default=1000, show_default=True, type=int, help="Prompts to keep.")
@click.option("--batch", default=16, show_default=True, type=int, help="Samples per generate call.")
@click.option("--max-tokens", default=128, show_default=True, type=int,
              help="A sample still going at this length is dropped.")
@click.option("--temperature", default=1.0, show_default=True, type=float)
@click.option("--top-p", default=0.95, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
def magpie(target_path, out, count, batch, max_tokens, temperature, top_p, seed):
    """Prompts the target writes itself from its chat template's user-turn prefix (Magpie), filtered for
    degenerate and duplicate ones, split train/held-out by text hash; resumable."""
    from glance_rt.hf.target import load_target
    from glance_rt.tools.magpie import MagpieConfig, make_prompts

    try:
        if count < 1 or batch < 1 or max_tokens < 1 or temperature <= 0 or not 0 < top_p <= 1:
            raise GlanceError("--count, --batch and --max-tokens must be at least 1, --temperature above 0 and "
                              "--top-p in (0, 1]")
        target = load_target(target_path)
        cfg = MagpieConfig(count, batch, max_tokens, temperature, top_p, seed)
        summary = make_prompts(target, out, cfg)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"magpie: {summary['prompts']} prompts ({summary['heldout']} held out) in {out} from "
               f"{summary['samples']} samples in {summary['seconds']:.0f} s; dropped: "
               + (", ".join(f"{k} {v}" for k, v in sorted(summary["dropped"].items())) or "none"))
    if summary["prompts"] < count:
        click.echo(f"[glance-rt] only {summary['prompts']} of {count} prompts after {summary['batches']} batches: "
                   "the target repeats itself; raise --temperature or change --seed", err=True)


@main.command("check-drafter")
@click.argument("path", type=click.Path(), required=False)
@click.option("--dflash", is_flag=True,
              help="Fail unless DFlash's reference (z-lab/dflash, so vLLM / SGLang too) drafts the same tokens.")
def check_drafter(path, dflash):
    """Describe a drafter folder (default: the shipped one) and whether it is DFlash-compatible."""
    from glance_rt.hf.embedded import DRAFTER_DIR
    from glance_rt.models.drafter import check_dflash, read_drafter

    try:
        drafter = read_drafter(path or DRAFTER_DIR)
        c = drafter.config
        mask = "learned embedding" if c.learned_mask else f"token {c.mask_token_id}"
        vocab = f"{c.draft_vocab_size} of {c.vocab_size}" if c.draft_vocab_size else f"all {c.vocab_size}"
        click.echo(f"{c.num_hidden_layers} layers, block {c.block_size}, target layers {list(c.target_layer_ids)} "
                   f"of {c.num_target_layers}, mask {mask}, draft vocabulary {vocab}, "
                   f"RoPE {c.rope_parameters['rope_type']} (theta {c.rope_theta:g})")
        problems = c.dflash_problems()
        click.echo("DFlash-compatible: " + ("yes (same draft tokens in z-lab/dflash, vLLM, SGLang)" if not problems
                                           else "no, glance-rt only: " + "; ".join(problems)))
        if dflash:
            check_dflash(drafter)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@TARGET
@DRAFTER
@SUITE
@click.option("--per-kind", default=8, show_default=True, type=int, help="At most N prompts of each kind.")
@SUITE_IMAGES
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@method_options
@sampling_options
@MAX_LENGTH
@DTYPE
@DEVICE
@click.option("--threshold", default=None, type=float,
              help="Fail only on divergences whose top-1/top-2 margin exceeds this (default: any divergence).")
@click.option("--json", "json_out", type=click.Path(), default=None,
              help="Write the per-prompt report here (JSON; gzip-compressed if the name ends in .gz).")
def audit(target_path, drafter_path, suite, per_kind, images, max_new_tokens, method, sampling, max_length, dtype,
          device, threshold, json_out):
    """Check every output against HF greedy decoding (sampling, or --exact: against the same engine's
    autoregression, with the same seed); exit 1 on a divergence (above --threshold)."""
    from dataclasses import asdict

    from glance_rt.tools import audit as audit_mod
    from glance_rt.tools.suites import encode_rows, suite_rows

    try:
        rows = suite_rows(suite, per_kind)
        target, dec, encoded = _method_decoder(method, target_path, drafter_path, dtype, device, max_length,
                                               lambda t: encode_rows(t, rows, images), max_new_tokens)
        results = []
        try:
            for r in audit_mod.audit(target, dec, rows, encoded, max_new_tokens, sampling=sampling):
                results.append(r)
                margin = "" if r.margin is None else f", margin {r.margin:.4f}"
                line = "exact" if r.exact else (f"DIVERGES at token {r.divergence}: expected {r.expected}, "
                                                f"got {r.got}{margin}")
                click.echo(f"{r.id:<20} {r.kind:<12} {line}")
        except KeyboardInterrupt:
            click.echo("[audit] interrupted: reporting what was checked", err=True)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    bad = audit_mod.failures(results, threshold)
    exact = sum(r.exact for r in results)
    click.echo(f"[audit] {exact}/{len(results)} exact; {len(bad)} failing divergence(s) "
               f"({'any divergence fails' if threshold is None else f'margin > {threshold}'}); "
               f"{_describe(dec)}; dtype {str(target.dtype).removeprefix('torch.')}; against "
               f"{audit_mod.reference_name(dec, sampling)}")
    if json_out:
        from glance_rt.files import write_json

        report = audit_mod.to_json(results, {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."),
                                             "threshold": threshold, "method": dec.method_name,
                                             "tree_budget": dec.tree_budget, "chain": dec.chain, "lookup": dec.lookup,
                                             "backend": dec.backend.name, "engine": method.engine,
                                             "sampling": asdict(sampling), "numerics": dec.numerics,
                                             "reference": audit_mod.reference_name(dec, sampling),
                                             "drafter": drafter_path or ("default" if dec.drafter else None)})
        write_json(json_out, report)
    if bad:
        raise SystemExit(1)


@main.command()
@TARGET
@DRAFTER
@SUITE
@click.option("--per-kind", default=4, show_default=True, type=int, help="At most N prompts of each kind.")
@SUITE_IMAGES
@click.option("--methods", default="ar,chain,tree-8,tree-16,tree-32,tree-64,adaptive,hf,hf-lookup", show_default=True,
              help="Comma-separated: ar, chain, tree-N, tree-N+lookup, tree-N+lookup-L (lookup rounds of L rows), "
                   "adaptive, eagle3-N (with --eagle3) (each optionally @compile, or @plain: eager without prepacked "
                   "weights), hf, hf-lookup.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--warmup", default=1, show_default=True, type=int, help="Prompts run untimed first.")
@DTYPE
@DEVICE
@click.option("--engine", "engines", type=click.Path(), multiple=True,
              help="Also bench a built engine (repeatable), as method BASE@BACKEND:NAME.")
@click.option("--engine-lookup", is_flag=True,
              help="Also run each drafter engine with prompt lookup (BASE+lookup@BACKEND:NAME).")
@click.option("--json", "json_out", type=click.Path(), default=None,
              help="Machine-readable report (JSON; gzip-compressed if the name ends in .gz).")
@click.option("--report", "report_md", type=click.Path(), default=None, help="Markdown report.")
@click.option("--plots", "plot_dir", type=click.Path(), default=None, help="Folder for PNG plots.")
@click.option("--eagle3", "eagle3_path", type=click.Path(), default=None,
              help="An EAGLE-3 head's folder: the eagle3-N methods draft with it (the baseline beside tree-N).")
@sampling_options
def bench(target_path, drafter_path, suite, per_kind, images, methods, max_new_tokens, warmup, dtype, device,
          engines, engine_lookup, json_out, report_md, plot_dir, eagle3_path, sampling):
    """Methods side by side in one process, interleaved per prompt, every output checked against HF greedy
    (with --temperature: against autoregressive sampling with the same seed, method ar)."""
    from glance_rt.tools import bench as bench_mod
    from glance_rt.tools.suites import suite_rows

    try:
        target, drafter = _load(target_path, drafter_path, dtype, device)
        rows = suite_rows(suite, per_kind)
        cfg = bench_mod.BenchConfig(methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                                    max_new_tokens=max_new_tokens, warmup=warmup, engines=tuple(engines),
                                    engine_lookup=engine_lookup, sampling=sampling)
        eagle3 = None
        if eagle3_path is not None:
            from glance_rt.models.eagle3 import load_eagle3

            eagle3 = load_eagle3(eagle3_path, target)
        report = bench_mod.run_bench(target, drafter, rows, cfg, images, log=lambda m: click.echo(m, err=True),
                                     eagle3=eagle3)
        bench_mod.write_outputs(report, json_out, report_md, plot_dir)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    click.echo(bench_mod.markdown(report))
    if report["mismatches"]:
        raise SystemExit(1)


def _method_decoder(method: Method, target_path, drafter_path, dtype, device, max_length, encode, max_new_tokens,
                    max_batch: int | None = 1, prefill_chunk: int | None = None):
    """-> (target, the Decoder that runs `method`, the job's encoded prompts `encode(target)`). The
    static caches are sized to the job (`glance_rt.method.job_max_length`) unless --max-length is
    given; an engine's are its manifest's, its target and drafter its sources unless overridden.
    `max_batch`: sequences decoded at once (`Decoder`); None: `DEFAULT_SERVE_BATCH` where the method runs
    batched rounds (eager or compiled passes over a GLANCE drafter or none), else 1. `prefill_chunk`: as
    in `Decoder`."""
    from glance_rt.round.loop import Decoder

    if method.engine is not None:
        dec = _engine_decoder(method, target_path, drafter_path, max_batch, prefill_chunk)
        return dec.target, dec, encode(dec.target)
    from dataclasses import replace

    from glance_rt.models.eagle3 import Eagle3Drafter

    target, drafter = _load(target_path, drafter_path, dtype, device)
    if isinstance(drafter, Eagle3Drafter) and method.kind == "tree":  # --drafter named an EAGLE-3 head: its trees
        method = replace(method, kind="eagle3", lookup=0 if method.lookup is None else method.lookup)
    encoded = encode(target)
    if max_length is None:
        longest = max(e["input_ids"].shape[1] for e in encoded)
        max_length = job_max_length(longest, max_new_tokens, [method.tree_budget])
    if max_batch is None:
        from glance_rt.method import default_backend

        batched = (method.backend or default_backend(target.device)) in ("eager", "plain", "compile")
        max_batch = DEFAULT_SERVE_BATCH if batched and not isinstance(drafter, Eagle3Drafter) else 1
    return target, Decoder.from_method(method, target, drafter, max_length, max_batch=max_batch,
                                       prefill_chunk=prefill_chunk), encoded


def _engine_decoder(method: Method, target_path, drafter_path, max_batch: int | None = None,
                    prefill_chunk: int | None = None):
    """Decoder.from_engine, with --target/--drafter overriding the sources its manifest names
    (`max_batch` None: the engine's)."""
    from glance_rt.export.manifest import read_manifest
    from glance_rt.hf.target import load_target
    from glance_rt.models.eagle3 import open_drafter
    from glance_rt.round.loop import Decoder

    m = read_manifest(method.engine)
    target = drafter = None
    if target_path is not None or drafter_path is not None:
        target = load_target(target_path or m["target_source"], dtype=m["source"]["dtype"],
                             device=m["source"]["device"])
    if drafter_path is not None:
        drafter = open_drafter(drafter_path, target, m.get("eagle3"))  # drafting as the engine was built
    return Decoder.from_method(method, target, drafter, max_batch=max_batch, prefill_chunk=prefill_chunk)


@main.command("build-engine")
@TARGET
@DRAFTER
@click.option("--backend", default="aoti", show_default=True,
              type=click.Choice(["aoti", "onnxruntime", "tensorrt"]),
              help="aoti: AOTInductor packages (one .pt2 per static graph); onnxruntime: exported ONNX graphs "
                   "saved optimized for ONNX Runtime; tensorrt: one TensorRT engine per graph, tree attention "
                   "as glance-rt's Triton kernel in a plugin (needs a GPU, --device cuda, and TensorRT).")
@click.option("--tree-budget", "budgets", default=(0, 8), show_default=True, type=int, multiple=True,
              help="Tree budget bucket (repeatable): one verify graph each; 0 adds the one-row verify graph the "
                   "draft gate's autoregressive steps run (without it the engine drafts every round).")
@click.option("--chain", is_flag=True, help="Build the width-1 chain's verify graph instead.")
@click.option("--max-length", default=1024, show_default=True, type=int,
              help="Static cache rows (prompt + new tokens + one round); attention reads all of them.")
@click.option("--chunk", default=64, show_default=True, type=int, help="Prompt rows per prefill pass.")
@click.option("--no-drafter", is_flag=True, help="Build autoregression only.")
@click.option("--flavor", default=None, type=click.Choice(["frozen", "shared", "portable", "plugin"]),
              help="aoti: frozen compiles the weights into each package (oneDNN-packed linears on a CPU; a "
                   "copy of the weights per package), shared gives all packages one copy at load (MKL); unset, "
                   "each graph gets the one measured faster on this machine. "
                   "onnxruntime: portable (default) runs tree attention as standard ONNX ops; plugin as one "
                   "glance.TreeAttention node through glance-rt's compiled kernel library (needs --ort-include). "
                   "tensorrt: plugin only.")
@LOOKUP_BUCKET
@IMAGE_SIZES
@click.option("--ort-include", type=click.Path(), default=None,
              help="Folder with ONNX Runtime's C API header onnxruntime_c_api.h (plugin flavor; default: "
                   "/usr/local/include/onnxruntime, /usr/include/onnxruntime, ...).")
@DTYPE
@DEVICE
@click.option("--exact", is_flag=True, help="aoti, onnxruntime: the decode graphs in exact numerics (verify rows "
              "with the AR step's bits; `generate --engine` then runs them so; onnxruntime: one sequence, a verify "
              "graph per tree bucket).")
@click.option("--max-batch", default=1, show_default=True, type=int,
              help="sequences the engine decodes at once (batched verify and draft graphs: aoti a package per "
                   "batch bucket, onnxruntime one graph each with symbolic slots, tensorrt one engine each with a "
                   "profile per bucket; for `serve` and glance_rt.Batch); a cache slot of --max-length rows each.")
@click.option("--mapped-weights", is_flag=True,
              help="onnxruntime: every session reads one memory map of the engine's weights file (one copy in "
                   "memory, shared with the page cache) instead of each prepacking its own copy (faster GEMMs).")
@DYNAMIC_ROWS
@click.option("--out", required=True, type=click.Path(), help="Engine folder (resumes an interrupted build).")
def build_engine(target_path, drafter_path, backend, budgets, chain, max_length, chunk, no_drafter, flavor,
                 lookup_budget, image_sizes, ort_include, dtype, device, exact, max_batch, mapped_weights,
                 dynamic_rows, out):
    """Compile the draft, verify and prefill passes of a target (+ drafter) into an engine folder."""
    from glance_rt.engines.engine import build_engine as build

    try:
        target, drafter = _load(target_path, drafter_path, dtype, device)
        if no_drafter:
            drafter = None
        start = time.perf_counter()
        build(target, drafter, out, backend=backend, budgets=budgets, chain=chain, max_len=max_length, chunk=chunk,
              target_source=target_path, drafter_source=drafter_path, flavor=flavor, ort_include=ort_include,
              image_sizes=image_sizes, lookup_budget=_lookup_bucket(lookup_budget, drafter, chain),
              numerics="exact" if exact else "fast", max_batch=max_batch, mapped_weights=mapped_weights,
              dynamic_rows=dynamic_rows)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"engine: {out} ({backend}, {time.perf_counter() - start:.0f} s)")


@main.command("export")
@TARGET
@DRAFTER
@click.option("--out", required=True, type=click.Path(), help="Export folder (resumes an interrupted export).")
@click.option("--tree-budget", "budgets", default=(8,), show_default=True, type=int, multiple=True,
              help="Tree budget bucket (repeatable): one verify graph each.")
@click.option("--chain", is_flag=True, help="Export the width-1 chain's verify graph instead.")
@click.option("--max-length", default=1024, show_default=True, type=int, help="Static cache rows.")
@click.option("--chunk", default=64, show_default=True, type=int, help="Prompt rows per prefill graph call.")
@click.option("--opset", default=20, show_default=True, type=int)
@click.option("--flavor", default="portable", show_default=True, type=click.Choice(["portable", "plugin"]),
              help="portable: tree attention also as a model-local ONNX function (runs anywhere); "
                   "plugin: the glance.TreeAttention node alone, for a runtime with its kernel (TensorRT plugin).")
@click.option("--no-drafter", is_flag=True, help="Export the target's graphs only.")
@LOOKUP_BUCKET
@IMAGE_SIZES
@DTYPE
@DYNAMIC_ROWS
def export(target_path, drafter_path, out, budgets, chain, max_length, chunk, opset, flavor, no_drafter, lookup_budget,
           image_sizes, dtype, dynamic_rows):
    """Export the target's prefill and tree-verify graphs and the drafter's graphs to ONNX."""
    from glance_rt.export.onnx import export_model

    try:
        target, drafter = _load(target_path, drafter_path, dtype, "cpu")
        if no_drafter:
            drafter = None
        start = time.perf_counter()
        export_model(target, drafter, out, flavor=flavor, opset=opset, budgets=budgets, chain=chain,
                     max_len=max_length, chunk=chunk, target_source=target_path, drafter_source=drafter_path,
                     image_sizes=image_sizes, lookup_budget=_lookup_bucket(lookup_budget, drafter, chain),
                     dynamic_rows=dynamic_rows is not False)
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"onnx: {out} ({flavor}, opset {opset}, {time.perf_counter() - start:.0f} s); graphs in {out}/GRAPHS.md")



@main.command()
@TARGET
@DRAFTER
@method_options
@click.option("--max-length", default=2048, show_default=True, type=int,
              help="Static cache rows: the longest prompt + completion a request may have (engines: theirs).")
@DTYPE
@DEVICE
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-queue", default=16, show_default=True, type=int,
              help="Requests waiting beyond the one being decoded; more get 429 with Retry-After.")
@click.option("--request-timeout", default=600.0, show_default=True, type=float,
              help="Seconds a request may take from arrival; past it, it stops at the next round (408).")
@click.option("--max-tokens", "default_max_tokens", default=256, show_default=True, type=int,
              help="Completion tokens when a request names no max_tokens.")
@click.option("--model-name", default=None, help="The model id /v1/models lists (default: the target's name).")
@click.option("--max-batch", type=int, default=None,
              help=f"Requests decoded at once (continuous batching; a cache slot of --max-length rows each). "
                   f"Default: {DEFAULT_SERVE_BATCH} where batched rounds run (eager or compiled passes; not "
                   f"EAGLE-3 heads), else 1; with --engine, the batch the engine was built for "
                   f"(build-engine --max-batch).")
@click.option("--api-key", envvar="GLANCE_RT_API_KEY", default=None,
              help="Every /v1 request must send 'Authorization: Bearer KEY' (401 otherwise; /health and /metrics "
                   "stay open). Required to bind anywhere but loopback. Env: GLANCE_RT_API_KEY.")
@click.option("--prefill-chunk", type=int, default=0, show_default=True,
              help="Prompt rows prefilled per step while other requests decode: a long prompt joining is spread "
                   "over several steps instead of stalling the running streams (a smoother stream, at some "
                   "throughput and time to first token on a CPU: docs/usage.md); 0: each prompt in one pass.")
def serve(target_path, drafter_path, method, max_length, dtype, device, host, port, max_queue, request_timeout,
          default_max_tokens, model_name, max_batch, api_key, prefill_chunk):
    """Serve the target over an OpenAI-compatible HTTP API (chat and text completions, streaming,
    images, /metrics), decoding up to --max-batch requests at once (continuous batching: each joins at a
    round boundary) from a bounded queue; warms up before it reports ready."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise click.ClickException("serve needs fastapi and uvicorn: pip install 'glance-rt[serve]'") from e
    from glance_rt.server.app import create_app, loopback
    from glance_rt.server.app import serve as run_server

    if not loopback(host) and not api_key:
        raise click.ClickException(f"--host {host} is reachable from other machines: pass --api-key KEY (or set "
                                   "GLANCE_RT_API_KEY) so that only clients with the key are served")
    if max_batch is not None and max_batch < 1:
        raise click.ClickException(f"--max-batch must be at least 1, got {max_batch}")
    if prefill_chunk < 0:
        raise click.ClickException(f"--prefill-chunk must be 0 (off) or a number of prompt rows, got {prefill_chunk}")
    try:
        target, dec, _ = _method_decoder(method, target_path, drafter_path, dtype, device, max_length,
                                         lambda t: [], default_max_tokens, max_batch, prefill_chunk or None)
        click.echo(f"[glance-rt] warming up {_describe(dec)} ...", err=True)
        dec.warmup()
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    name = model_name or target.name
    app, worker = create_app(dec, name, max_queue=max_queue, request_timeout=request_timeout,
                             default_max_tokens=default_max_tokens, api_key=api_key)
    click.echo(f"[glance-rt] serving {name} ({_describe(dec)}) on http://{host}:{port}/v1", err=True)
    run_server(app, worker, host, port)


if __name__ == "__main__":
    main()

"""The `glance-rt` command."""

import sys
import time

import click

from glance_rt.errors import GlanceError


@click.group()
@click.version_option(package_name="glance-rt")
def main():
    """glance-rt: lossless GLANCE speculative decoding for vision-language models."""


def _load(target_path, drafter_path, dtype, device):
    import glance_rt
    from glance_rt.embedded import DEFAULT_NAME

    target = glance_rt.load_target(target_path, dtype=dtype, device=device)
    if drafter_path is not None:
        return target, glance_rt.load_drafter(drafter_path, target)
    if target_path is None:
        try:
            return target, glance_rt.load_drafter(None, target)
        except GlanceError as e:
            click.echo(f"[glance-rt] {e}", err=True)
            click.echo(f"[glance-rt] decoding {DEFAULT_NAME} autoregressively (same engine, no drafter)", err=True)
            return target, None
    click.echo("[glance-rt] no --drafter given: decoding autoregressively (same engine)", err=True)
    return target, None


@main.command()
@click.option("--target", "target_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", "drafter_path", type=click.Path(), default=None, help="Drafter folder.")
@click.option("--image", "images", type=click.Path(), multiple=True, help="Image file (repeatable).")
@click.option("--prompt", required=True, help="The user message.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--tree-budget", default=32, show_default=True, type=int, help="Draft nodes verified per round.")
@click.option("--chain", is_flag=True, help="Verify a width-1 chain (DFlash-style) instead of a tree.")
@click.option("--max-length", default=2048, show_default=True, type=int, help="Static cache rows.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", default="cpu", show_default=True)
@click.option("--stats", is_flag=True, help="Print acceptance and timing statistics after the answer.")
def generate(target_path, drafter_path, images, prompt, max_new_tokens, tree_budget, chain, max_length, dtype,
             device, stats):
    """Stream the target's exact greedy answer to PROMPT, drafted and tree-verified."""
    try:
        from glance_rt.decoder import Decoder

        target, drafter = _load(target_path, drafter_path, dtype, device)
        pil = [_open_image(p) for p in images]
        inputs = target.encode_chat(prompt, pil)
        dec = Decoder(target, drafter, tree_budget=tree_budget, chain=chain, max_length=max_length)
        start = time.perf_counter()
        stream = dec.stream(max_new_tokens=max_new_tokens, **inputs)
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        elapsed = time.perf_counter() - start
    except GlanceError as e:
        raise click.ClickException(str(e)) from e
    if stats:
        s = stream.result.stats
        n = len(stream.result.token_ids)
        click.echo(
            f"[stats] {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s); rounds {s.rounds}; "
            f"mean accepted {s.mean_accepted:.2f}; draft passes {s.draft_passes}; prompt {s.prompt_tokens} tokens",
            err=True,
        )
        click.echo("[stats] seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in s.timings.items()), err=True)


def _open_image(path):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise GlanceError(f"could not open image {path!r} ({e}); give a PNG/JPEG file") from e


if __name__ == "__main__":
    main()

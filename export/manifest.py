"""Engine manifests: what an engine was built from and for, checked before it runs.

An engine folder holds one artifact per graph and `manifest.json`, written last (an engine without
a manifest is an unfinished build). Loading refuses an engine whose target or drafter weights,
device, dtype or library versions differ from the running ones, and says what differs.
"""

import hashlib
import json
from importlib import metadata
from pathlib import Path

import torch

from glance_rt import __version__
from glance_rt.errors import GlanceError
from glance_rt.files import check_json_fields
from glance_rt.models.eagle3 import Eagle3Drafter
from glance_rt.round.tree import check_budget, check_lookup_budget, with_lookup_bucket

FORMAT = "glance-rt/engine/3"  # 2: draft context and accepted paths of max_depth + 1 rows (deep lookup chains);
# 3: the target decoder's weights are named per row class (`stacks.0.…`, `heads.0`)


def weights_hash(module) -> str:
    """sha256 over a module's parameters and persistent buffers (names, shapes, dtypes, bytes)."""
    h = hashlib.sha256()
    seen = set()
    for name, t in sorted(module.state_dict(keep_vars=False).items()):
        if t.data_ptr() in seen:  # tied weights hash once
            continue
        seen.add(t.data_ptr())
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def versions() -> dict:
    import transformers

    return {"glance_rt": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def source(target, drafter) -> dict:
    """Fingerprint of what an engine computes with: the target's weights (vision tower included, for
    an engine's vision graphs) and the drafter's (an EAGLE-3 drafter's: its head's)."""
    drafter = drafter.head if isinstance(drafter, Eagle3Drafter) else drafter
    return {
        "target": target.name,
        "target_weights": weights_hash(target.hf_model),
        "drafter_weights": weights_hash(drafter) if drafter is not None else None,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": target.device.type,
    }


def eagle3_shape(drafter) -> dict | None:
    """How an EAGLE-3 drafter drafts, which its graphs' shapes fix (the head's scratch rows and depth
    passes of `top_k` rows); None for other drafters."""
    if not isinstance(drafter, Eagle3Drafter):
        return None
    return {"depth": drafter.depth, "top_k": drafter.top_k}


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(out / "manifest.json")


MANIFEST_FIELDS = {  # the kind (glance_rt.files.JSON_KINDS) of each manifest.json field a load reads
    **dict.fromkeys(("format", "backend", "numerics", "cache_layout"), "string"),
    **dict.fromkeys(("source", "versions", "graphs", "kernels", "vision"), "object"),
    **dict.fromkeys(("budgets", "tree_budgets"), "integers"),
    **dict.fromkeys(("lookup_budget", "max_len", "chunk", "max_batch", "block_size"), "integer"),
    **dict.fromkeys(("chain", "dynamic_rows"), "boolean"),
}


def read_manifest(path, backend: str | None = None) -> dict:
    path = Path(path)
    file = path / "manifest.json"
    if not file.exists():
        if path.exists():
            raise GlanceError(f"{path} holds no finished engine (no manifest.json): rerun `glance-rt build-engine` "
                              "with the same --out to finish the build")
        raise GlanceError(f"engine folder {path} does not exist: build one with `glance-rt build-engine --out {path}`")
    try:
        m = json.loads(file.read_text())
    except ValueError as e:
        raise GlanceError(f"{file} is corrupt ({e}): rebuild the engine") from e
    check_json_fields(m, MANIFEST_FIELDS, f"the engine manifest {file}")
    if m.get("format") != FORMAT:
        raise GlanceError(f"{file} is not a {FORMAT} manifest (format {m.get('format')!r}): rebuild the engine")
    if backend is not None and m["backend"] != backend:
        raise GlanceError(f"{path} is a {m['backend']} engine, not {backend}")
    return m


def check_manifest(m: dict, target, drafter, path) -> None:
    """Refuse an engine built for another target, drafter, dtype, device or library versions."""
    problems = []
    have_versions = versions()
    for k, want in m["versions"].items():
        if k not in have_versions:  # a backend's own library (onnx, onnxruntime, ...)
            try:
                have_versions[k] = metadata.version(k)
            except metadata.PackageNotFoundError:
                have_versions[k] = None
        if have_versions.get(k) != want:
            problems.append(f"{k} {have_versions.get(k)} here, engine built with {want}")
    have = source(target, drafter)
    labels = {"target_weights": "target weights", "drafter_weights": "drafter weights"}
    for k, want in m["source"].items():
        if k == "target":
            continue
        if have[k] != want:
            if k in labels:
                here, there = (have[k] or "none")[:12], (want or "none")[:12]
                problems.append(f"{labels[k]} differ ({here} here, {there} in the engine)")
            else:
                problems.append(f"{k} is {have[k]} here, engine built for {want}")
    if drafter is not None and m.get("eagle3") != eagle3_shape(drafter):
        problems.append(f"the EAGLE-3 drafter drafts {eagle3_shape(drafter)} here, the engine's graphs were built "
                        f"for {m.get('eagle3')} (load it with load_eagle3(..., depth=, top_k=) as built)")
    if problems:
        raise GlanceError(f"engine {path} was built for something else: " + "; ".join(problems)
                          + ". Rebuild it with `glance-rt build-engine` for this target and drafter.")


def describe_graphs(info: dict) -> str:
    """GRAPHS.md: every graph's inputs and outputs (name, shape, dtype) as Markdown tables."""
    lines = []
    for g in info.values():
        lines += [f"## {g['file']}", "", "| | name | shape | dtype |", "|---|---|---|---|"]
        lines += [f"| in | {n} | {s} | {d} |" for n, s, d in g["inputs"]]
        lines += [f"| out | {n} | {s} | {d} |" for n, s, d in g["outputs"]]
        lines.append("")
    return "\n".join(lines)


def graph_budgets(drafter, budgets, max_len: int, chunk: int) -> tuple[int, ...]:
    """The tree budgets an engine or export builds a verify graph for (sorted, distinct; (0,) for
    autoregression), after checking them and the static shapes, as a Decoder would."""
    if drafter is None:
        budgets = (0,)  # autoregression: one verify graph of one row
    else:
        budgets = tuple(sorted(set(budgets)))  # 0: the one-row verify graph the draft gate's steps run
        if not any(budgets):
            raise GlanceError("no tree budget given: pass at least one (--tree-budget N; 0 adds the draft gate's "
                              "one-row verify graph)")
        for b in budgets:
            if b:
                check_budget(b)
    if max_len < 2 or chunk < 1:
        raise GlanceError(f"max_len must be at least 2 and chunk at least 1, got {max_len} and {chunk}")
    return budgets


def lookup_buckets(drafter, chain: bool, budgets: tuple[int, ...], lookup_budget: int) -> tuple[int, ...]:
    """The verify buckets to build: the tree `budgets`, and the `lookup_budget` rows of lookup rounds
    where they exceed the smallest tree's (a Decoder's `budgets` rule)."""
    if not lookup_budget:
        return budgets
    if drafter is None or chain:
        raise GlanceError("lookup_budget sizes the verify graph of prompt-lookup rounds, which a tree engine with a "
                          "drafter runs: drop --lookup-budget (or pass 0) with --chain or --no-drafter")
    check_lookup_budget(lookup_budget, drafter.block_size)
    return tuple(with_lookup_bucket(budgets, lookup_budget))

"""AOTInductor engines: one `.pt2` package per graph of `glance_rt.round.verify.StaticGraphs`. All but
prefill have fixed shapes; prefill is exported with a dynamic row count, so the prompt runs in one
exact-length pass (padded chunks cost up to chunk-1 rows of wasted work per prompt).

Two flavors, per graph (`build-engine` with no --flavor times each graph's linear layers both ways
and picks the faster; the manifest says "mixed" where the graphs differ):
- `frozen`: Inductor freezing compiles the weights into every package as constants, and
  folds what can be computed from them at build time: on a CPU each linear layer's weight is stored
  reordered for oneDNN and runs as one `mkldnn._linear_pointwise` call from the C++ wrapper (faster
  than MKL at a round's few rows on some CPUs, slower on others: docs/engines.md). The cost: each package holds
  its own copy of the weights it uses (disk and memory grow with the number of budget buckets).
- `shared`: packages are built without their weights (`package_constants_in_so=False`); at load
  every package gets the running model's weights as user-managed constants, so all of them share
  one copy (and run its plain layout: MKL's GEMM on a CPU).
Either way the KV caches are the running model's buffers, handed to every package at load, so
prefill, verify (one package per tree-budget bucket), draft and context write the same caches in
place. An EAGLE-3 head's engine holds its context pass (C rows) and a depth pass per beam width
(`eagle3_depth-{k}`); its tree grows on the host between them, as with backend="compile".
The manifest pins the weights the packages were built from.
"""

import json
import time
from pathlib import Path

import torch
from torch import nn

from glance_rt.errors import GlanceError
from glance_rt.round.verify import MIN_PREFILL_ROWS, by_rows, drafts, example_inputs, static_shapes

BACKEND = "aoti"


class _Entry(nn.Module):
    """One graph of a StaticGraphs as a module to export (its constants are `graphs.*`)."""

    def __init__(self, graphs, name: str):
        super().__init__()
        self.graphs, self.name = graphs, name

    def forward(self, *args):
        return getattr(self.graphs, self.name)(*args)


def inductor_configs(flavor: str) -> dict:
    if flavor == "frozen":
        return {"freezing": True}
    return {"aot_inductor.package_constants_in_so": False}


def build(graphs, out: Path, budgets, chain: bool, chunk: int, manifest: dict, progress: bool = True,
          flavor: str | dict = "frozen") -> None:
    """Export and AOT-compile every graph of `graphs` (StaticGraphs) into `out` (resumable:
    finished packages are kept). `flavor`: one for all graphs, or {graph name: flavor}."""
    from tqdm import tqdm


    jobs = example_inputs(graphs, static_shapes(graphs, chunk), budgets, chain)
    # prefill takes the prompt at its length (MIN_PREFILL_ROWS..max_len rows): one pass, no padded chunk
    rows = torch.export.Dim("prompt_rows", min=MIN_PREFILL_ROWS, max=graphs.max_len)
    positions = jobs["prefill"][1]
    dynamic = {"prefill": (({1: rows}, {positions.dim() - 1: rows}, None, None),)}
    manifest["prefill"] = "exact"
    files, bar = {}, tqdm(jobs.items(), desc="aoti packages", unit="graph", disable=not progress)
    for name, args in bar:
        bar.set_postfix_str(name)
        file = out / f"{name}.pt2"
        inputs = [[list(a.shape), str(a.dtype).removeprefix("torch.")] for a in args]
        graph_flavor = flavor if isinstance(flavor, str) else flavor[name]
        files[name] = {"file": file.name, "inputs": inputs, "flavor": graph_flavor}
        if file.exists():  # finished by an earlier (interrupted) build
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(_Entry(graphs, name.split("-")[0]), args, strict=False,
                                     dynamic_shapes=dynamic.get(name))
            tmp = out / f"{name}.tmp.pt2"
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                     inductor_configs=inductor_configs(graph_flavor))
        tmp.replace(file)
        files[name]["build_seconds"] = round(time.perf_counter() - t0, 1)
    manifest["graphs"] = files
    manifest["aliases"] = drafter_aliases(graphs)


def drafter_aliases(graphs) -> dict:
    """{the drafter's name of a weight it shares with the target: the target's name for it} (the embeddings
    and lm_head): a package may name a shared constant either way, and a load without the drafter (an
    audit's AR over a GLANCE engine) has only the target's names."""
    names, aliases = {}, {}
    for n, t in [*graphs.named_parameters(remove_duplicate=False), *graphs.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(f"graphs.{n}")
    for group in names.values():
        drafter = [n for n in group if n.startswith("graphs.draft_pass.")]
        target = [n for n in group if n not in drafter]
        if drafter and target:
            aliases.update(dict.fromkeys(drafter, target[0]))
    return aliases


def runners(path: Path, manifest: dict, graphs) -> dict:
    """Load every package with `graphs`' caches (and, `shared` graphs, weights) as user-managed
    constants -> the callables StaticPasses runs (verify dispatches on the tree's row count). A frozen
    package keeps the constants compiled into it (its folded weights have no name in `graphs`);
    every one of its constants that names a buffer or parameter of `graphs` is taken from `graphs`. Without
    a drafter (an audit's AR over a GLANCE engine) the drafter's packages are not loaded."""
    consts = {}
    for n, t in [*graphs.named_parameters(remove_duplicate=False), *graphs.named_buffers(remove_duplicate=False)]:
        consts[f"graphs.{n}"] = t.detach()
    for alias, name in manifest.get("aliases", {}).items():
        if name in consts:
            consts.setdefault(alias, consts[name])
    loaded = {}
    for name, info in manifest["graphs"].items():
        if drafts(name.split("-")[0]) and graphs.draft_pass is None:
            continue
        frozen = info.get("flavor", manifest["flavor"]) == "frozen"  # per graph where the build measured
        runner = torch._inductor.aoti_load_package(str(path / info["file"]))
        want = runner.get_constant_fqns()
        missing = [k for k in want if k not in consts and not (frozen and k.startswith("_frozen_param"))]
        if missing:
            raise GlanceError(f"engine {path}: package {info['file']} expects weights {missing[:3]} that this model "
                              "does not have; rebuild the engine")
        runner.load_constants({k: consts[k] for k in want if k in consts}, check_full_update=not frozen,
                              user_managed=True)
        loaded[name] = runner
    def buckets(kind: str) -> dict:  # rows -> package, of the graphs built per row count
        return {int(n.split("-")[1]): r for n, r in loaded.items() if n.startswith(f"{kind}-")}

    fns = {"verify": by_rows(buckets("verify")), "prefill": loaded["prefill"]}
    for name in ("draft", "context", "eagle3_context"):
        if name in loaded:
            fns[name] = loaded[name]
    if "eagle3_context" in loaded:  # an EAGLE-3 head: a depth package per beam width (k rows)
        fns["eagle3_depth"] = by_rows(buckets("eagle3_depth"), "EAGLE-3 depth")
    batched = {n.split("-")[0]: {} for n in loaded if "_batch-" in n}  # a package per (slots, rows) / slots bucket
    for n, r in loaded.items():
        if "_batch-" in n:
            bucket = n.split("-")[1]
            batched[n.split("-")[0]][tuple(map(int, bucket.split("x"))) if "x" in bucket else int(bucket)] = r
    if "verify_batch" in batched:
        fns["verify_batch"] = by_rows(batched["verify_batch"], "batched verify", dims=2)
    if "draft_batch" in batched:
        fns["draft_batch"] = by_rows(batched["draft_batch"], "batched draft")
    return fns


def describe(manifest: dict) -> str:
    return json.dumps({k: manifest[k] for k in ("backend", "flavor", "budgets", "chain", "max_len", "chunk")})

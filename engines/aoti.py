"""AOTInductor engines: one `.pt2` package per static graph (`glance_rt.passes.StaticGraphs`).

Packages are built without their weights (`package_constants_in_so=False`): at load time every
package gets the running model's weights and KV caches as user-managed constants, so the prefill,
verify (one per tree-budget bucket), draft and context packages share one copy of the weights and
write the same caches in place. The manifest pins the weights they were built from.
"""

import json
import time
from pathlib import Path

import torch
from torch import nn

from glance_rt.errors import GlanceError

BACKEND = "aoti"


class _Entry(nn.Module):
    """One graph of a StaticGraphs as a module to export (its constants are `graphs.*`)."""

    def __init__(self, graphs, name: str):
        super().__init__()
        self.graphs, self.name = graphs, name

    def forward(self, *args):
        return getattr(self.graphs, self.name)(*args)


def build(decoder, out: Path, budgets, chain: bool, chunk: int, manifest: dict, progress: bool = True) -> None:
    """Export and AOT-compile every graph into `out` (resumable: finished packages are kept)."""
    from tqdm import tqdm

    from glance_rt.passes import StaticGraphs, StaticShapes, example_inputs

    graphs = StaticGraphs(decoder.verifier, decoder.drafter)
    block = decoder.drafter.block_size if decoder.drafter is not None else 1
    jobs = example_inputs(graphs, StaticShapes(chunk, block), decoder.mrope, budgets, chain)
    cfg = {"aot_inductor.package_constants_in_so": False}
    files, bar = {}, tqdm(jobs.items(), desc="aoti packages", unit="graph", disable=not progress)
    for name, args in bar:
        bar.set_postfix_str(name)
        file = out / f"{name}.pt2"
        inputs = [[list(a.shape), str(a.dtype).removeprefix("torch.")] for a in args]
        files[name] = {"file": file.name, "inputs": inputs}
        if file.exists():  # finished by an earlier (interrupted) build
            continue
        t0 = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(_Entry(graphs, name.split("-")[0]), args, strict=False)
            tmp = out / f"{name}.tmp.pt2"
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=cfg)
        tmp.replace(file)
        files[name]["build_seconds"] = round(time.perf_counter() - t0, 1)
    manifest["graphs"] = files


def runners(path: Path, manifest: dict, graphs) -> dict:
    """Load every package with `graphs`' weights and caches as user-managed constants -> the
    callables StaticPasses runs (verify dispatches on the tree's row count)."""
    from glance_rt.engines.engine import verify_by_rows

    consts = {}
    for n, t in [*graphs.named_parameters(remove_duplicate=False), *graphs.named_buffers(remove_duplicate=False)]:
        consts[f"graphs.{n}"] = t.detach()
    loaded = {}
    for name, info in manifest["graphs"].items():
        runner = torch._inductor.aoti_load_package(str(path / info["file"]))
        want = runner.get_constant_fqns()
        missing = [k for k in want if k not in consts]
        if missing:
            raise GlanceError(f"engine {path}: package {info['file']} expects weights {missing[:3]} that this model "
                              "does not have; rebuild the engine")
        runner.load_constants({k: consts[k] for k in want}, check_full_update=True, user_managed=True)
        loaded[name] = runner
    verify = {int(n.split("-")[1]): r for n, r in loaded.items() if n.startswith("verify-")}

    fns = {"verify": verify_by_rows(verify), "prefill": loaded["prefill"]}
    for name in ("draft", "context"):
        if name in loaded:
            fns[name] = loaded[name]
    return fns


def describe(manifest: dict) -> str:
    return json.dumps({k: manifest[k] for k in ("backend", "budgets", "chain", "max_len", "chunk")})

"""ONNX export of the static graphs (`glance_rt.round.verify.StaticGraphs`), tree attention as ONE node.

Every attention of the target and a GLANCE drafter is a single `glance.TreeAttention` node (domain
`glance`, version 1, attribute `scale`; inputs q [1, H, T, D], k, v [1, KVH, L, D], tree_mask [T, T]
bool, prefix_len [] int64; in batched graphs q [S, H, T, D], k, v [S, KVH, L, D], tree_mask [S, T, T],
prefix_len [S]). An EAGLE-3 head's context and depth graphs attend its own cache through a
[T, L] boolean mask in standard ops, as the head does in every backend (a depth pass sees rows that
earlier depth passes wrote, which the node's [T, T] mask over the rows a pass writes cannot say).
Flavors:
- `portable`: the model also carries `glance.TreeAttention` as a model-local ONNX function whose
  body is standard ops (ONNX Runtime or any runtime inlines it);
- `plugin`: the node alone, for a runtime that registers a kernel for it (the TensorRT plugin,
  an ONNX Runtime custom op).

KV caches are explicit: each graph takes every cache it reads as inputs (`past_k_i`, `past_v_i`,
[1, KVH, L, D], L = max_len: slot 0's of a cache of several slots) and returns only the rows it wrote
(`new_k_i`, `new_v_i`); the runtime writes those rows into its own caches, so a cache is never copied
through the graph boundary.

Verify graphs: one per tree bucket (`verify-{T}`), or with `dynamic_rows` ONE `verify` graph whose row
dimension is symbolic (`rows`): it serves every bucket of two rows or more (its manifest entry lists
them; a TensorRT build makes it one engine with an optimization profile per bucket). The one-row AR
step keeps its own graph: exporters specialise a dimension of size 1.

Batched graphs (a cache of several slots: `build-engine --max-batch`): `verify_batch`, `verify_batch-1`
and `draft_batch`, each ONE graph whose slot dimension is symbolic (`slots`; verify_batch's rows too),
over the caches of every slot ([N, KVH, L, D]: slots 0..S-1 are a slice, the op's batched layout); their
written rows come back as [S, n, KVH, D] (`read_rows`, `merge_buckets`).
"""

from itertools import product
from pathlib import Path

import torch
from torch import nn

from glance_rt.errors import GlanceError, require
from glance_rt.export.manifest import (
    FORMAT,
    describe_graphs,
    eagle3_shape,
    graph_budgets,
    lookup_buckets,
    source,
    versions,
    write_manifest,
)
from glance_rt.export.vision import export_vision
from glance_rt.export.weights import share_weights
from glance_rt.models.kv_cache import slot_rows
from glance_rt.round.verify import MIN_PREFILL_ROWS, by_rows, drafts, example_inputs, static_graphs, static_shapes

FLAVORS = ("portable", "plugin")
ROWS = "rows"  # the symbolic row dimension of a verify graph exported for any tree size
SLOTS = "slots"  # the symbolic sequence dimension of a batched graph exported for any batch bucket
DOMAIN, VERSION = "glance", 1
_SCHEMA = []


def _onnxscript():
    require("onnx", "onnx", "onnxscript")
    import onnxscript

    return onnxscript


def _register_schema() -> None:
    """Declare glance.TreeAttention to ONNX (once), so exporters and checkers know its signature."""
    if _SCHEMA:
        return
    from onnx import defs

    p = defs.OpSchema.FormalParameter
    schema = defs.OpSchema(
        "TreeAttention", DOMAIN, VERSION,
        doc="Attention of T query rows over L cache rows: rows < prefix_len visible to all; rows "
            "[prefix_len, prefix_len + T) visible where tree_mask; the rest invisible.",
        inputs=[p("q", "T"), p("k", "T"), p("v", "T"), p("tree_mask", "tensor(bool)"),
                p("prefix_len", "tensor(int64)")],
        outputs=[p("out", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float tensors")],
        attributes=[defs.OpSchema.Attribute("scale", defs.OpSchema.AttrType.FLOAT, "softmax scale"),
                    # set only on the copies TensorRT's parser reads (glance_rt.engines.tensorrt.tensorrt_onnx)
                    defs.OpSchema.Attribute("plugin_namespace", defs.OpSchema.AttrType.STRING,
                                            "TensorRT: the plugin's namespace", required=False),
                    defs.OpSchema.Attribute("plugin_version", defs.OpSchema.AttrType.STRING,
                                            "TensorRT: the plugin's version", required=False),
                    defs.OpSchema.Attribute("aot", defs.OpSchema.AttrType.INT,
                                            "TensorRT: 1 runs the plugin's ahead-of-time implementation",
                                            required=False)],
    )
    try:
        defs.register_schema(schema)
    except Exception as e:  # already registered in this process (by an earlier import)
        if "already" not in str(e).lower():
            raise
    _SCHEMA.append(schema)


def tree_attention_function(opset: int):
    """glance.TreeAttention as an ONNX FunctionProto with a standard-op body (the portable flavor)."""
    from glance_rt.export.onnx_function import TreeAttention

    fp = TreeAttention.to_function_proto()
    fp.name, fp.domain = "TreeAttention", DOMAIN
    for imp in fp.opset_import:
        if imp.domain == "":
            imp.version = opset
    return fp


def _translation():
    onnxscript = _onnxscript()
    _register_schema()
    glance = onnxscript.values.Opset(DOMAIN, VERSION)

    def tree_attention(q, k, v, tree_mask, prefix_len, scale: float):
        return glance.TreeAttention(q, k, v, tree_mask, prefix_len, scale=scale)

    return {torch.ops.glance.tree_attention.default: tree_attention}


def graph_caches(graphs, name: str) -> list:
    """The KVCache modules a graph reads and writes (an EAGLE-3 head's passes: the head's own)."""
    return [graphs.draft_pass.cache] if drafts(name) else [graphs.verifier.cache]


def graph_buffers(graphs, name: str) -> list:
    """The cache buffers a graph takes as inputs, in order: a batched graph's the caches of every slot
    [slots, KVH, L, D]; any other graph's slot 0 alone [1, KVH, L, D] (dense, so bound as it is)."""
    bufs = [b for cache in graph_caches(graphs, name) for b in cache.buffers()]
    return bufs if name in ("verify_batch", "draft_batch") else [b[:1] for b in bufs]


class _Graph(nn.Module):
    """One static graph with its caches as explicit inputs and its written rows as outputs."""

    def __init__(self, graphs, name: str, n_inputs: int, any_rows: bool = False):
        super().__init__()
        self.graphs, self.name, self.n_inputs, self.any_rows = graphs, name, n_inputs, any_rows

    def written(self, args) -> torch.Tensor:
        """The cache rows the graph's `new_*` outputs hold ([n], or [S, n] for a batched graph: slot s's
        rows). The draft pass writes its context rows
        [ctx_start, ctx_start + R) then its block [block_start, block_start + B), block_start <=
        ctx_start + R: the fixed window [ctx_start, ctx_start + R + B), clamped to the cache."""
        dev = args[0].device  # where the runtime keeps its caches (a CUDA engine computes the rows there)
        if self.name == "prefill":
            return args[2] + torch.arange(args[0].shape[1], device=dev)
        if self.name == "verify":
            return args[2] + torch.arange(args[0].shape[0], device=dev)
        b, last = self.graphs.block_size, self.graphs.max_len - 1
        window = torch.arange(self.graphs.ctx_rows + b, device=dev)
        if self.name == "draft":
            return (args[1] + window).clamp(max=last)
        if self.name in ("verify_batch", "draft_batch"):  # args[2] / args[1]: each slot's start [S]
            start, rows = (args[2], torch.arange(args[0].shape[1], device=dev)) if self.name == "verify_batch" \
                else (args[1], window)
            return (start[:, None] + rows).clamp(max=last)  # [S, n]: slot s's rows
        if self.name == "eagle3_context":  # its rows' positions (a short chunk repeats its last row)
            return args[2]
        if self.name == "eagle3_depth":  # the scratch rows its k rows write
            return args[3]
        return args[1] + torch.arange(args[0].shape[0], device=dev)  # context

    def forward(self, *inputs):
        args, kv = inputs[: self.n_inputs], inputs[self.n_inputs :]
        caches = graph_caches(self.graphs, self.name)
        i = 0
        for cache in caches:
            for layer in range(cache.layers):
                setattr(cache, f"k{layer}", kv[i])
                setattr(cache, f"v{layer}", kv[i + 1])
                i += 2
        fn = getattr(self.graphs, self.name)
        out = fn(*args, any_rows=True) if self.any_rows else fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        rows = self.written(args)
        return (*out, *(read_rows(t, rows) for t in kv))


def _names(graphs, name: str, args) -> tuple[list[str], list[str]]:
    ins = {"prefill": ["embeds", "positions", "start", "last"],
           "verify": ["tokens", "positions", "start", "tree_mask", "parent"],
           "verify_batch": ["tokens", "positions", "starts", "tree_masks", "parents"],
           "draft_batch": ["ctx", "ctx_start", "bonus", "block_start"],
           "draft": ["ctx", "ctx_start", "bonus", "block_start"],
           "context": ["ctx", "ctx_start"], "eagle3_context": ["features", "tokens", "positions"],
           "eagle3_depth": ["tokens", "states", "positions", "rows", "visible"]}[name]
    outs = {"prefill": ["logits", "features"], "verify": ["logits", "features", "greedy", "path"],
            "verify_batch": ["logits", "features", "greedy", "paths"], "draft_batch": ["draft_logits"],
            "draft": ["draft_logits"], "context": ["done"], "eagle3_context": ["state", "log_probs"],
            "eagle3_depth": ["states_out", "log_probs"]}[name]
    kv_in, kv_out = [], []
    for cache in graph_caches(graphs, name):
        for layer in range(cache.layers):
            kv_in += [f"past_k_{layer}", f"past_v_{layer}"]
            kv_out += [f"new_k_{layer}", f"new_v_{layer}"]
    return ins + kv_in, outs + kv_out


def concrete(shape: list, dims: dict | None) -> list[int]:
    """A manifest shape with its symbolic dimensions (`ROWS`, `SLOTS`) set to `dims`' values."""
    if any(isinstance(d, str) and d not in (dims or {}) for d in shape):
        raise GlanceError(f"shape {shape} has a symbolic dimension that {dims} does not set: rebuild the engine "
                          "with this glance-rt")
    return [dims[d] if isinstance(d, str) else d for d in shape]


def served(info: dict) -> list[dict]:
    """The buckets a graph's runners are bound at: {SLOTS: s, ROWS: t} for every slot count and row count its
    manifest entry lists (a graph exported for several: one per pair), or [{}] for a graph of fixed shapes."""
    axes = [(axis, info[axis]) for axis in (SLOTS, ROWS) if axis in info]
    return [dict(zip([a for a, _ in axes], values, strict=True)) for values in product(*(v for _, v in axes))]


def exported_runners(manifest: dict, graphs, make) -> dict:
    """The callables StaticPasses runs for an engine of exported graphs: `make(info, name, bufs, dims)`
    -> one graph's runner (`bufs`: the cache buffers it reads, in its input order; `dims`: the bucket
    it runs a graph exported for several at (`served`), {} for fixed shapes); the graphs built per
    bucket picked by their inputs' shapes: verify by its row count (one per tree-budget bucket, or one
    graph run at each), an EAGLE-3 head's depth passes by beam width, the batched passes by slots (and
    rows). A Decoder without a drafter (an audit's AR over a GLANCE engine) binds the target's graphs only."""
    fns, buckets = {}, {"verify": {}, "eagle3_depth": {}, "verify_batch": {}, "draft_batch": {}}
    for key, info in manifest["graphs"].items():
        name = key.split("-")[0]
        if drafts(name) and graphs.draft_pass is None:
            continue
        bufs = graph_buffers(graphs, name)
        for dims in served(info):
            run = make(info, name, bufs, dims)
            if name in ("verify_batch", "draft_batch"):
                buckets[name][(dims[SLOTS], dims[ROWS]) if name == "verify_batch" else dims[SLOTS]] = run
            elif name in buckets:
                buckets[name][dims.get(ROWS) or int(key.split("-")[1])] = run
            else:
                fns[name] = run
    fns["verify"] = by_rows(buckets["verify"])
    if buckets["eagle3_depth"]:
        fns["eagle3_depth"] = by_rows(buckets["eagle3_depth"], "EAGLE-3 depth")
    if buckets["verify_batch"]:
        fns["verify_batch"] = by_rows(buckets["verify_batch"], "batched verify", dims=2)
    if buckets["draft_batch"]:
        fns["draft_batch"] = by_rows(buckets["draft_batch"], "batched draft")
    return fns


def written_rows(graphs, name: str, args) -> torch.Tensor:
    """The cache rows a graph's `new_*` outputs hold (what the runtime writes back), from its inputs."""
    return _Graph(graphs, name, 0).written(args)


def read_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What a graph returns of a cache it wrote: its rows `rows` [n] of [1, KVH, L, D] -> [1, KVH, n, D];
    a batched graph's [S, n] of slots 0..S-1 -> [S, n, KVH, D]."""
    return cache.index_select(2, rows) if rows.dim() == 1 else cache[slot_rows(rows)]


def write_back(bufs: list, rows: torch.Tensor, new: list) -> None:
    """A graph's written rows `new` (`read_rows`' layout) into its caches `bufs` at `rows`."""
    for b, n in zip(bufs, new, strict=True):
        if rows.dim() == 1:
            b.index_copy_(2, rows, n)
        else:
            b[slot_rows(rows)] = n


def merge_buckets(jobs: dict, dynamic_rows: bool) -> tuple[dict, dict]:
    """`jobs` with graphs built per bucket merged into one graph each, exported with symbolic dimensions
    (the largest bucket's example inputs) -> (jobs, {merged key: {axis: the values it serves}}):
    - `dynamic_rows`: the verify buckets of MIN_PREFILL_ROWS rows or more -> `verify` (ROWS), where two or
      more (the one-row AR step keeps `verify-1`: exporters specialise a dimension of size 1);
    - batched graphs (a cache of several slots), always: `verify_batch-{S}x{T}` -> `verify_batch` (SLOTS
      and ROWS, T >= MIN_PREFILL_ROWS) and `verify_batch-1` (SLOTS: batched AR steps), `draft_batch-{S}`
      -> `draft_batch` (SLOTS). An axis with one value stays fixed (listed all the same)."""
    groups = {}  # merged key -> {bucket key: (slots, rows)}
    for key in jobs:
        name, _, tail = key.partition("-")
        if name == "verify" and dynamic_rows and int(tail) >= MIN_PREFILL_ROWS:
            groups.setdefault("verify", {})[key] = (None, int(tail))
        elif name == "verify_batch":
            slots, rows = (int(x) for x in tail.split("x"))
            groups.setdefault("verify_batch" if rows >= MIN_PREFILL_ROWS else "verify_batch-1", {})[key] = (slots, rows)
        elif name == "draft_batch":
            groups.setdefault("draft_batch", {})[key] = (int(tail), None)
    if len(groups.get("verify", {})) < 2:
        groups.pop("verify", None)
    merged, info = {}, {}
    for key, args in jobs.items():
        group = next((g for g, members in groups.items() if key in members), None)
        if group is None:
            merged[key] = args
            continue
        members = groups[group]
        axes = {axis: sorted({m[i] for m in members.values()}) for i, axis in enumerate((SLOTS, ROWS))
                if next(iter(members.values()))[i] is not None}
        if members[key] == tuple(max(axes[a]) if a in axes else None for a in (SLOTS, ROWS)):  # the largest
            merged[group], info[group] = args, axes
    return merged, info


AXES = {  # each input's dimensions that are a graph's slots or rows (positions: counted from its last)
    "verify": lambda p: ({0: ROWS}, {p - 1: ROWS}, {}, {0: ROWS, 1: ROWS}, {0: ROWS}),
    "verify_batch": lambda p: ({0: SLOTS, 1: ROWS}, {p - 2: SLOTS, p - 1: ROWS}, {0: SLOTS},
                               {0: SLOTS, 1: ROWS, 2: ROWS}, {0: SLOTS, 1: ROWS}),
    "draft_batch": lambda p: ({0: SLOTS}, {0: SLOTS}, {0: SLOTS}, {0: SLOTS}),
}


def _dynamic_shapes(name: str, args, n_kv: int, axes: dict) -> tuple | None:
    """torch.export's dynamic_shapes for a merged graph: its axes with more than one value symbolic (a Dim
    over the values' range), the caches fixed; None where nothing is symbolic."""
    from torch.export import Dim

    dims = {a: Dim(a, min=min(v), max=max(v)) for a, v in axes.items() if len(v) > 1}
    if not dims:
        return None
    per_arg = AXES[name](args[1].dim())
    return (tuple({i: dims[a] for i, a in spec.items() if a in dims} or None for spec in per_arg) + (None,) * n_kv,)


def _dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value_info.type.tensor_type.shape.dim]


def _dtype(value_info) -> str:
    from onnx import TensorProto

    return TensorProto.DataType.Name(value_info.type.tensor_type.elem_type).lower()


def export_onnx(graphs, out, budgets, chain: bool, chunk: int, flavor: str = "portable", opset: int = 20,
                progress: bool = True, dynamic_rows: bool = False) -> dict:
    """Export every graph of `graphs` (StaticGraphs of a target + drafter) into `out` (resumable:
    finished graphs are kept; each is written to a temporary name, checked, then renamed); then their
    weights are moved into one shared data file (`glance_rt.export.weights`). `dynamic_rows`: the tree
    buckets' verify graphs as one graph with a symbolic row dimension (`merge_buckets`; batched graphs are
    merged either way)."""
    require("onnx", "onnx", "onnxscript")
    import onnx
    from tqdm import tqdm


    if flavor not in FLAVORS:
        raise GlanceError(f"unknown flavor {flavor!r}: choose {' or '.join(FLAVORS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = example_inputs(graphs, static_shapes(graphs, chunk), budgets, chain)
    jobs, axes = merge_buckets(jobs, dynamic_rows)
    table, info = _translation(), {}
    bar = tqdm(jobs.items(), desc="onnx graphs", unit="graph", disable=not progress)
    for key, args in bar:
        bar.set_postfix_str(key)
        name = key.split("-")[0]
        caches = graph_caches(graphs, name)
        kv = [b.detach().clone() for b in graph_buffers(graphs, name)]
        ins, outs = _names(graphs, name, args)
        file = out / f"{key}.onnx"
        if not file.exists():
            saved = [(c, dict(c.named_buffers())) for c in caches]
            for c, bufs in saved:  # the caches become graph inputs, not initializers
                for n in bufs:
                    delattr(c, n)
            try:
                dims = _dynamic_shapes(name, args, len(kv), axes[key]) if key in axes else None
                any_rows = len(axes.get(key, {}).get(ROWS, ())) > 1  # traced for any T: its path R long
                with torch.no_grad():
                    prog = torch.onnx.export(_Graph(graphs, name, len(args), any_rows), (*args, *kv),
                                             dynamo=True, dynamic_shapes=dims, custom_translation_table=table,
                                             input_names=ins, output_names=outs, opset_version=opset, optimize=True,
                                             verbose=False)
            finally:
                for c, bufs in saved:
                    for n, b in bufs.items():
                        if hasattr(c, n):
                            delattr(c, n)
                        c.register_buffer(n, b, persistent=False)
            model = prog.model_proto
            if flavor == "portable":
                model.functions.append(tree_attention_function(opset))
            onnx.checker.check_model(model, full_check=flavor == "portable")
            tmp = out / f"{key}.tmp.onnx"
            onnx.save(model, str(tmp), save_as_external_data=True, location=f"{key}.onnx.data")
            tmp.replace(file)
        model = onnx.load(str(file), load_external_data=False)
        declared = {i.name: _dims(i) for i in model.graph.input}  # a dynamic-rows graph's: `rows` where T is
        shapes = [[declared.get(n, list(a.shape)), str(a.dtype).removeprefix("torch.")]
                  for n, a in zip(ins, (*args, *kv), strict=True)]
        info[key] = {"file": file.name, "inputs": [[n, *s] for n, s in zip(ins, shapes, strict=True)],
                     "outputs": [[o.name, _dims(o), _dtype(o)] for o in model.graph.output],
                     "tree_attention_nodes": sum(n.op_type == "TreeAttention" and n.domain == DOMAIN
                                                 for n in model.graph.node),
                     **axes.get(key, {})}
    share_weights(out, [i["file"] for i in info.values()])  # one copy of the weights for every graph
    (out / "GRAPHS.md").write_text("# ONNX graphs\n\n" + describe_graphs(info))
    return info




def export_model(target, drafter, out, flavor: str = "portable", opset: int = 20, budgets=(8,), chain: bool = False,
                 max_len: int = 1024, chunk: int = 64, target_source=None, drafter_source=None,
                 progress: bool = True, image_sizes=(), lookup_budget: int = 0, dynamic_rows: bool = True) -> Path:
    """`glance-rt export`: ONNX graphs of `target` (+ `drafter`) and their manifest, in `out`;
    `image_sizes`: (W, H) image buckets to export a VLM's vision graphs for; `lookup_budget` > 0:
    the verify graph of lookup rounds of that many rows too (`lookup_buckets`); `dynamic_rows`: one
    verify graph for the tree buckets (`merge_buckets`; False: a graph per bucket)."""
    tree_budgets = graph_budgets(drafter, budgets, max_len, chunk)
    budgets = lookup_buckets(drafter, chain, tree_budgets, lookup_budget)
    out = Path(out)
    if (out / "manifest.json").exists():
        raise GlanceError(f"{out} already holds an export: pick another --out, or delete it to export again")
    if out.exists() and any(p.suffix not in (".onnx", ".data") for p in out.iterdir()):
        raise GlanceError(f"{out} is not empty and holds no unfinished export: pick an empty or new --out folder")
    graphs = export_onnx(static_graphs(target, drafter, max_len), out, budgets, chain, chunk, flavor, opset, progress,
                         dynamic_rows)
    vision = {}
    if image_sizes:
        vision = export_vision(target, out, image_sizes, opset, progress)
    from importlib import metadata

    import onnx

    manifest = {"format": FORMAT, "backend": "onnx", "flavor": flavor, "opset": opset, "budgets": list(budgets),
                "eagle3": eagle3_shape(drafter),
                "tree_budgets": list(tree_budgets), "lookup_budget": lookup_budget or None, "chain": chain,
                "max_len": max_len, "chunk": chunk, "dynamic_rows": dynamic_rows,
                "block_size": drafter.block_size if drafter is not None else 1,
                "tree_attention": {"domain": DOMAIN, "op_type": "TreeAttention", "version": VERSION},
                "source": source(target, drafter), "versions": {**versions(), "onnx": onnx.__version__,
                                                                 "onnxscript": metadata.version("onnxscript")},
                "target_source": None if target_source is None else str(target_source),
                "drafter_source": None if drafter_source is None else str(drafter_source), "graphs": graphs,
                "vision": vision}
    write_manifest(out, manifest)
    return out

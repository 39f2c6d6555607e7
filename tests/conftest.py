import functools
import importlib.util
import os
import tempfile

import numpy as np
import pytest
import torch

from glance_rt.hf.arch import extend_inputs  # noqa: F401  (re-exported for tests)

# two xdist workers (scripts/test.sh) each take one of the two cores; a lone pytest process takes both
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# kernel timings and converted GGUF files (glance_rt.files.cache_root) go to a cache of this test session, not
# the user's; removed when the session ends (its converted default target is half a GB)
SESSION_CACHE = None if "GLANCE_RT_CACHE" in os.environ else tempfile.mkdtemp(prefix="glance-rt-test-cache-")
if SESSION_CACHE is not None:
    os.environ["GLANCE_RT_CACHE"] = SESSION_CACHE
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through its interpreter (read at triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def pytest_unconfigure(config):
    if SESSION_CACHE is not None:
        import shutil

        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def extended(*values):
    """A parametrize case (values) in the extended tier: run by `bash scripts/test.sh --all`, not by CI's tier
    (docs/testing.md lists what moved there and why)."""
    return pytest.param(*values, marks=pytest.mark.extended)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU here")
    skip_trt = pytest.mark.skip(reason="TensorRT is not installed (its PyPI packages cannot be fetched here)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)
        elif "tensorrt" in item.keywords and not has_tensorrt():
            item.add_marker(skip_trt)


@functools.cache
def corpus_builder():
    """scripts/build_corpus.py (the tool that builds the shipped prompt corpus) as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "build_corpus.py"
    spec = importlib.util.spec_from_file_location("build_corpus", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@functools.cache
def tiny_target(arch: str, seed: int = 0):
    """(glance Target, hf_model, processor) for a tiny random model, built once per process."""
    import glance_rt
    from tests.tiny_models import make_tiny

    model, processor = make_tiny(arch, seed)
    return glance_rt.load_target(model, processor=processor), model, processor


@functools.lru_cache(maxsize=1)
def smollm_target():
    import glance_rt

    return glance_rt.load_target(None)


def hf_greedy(model, inputs: dict, max_new_tokens: int, **kw) -> list[int]:
    """Hugging Face greedy generate: the reference output (new tokens only)."""
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def called_nodes(gm: torch.fx.GraphModule):
    """The call_function nodes a graph runs, in order, a nested compile region's subgraph (the compile
    backend's layers: `glance_rt.models.target.block_region`) expanded at each of its calls."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.invoke_subgraph:
            yield from called_nodes(getattr(gm, n.args[0].target))
        else:
            yield n


class OracleDrafter:
    """A drafter that knows the reference continuation: proposes it (perfect), or corrupts a
    fraction of depths (adversarial). Implements the Decoder's drafter protocol."""

    target_layer_ids = ()

    def __init__(self, prompt_len: int, reference: list[int], vocab: int, block_size: int,
                 corrupt: float = 0.0, seed: int = 0, decoy: bool = False):
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab
        self.block_size, self.corrupt, self.decoy = block_size, corrupt, decoy
        self.rng = np.random.default_rng(seed)

    def __call__(self, ctx_feats, ctx_start, bonus, block_start):
        depth = self.block_size - 1
        logits = torch.from_numpy(self.rng.normal(size=(depth, self.vocab))).float()
        for d in range(depth):
            i = block_start + 1 + d - self.prompt_len  # index into the generated tokens
            tok = self.reference[i] if 0 <= i < len(self.reference) else 0
            if self.rng.random() < self.corrupt:
                tok = int(self.rng.integers(self.vocab))
            logits[d, tok] = 30.0
            if self.decoy:  # a wrong token ranked above the right one: accepted paths leave rank 0
                logits[d, (tok + 1) % self.vocab] = 30.5
        return logits


def vocab_drafter(target, size: int, seed: int = 5, **kw):
    """A random drafter whose draft vocabulary is `size` random token ids of the target's."""
    import glance_rt

    d = glance_rt.init_drafter(target, seed=seed, draft_vocab_size=size, **kw)
    g = torch.Generator().manual_seed(seed)
    d.draft_vocab.copy_(torch.randperm(target.vocab_size, generator=g)[:size].sort().values)
    return d


DOT_K_STEP = 16  # the interpreter's dot reduces K in steps of this many (`interpreter_dot`), as an MMA walks K


@pytest.fixture(autouse=True)
def interpreter_dot(monkeypatch):
    """Two fixes to Triton 3.9's interpreter's `tl.dot` (`create_dot`: np.matmul of the two tiles).
    It multiplies bf16 tiles as their uint16 storage (only fp8 is converted first): convert bf16 to fp32
    as the GPU's MMA reads them, so the kernel's bf16 loads, casts and stores are checked here too. And
    np.matmul of a tile hands it to the host's BLAS, whose GEMM may give a tile's tail rows another
    micro-kernel and so other bits (numpy's OpenBLAS on a 2-core AMD EPYC: a row at places 6-15 of a
    16-row tile got other bits than at place 0, so a row's bits depended on its place in the tile):
    multiply each row of the tile alone, as a GPU's MMA computes every row of a tile the same way. The
    host's GEMV also blocks the reduction by its length K: on a 2-core AMD EPYC with AVX-512 (family 25),
    a row times a [64, N] tile whose last rows are zeros gave other bits than the same row times its first
    32 rows, where a GPU adds the zero K steps as exact +0. So each row's product runs in K steps of
    `DOT_K_STEP`, accumulated in order, as an MMA walks K: what the tests check is the kernel's order of
    summation, not the host BLAS's."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            def up(x):
                return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

            a, b = up(a), up(b)
        if a.data.ndim != 2:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        k = a.data.shape[1]
        step = DOT_K_STEP if k % DOT_K_STEP == 0 else k
        steps = [interpreter.TensorHandle(b.data[s : s + step], b.dtype.scalar) for s in range(0, k, step)]
        rows = []
        for i in range(a.data.shape[0]):  # row i: acc [1, N] += a[i, s:s+step] @ b[s:s+step], s in order
            acc = interpreter.TensorHandle(d.data[i : i + 1], d.dtype.scalar)
            for j, part in enumerate(steps):
                row = interpreter.TensorHandle(a.data[i : i + 1, j * step : (j + 1) * step], a.dtype.scalar)
                acc = dot(self, row, part, acc, input_precision, max_num_imprecise_acc)
            rows.append(acc.data)
        return interpreter.TensorHandle(np.concatenate(rows), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)

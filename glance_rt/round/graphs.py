"""CUDA graphs for the fixed-shape passes: a runner per pass (TensorRT-LLM's pattern: static inputs,
warm-up, capture, replay), so a decoding step costs the host a few copies and one graph launch.

Why not only torch.compile's "reduce-overhead" (CUDA graph trees): each call of a compiled pass still
evaluates Dynamo's guards (one per weight, buffer and module attribute: a cost that grows with the
layers, `scripts/guard_cost.py`) and the trees' bookkeeping before the replay, while the GPU waits. A
runner evaluates guards once, at capture. The measurements, and the idle time they may explain on an
H200, are in docs/engines.md ("CUDA graphs: torch.compile's trees, or a runner"); the GPU check
measures the difference (`scripts/gpu_check.py --cuda-graphs`).

`GraphRunner(fn)` wraps one compiled pass. Per input signature (each tensor's shape, strides, dtype,
device and autograd flags; every other argument's value; the grad and inference modes):
  1st call  fn itself on the capture stream (warm-up: compiles, autotunes, creates cuBLAS workspaces);
  2nd call  captures fn over static copies of the inputs (fn's host code runs, its kernels are recorded,
            none runs), then replays;
  later     copies the inputs into the static ones and replays.
So each call runs fn's side effects (cache writes) exactly once. A capture that would make torch.compile
compile again (a guard the signature does not cover) raises rather than compiling inside the graph.

Each signature's graph has a memory pool of its own: its outputs are fixed tensors that only its own
next replay overwrites (CUDA graph trees are stricter: they invalidate outputs at the next call of any
pass), and no other pass's replay can touch them. The cost: no memory shared between the graphs'
intermediates (the trees share one pool).

`capture` is the one CUDA-specific step (`cuda_capture`); tests on CPU pass a stand-in with the same
contract (static outputs, rewritten at each replay, no side effect at capture), given the warm-up's
outputs as 'meta' tensors (their shapes).
"""

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

Capture = Callable[[Callable, tuple, object], tuple[Callable[[], None], object]]


def signature(args: tuple) -> tuple:
    """What a captured graph is specialised to: tensors by layout, anything else by value, and the grad
    and inference modes the call runs in (which torch.compile guards on: a call in another mode must warm
    up, that is compile, before any capture)."""
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    return modes + tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad, a.is_inference())
                         if isinstance(a, Tensor) else ("value", a) for a in args)


def static_copy(a):
    """A fresh tensor with a's layout and values (a graph's input address); other values as they are."""
    if not isinstance(a, Tensor):
        return a
    out = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    return out.copy_(a).requires_grad_(a.requires_grad)


def cuda_capture(stream) -> Capture:
    """The CUDA capture step: `fn(*static_args)` recorded into a graph with a private memory pool, on
    `stream` (where the warm-up ran). Returns (replay, static outputs)."""

    def capture(fn, static_args, spec):
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's request handling) may go on meanwhile
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = fn(*static_args)
        return graph.replay, out

    return capture


class GraphRunner:
    """One fixed-shape pass replayed as a CUDA graph per input signature (see the module's docstring).
    `capture`: None for CUDA (`cuda_capture` on a stream of its own, made at the first call)."""

    def __init__(self, fn: Callable, capture: Capture | None = None):
        self.fn, self._capture = fn, capture
        self.stream = None
        self.warm: dict = {}  # signature -> its outputs as 'meta' tensors (warm-up done)
        self.graphs: dict = {}  # signature -> (replay, static inputs, static outputs)
        self.replays = 0

    def _warm_up(self, args: tuple):
        if self._capture is not None:
            return self.fn(*args)
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self.fn(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def __call__(self, *args):
        key = signature(args)
        entry = self.graphs.get(key)
        if entry is None and key not in self.warm:
            out = self._warm_up(args)
            self.warm[key] = tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, out)
            return out
        if entry is None:
            static = tuple(static_copy(a) for a in args)
            capture = self._capture or cuda_capture(self.stream)
            # a compile now would run inside the capture: raise instead (the signature missed a guard)
            with torch.compiler.set_stance("fail_on_recompile"):
                replay, out = capture(self.fn, static, self.warm[key])
            entry = self.graphs[key] = (replay, static, out)
        replay, static, out = entry
        for dst, src in zip(static, args, strict=True):
            if isinstance(dst, Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src, non_blocking=True)
        replay()
        self.replays += 1
        return out

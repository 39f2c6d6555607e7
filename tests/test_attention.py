"""glance::tree_attention against a naive per-head, per-row attention written out by hand."""

import math

import pytest
import torch

from glance_rt.models.attention import attend, tree_attention, tree_attention_reference


def naive(q, k, v, tree_mask, prefix_len: int, scale: float):
    """Loops over heads and query rows: row t sees cache rows < prefix_len and prefix_len + j
    where tree_mask[t, j]; query head h reads KV head h // G."""
    h, t, d = q.shape[1], q.shape[2], q.shape[3]
    groups = h // k.shape[1]
    out = torch.zeros(1, h, t, d, dtype=torch.float64)
    for hh in range(h):
        kk, vv = k[0, hh // groups].double(), v[0, hh // groups].double()  # [L, D]
        for i in range(t):
            seen = list(range(prefix_len)) + [prefix_len + j for j in range(t) if tree_mask[i, j]]
            s = kk[seen] @ q[0, hh, i].double() * scale  # [n]
            out[0, hh, i] = torch.softmax(s, 0) @ vv[seen]
    return out


def random_tree_mask(t: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask of a random tree (node i's parent < i), self included."""
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        p = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[p]
    return mask


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("t,prefix,extra", [(1, 7, 0), (1, 7, 5), (5, 0, 0), (9, 13, 0), (9, 13, 11), (17, 30, 3)])
def test_matches_naive(heads, kv_heads, t, prefix, extra):
    """`extra` cache rows past prefix + T (static passes attend over all rows) must be invisible,
    whatever they hold."""
    gen = torch.Generator().manual_seed(heads * 100 + t * 10 + prefix + extra)
    d, kv_len = 8, prefix + t + extra
    q = torch.randn(1, heads, t, d, generator=gen)
    k = torch.randn(1, kv_heads, kv_len, d, generator=gen)
    v = torch.randn(1, kv_heads, kv_len, d, generator=gen)
    mask = random_tree_mask(t, gen)
    scale = 1 / math.sqrt(d)
    want = naive(q, k, v, mask, prefix, scale).float()
    got = tree_attention(q, k, v, mask, torch.tensor(prefix), scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous()
    torch.testing.assert_close(tree_attention_reference(q, k, v, mask, torch.tensor(prefix), scale), got)


def test_transposed_query_layout():
    """Queries arrive as a transposed view of [1, T, H, D] projections; folding GQA must not mix heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 6, 8, generator=gen).transpose(1, 2)  # [1, H=6, T=5, D] non-contiguous
    k = torch.randn(1, 2, 9, 8, generator=gen)
    v = torch.randn(1, 2, 9, 8, generator=gen)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    got = tree_attention(q, k, v, mask, torch.tensor(4), 0.3)
    torch.testing.assert_close(got, naive(q, k, v, mask, 4, 0.3).float(), atol=1e-5, rtol=1e-5)


def test_fake_kernel_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 4, 3, 8), torch.empty(1, 2, 10, 8)
        out = tree_attention(q, k, k, torch.ones(3, 3, dtype=torch.bool), torch.tensor(2), 1.0)
        assert out.shape == (1, 4, 3, 8) and out.is_contiguous()


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, mask, prefix):
        return attend(q, k, v, mask, prefix, 0.5) * 2


def _attend_args():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k, v = torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    return q, k, v, random_tree_mask(3, gen), torch.tensor(5)


def test_attend_is_the_op_in_eager():
    """Eager CPU calls skip the dispatcher but compute exactly what the op does."""
    args = _attend_args()
    assert torch.equal(attend(*args, 0.5), tree_attention(*args, 0.5))


@pytest.mark.parametrize("strict", [False, True])
def test_graphs_record_the_named_op(strict):
    """Whatever traces the passes (non-strict export: fake tensors; strict: dynamo) sees glance::tree_attention,
    which the ONNX export, the engines and the TensorRT plugin rely on."""
    ep = torch.export.export(_Attend(), _attend_args(), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.glance.tree_attention.default in targets
    torch.testing.assert_close(ep.module()(*_attend_args()), _Attend()(*_attend_args()))


def test_compiled_graph_records_the_named_op():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    out = torch.compile(_Attend(), backend=backend, fullgraph=True)(*_attend_args())
    assert torch.ops.glance.tree_attention.default in seen
    torch.testing.assert_close(out, _Attend()(*_attend_args()))

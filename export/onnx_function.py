"""glance.TreeAttention's body in standard ONNX ops (onnxscript; the portable flavor's function).

Same math as `glance_rt.models.attention.tree_attention_reference`: visibility from prefix_len and the
tree mask, grouped-query heads folded as [B, KVH, G, T, D] against [B, KVH, 1, L, D]. Both forms of the
op: one sequence (q [1, H, T, D], tree_mask [T, T], prefix_len []) and a batch of sequences (q [B, H, T,
D], k, v [B, KVH, L, D], tree_masks [B, T, T], prefix_len [B]: block-diagonal, each sequence over its own
cache rows), what a batched engine's graphs call (`build-engine --max-batch`).
"""

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

glance = Opset("glance", 1)


@script(glance, default_opset=op)
def TreeAttention(q: FLOAT, k: FLOAT, v: FLOAT, tree_mask: BOOL, prefix_len: INT64, scale: float) -> FLOAT:
    qs = op.Shape(q)
    b = op.Slice(qs, [0], [1])
    h = op.Slice(qs, [1], [2])
    t = op.Slice(qs, [2], [3])
    d = op.Slice(qs, [3], [4])
    ks = op.Shape(k)
    kvh = op.Slice(ks, [1], [2])
    kv_len = op.Slice(ks, [2], [3])
    qg = op.Reshape(q, op.Concat(b, kvh, op.Div(h, kvh), t, d, axis=0))  # [B, KVH, G, T, D]
    kt = op.Unsqueeze(op.Transpose(k, perm=[0, 1, 3, 2]), [2])  # [B, KVH, 1, D, L]
    scores = op.Mul(op.MatMul(qg, kt), op.CastLike(scale, q))  # [B, KVH, G, T, L]
    masks = op.Reshape(tree_mask, op.Concat([-1], t, t, axis=0))  # [B, T, T] (one sequence's [T, T]: B = 1)
    prefix = op.Reshape(prefix_len, [-1, 1])  # [B, 1]
    zero = op.Constant(value_int=0)
    j = op.Range(zero, op.Squeeze(kv_len, [0]), op.Constant(value_int=1))  # [L]
    rel = op.Sub(j, prefix)  # [B, L]
    last = op.Sub(op.Squeeze(t, [0]), op.Constant(value_int=1))
    in_rows = op.And(op.GreaterOrEqual(rel, zero), op.LessOrEqual(rel, last))  # [B, L]
    at = op.Expand(op.Unsqueeze(op.Clip(rel, zero, last), [1]),
                   op.Concat(op.Slice(op.Shape(masks), [0], [1]), t, kv_len, axis=0))  # [B, T, L]
    rows = op.GatherElements(masks, at, axis=2)  # [B, T, L]: masks[b, t, rel[b, l]]
    visible = op.Or(op.Unsqueeze(op.Less(j, prefix), [1]), op.And(op.Unsqueeze(in_rows, [1]), rows))  # [B, T, L]
    scores = op.Where(op.Unsqueeze(visible, [1, 2]), scores, op.CastLike(-3.4028234663852886e38, q))
    out = op.MatMul(op.Softmax(scores, axis=-1), op.Unsqueeze(v, [2]))  # [B, KVH, G, T, D]
    return op.Reshape(out, qs)

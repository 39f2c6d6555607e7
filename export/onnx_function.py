"""glance.TreeAttention's body in standard ONNX ops (onnxscript; the portable flavor's function).

Same math as `glance_rt.models.attention.tree_attention_reference`: visibility from prefix_len and the
tree mask, grouped-query heads folded as [1, KVH, G, T, D] against [1, KVH, 1, L, D]. One sequence per
call: ONNX exports decode one sequence (the op's batched form, [B, ...] with masks [B, T, T], is what
batched torch and AOTInductor graphs call; `build-engine --max-batch` refuses ONNX backends).
"""

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

glance = Opset("glance", 1)


@script(glance, default_opset=op)
def TreeAttention(q: FLOAT, k: FLOAT, v: FLOAT, tree_mask: BOOL, prefix_len: INT64, scale: float) -> FLOAT:
    qs = op.Shape(q)
    h = op.Slice(qs, [1], [2])
    t = op.Slice(qs, [2], [3])
    d = op.Slice(qs, [3], [4])
    ks = op.Shape(k)
    kvh = op.Slice(ks, [1], [2])
    kv_len = op.Slice(ks, [2], [3])
    qg = op.Reshape(q, op.Concat([1], kvh, op.Div(h, kvh), t, d, axis=0))  # [1, KVH, G, T, D]
    kt = op.Unsqueeze(op.Transpose(k, perm=[0, 1, 3, 2]), [2])  # [1, KVH, 1, D, L]
    scores = op.Mul(op.MatMul(qg, kt), op.CastLike(scale, q))  # [1, KVH, G, T, L]
    zero = op.Constant(value_int=0)
    j = op.Range(zero, op.Squeeze(kv_len, [0]), op.Constant(value_int=1))  # [L]
    rel = op.Sub(j, prefix_len)
    last = op.Sub(op.Squeeze(t, [0]), op.Constant(value_int=1))
    in_rows = op.And(op.GreaterOrEqual(rel, zero), op.LessOrEqual(rel, last))
    rows = op.Gather(tree_mask, op.Clip(rel, zero, last), axis=1)  # [T, L]
    visible = op.Or(op.Less(j, prefix_len), op.And(in_rows, rows))  # [T, L]
    scores = op.Where(visible, scores, op.CastLike(-3.4028234663852886e38, q))
    out = op.MatMul(op.Softmax(scores, axis=-1), op.Unsqueeze(v, [2]))  # [1, KVH, G, T, D]
    return op.Reshape(out, qs)

"""glance_rt.export: the static graphs as ONNX (`glance-rt export`) and engine manifests.

`onnx.py` exports prefill, a verify graph per tree-budget bucket and the drafter's pass, every attention
one `glance.TreeAttention` node (`onnx_function.py`: its body in standard ops); `weights.py` keeps one
copy of the weights for all of them; `vision.py` exports a VLM's image encoder per image bucket;
`manifest.py` records what an engine was built from and checks it before it runs.
"""

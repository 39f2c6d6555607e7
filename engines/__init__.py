"""glance_rt.engines: built engines a `Decoder` runs (`Decoder.from_engine`).

`engine.py` builds and loads them (`build_engine`, behind `glance-rt build-engine`; `load_engine`),
dispatching on the manifest's backend: `aoti.py` (AOTInductor packages), `onnxruntime.py` (ONNX Runtime
sessions over the exported graphs, with `ort_plugin.py`'s kernel library for `glance.TreeAttention`) and
`tensorrt.py` (TensorRT engines with glance-rt's plugin; written to the documented API, never built here).
"""

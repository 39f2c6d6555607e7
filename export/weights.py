"""One copy of the weights for every ONNX graph of an export.

Each graph (prefill, a verify graph per tree-budget bucket, the drafter's) is exported with the whole
model's weights as initializers, so an export of N graphs held N copies (the 135M default target's
export: 1.7 GB for three graphs of 538 MB). `share_weights` rewrites the graphs of a folder so that
every initializer of at least `MIN_BYTES` lives once, in one external-data file (`WEIGHTS`), each
graph's initializers pointing at their bytes there (ONNX's external data: location, offset, length);
identical tensors are found by content (SHA-256, dtype, shape), whatever the exporter named them.
ONNX Runtime and TensorRT read such graphs as they are. In memory each ONNX Runtime session prepacks
its own copy, unless the engine was built with mapped weights (`mapped_initializers`: every session
reads one read-only memory map of the data file, prepacking off).

Interruptible: the data file is only appended to (and flushed) before a graph that points into it is
written under a temporary name and renamed over the old one; a graph's old data file is deleted once no
graph points at it; a rerun indexes what the rewritten graphs already point at and goes on.
"""

import hashlib
import os
from pathlib import Path

WEIGHTS = "weights.onnx.data"
MIN_BYTES = 1024  # smaller initializers stay inside their graph
ALIGN, PAGE = 64, 4096  # large tensors start on a page (memory-mappable), others on 64 bytes


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def _tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def _raw(tensor) -> bytes:
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    from onnx import numpy_helper

    return numpy_helper.to_array(tensor).tobytes()


def share_weights(out: Path, files: list[str], data: str = WEIGHTS) -> dict:
    """Move the initializers of the ONNX `files` (names in folder `out`) of >= MIN_BYTES into ONE file
    `data`, each distinct tensor once -> {"bytes": the data file's size, "tensors": distinct tensors,
    "references": initializers pointing at them}."""
    import onnx

    out = Path(out)
    path = out / data
    index: dict[tuple, tuple[int, int]] = {}
    refs = 0
    with open(path, "ab+") as f:
        for name in files:
            model = onnx.load(str(out / name), load_external_data=False)
            if all(_external(t).get("location") == data for t in _tensors(model) if t.external_data):
                for t in _tensors(model):  # already shared (a rerun): index what it points at
                    ext = _external(t)
                    if ext.get("location") == data:
                        offset, length = int(ext["offset"]), int(ext["length"])
                        f.seek(offset)
                        index.setdefault(_key(f.read(length), t), (offset, length))
                        refs += 1
                continue
            old = {_external(t)["location"] for t in _tensors(model) if t.external_data}
            onnx.load_external_data_for_model(model, str(out))
            for t in _tensors(model):
                raw = _raw(t)
                if len(raw) < MIN_BYTES:
                    continue
                key = _key(raw, t)
                if key not in index:
                    f.seek(0, os.SEEK_END)
                    align = PAGE if len(raw) >= 16 * PAGE else ALIGN
                    f.write(b"\0" * (-f.tell() % align))
                    index[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = index[key]
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    t.ClearField(field)
                t.data_location = onnx.TensorProto.EXTERNAL
                del t.external_data[:]
                for k, v in (("location", data), ("offset", str(offset)), ("length", str(length))):
                    t.external_data.add(key=k, value=v)
                refs += 1
            f.flush()
            os.fsync(f.fileno())
            tmp = out / f"{name}.tmp"
            onnx.save(model, str(tmp))
            tmp.replace(out / name)
            for loc in old - {data}:
                if not any(_points_at(out / other, loc) for other in files if other != name):
                    (out / loc).unlink(missing_ok=True)
        size = f.seek(0, os.SEEK_END)
    return {"bytes": size, "tensors": len(index), "references": refs}


def _key(raw: bytes, tensor) -> tuple:
    return hashlib.sha256(raw).hexdigest(), tensor.data_type, tuple(tensor.dims)


def _points_at(file: Path, location: str) -> bool:
    import onnx

    if not file.exists():
        return False
    model = onnx.load(str(file), load_external_data=False)
    return any(_external(t).get("location") == location for t in _tensors(model))


def mapped_initializers(folder: Path, file: str, values: dict) -> list[tuple[str, object]]:
    """The initializers of graph `file` (in `folder`) that live in the shared data file, as ONNX Runtime
    OrtValues over ONE read-only memory map of it -> [(initializer name, OrtValue)]. `values` holds the
    map and the values made so far: pass the same dict for every session of an engine (a tensor several
    graphs read is one OrtValue) and keep it as long as the sessions (they do not own the memory)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx.helper import tensor_dtype_to_np_dtype

    folder = Path(folder)
    model = onnx.load(str(folder / file), load_external_data=False)
    out = []
    for t in model.graph.initializer:
        ext = _external(t)
        if ext.get("location") != WEIGHTS:
            continue
        if WEIGHTS not in values:
            values[WEIGHTS] = np.memmap(folder / WEIGHTS, dtype=np.uint8, mode="r")
        key = (int(ext["offset"]), int(ext["length"]), t.data_type, tuple(t.dims))
        if key not in values:
            raw = values[WEIGHTS][key[0] : key[0] + key[1]].view(tensor_dtype_to_np_dtype(t.data_type))
            values[key] = ort.OrtValue.ortvalue_from_numpy(raw.reshape(key[3]))  # a view of the map: no copy
        out.append((t.name, values[key]))
    return out

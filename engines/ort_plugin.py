"""The ONNX Runtime kernel library for `glance.TreeAttention` (the `plugin` export flavor).

`tree_attention_ort.cc` beside this file is compiled with the system C++ compiler against ONNX
Runtime's C API header (`onnxruntime_c_api.h`, found in `include_dir` or the usual include
folders) into one shared library that sessions load with `register_custom_ops_library`. The
header is not on PyPI: it comes with ONNX Runtime's C/C++ release packages and its source tree.
"""

import hashlib
import shutil
import subprocess
from pathlib import Path

from glance_rt.errors import GlanceError

SOURCE = Path(__file__).with_name("tree_attention_ort.cc")
LIBRARY = "libglance_tree_attention.so"
HEADER = "onnxruntime_c_api.h"
SEARCH = ("/usr/local/include/onnxruntime", "/usr/include/onnxruntime", "/usr/local/include", "/usr/include")
HOW = ("build it with `glance-rt build-engine --backend onnxruntime --flavor plugin --ort-include DIR`, where DIR "
       f"holds ONNX Runtime's C API header {HEADER} (from an ONNX Runtime C/C++ release package or its source "
       "tree, include/onnxruntime/core/session), or export with --flavor portable")


def find_header(include_dir=None) -> Path:
    """The folder holding onnxruntime_c_api.h: `include_dir` if given, else the usual include folders."""
    places = [Path(include_dir)] if include_dir is not None else [Path(p) for p in SEARCH]
    for place in places:
        for folder in (place, place / "core" / "session"):
            if (folder / HEADER).is_file():
                return folder
    where = str(include_dir) if include_dir is not None else ", ".join(SEARCH)
    raise GlanceError(f"no {HEADER} in {where}: the plugin flavor's kernel library needs ONNX Runtime's C API "
                      f"headers to build; {HOW}")


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build_library(out_dir, include_dir=None, compiler: str = "c++") -> Path:
    """Compile the kernel library into `out_dir` (written under a temporary name, then renamed)."""
    header_dir = find_header(include_dir)
    if shutil.which(compiler) is None:
        raise GlanceError(f"no C++ compiler {compiler!r} on PATH: install one (Debian: apt-get install g++)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib, tmp = out_dir / LIBRARY, out_dir / (LIBRARY + ".tmp")
    cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", f"-I{header_dir}",
           str(SOURCE), "-o", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise GlanceError(f"compiling the TreeAttention kernel library failed ({' '.join(cmd)}):\n{run.stderr}")
    tmp.replace(lib)
    return lib


def library_for(path: Path) -> Path:
    """The kernel library an engine or export folder runs with, or an error saying how to build it."""
    lib = Path(path) / LIBRARY
    if not lib.is_file():
        raise GlanceError(f"{path} is a 'plugin' flavor export: ONNX Runtime runs its glance.TreeAttention nodes "
                          f"with glance-rt's kernel library {LIBRARY}, which is not in that folder; {HOW}")
    return lib

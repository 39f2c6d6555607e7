#!/usr/bin/env bash
# The GPU kernels under another Triton than the venv's, with no GPU: by default the GPU image's (3.6.0; the
# venv has 3.9), so what a GPU run would compile is checked before a lent machine's minutes are spent on it.
#   1. the kernels' tests through that Triton: its interpreter (the kernels' results) and its compiler
#      (PTX and cubin for sm_80/sm_90, the plugin's ABI, no register spills: ptxas);
#   2. the registers and spills of the split kernel's launches (scripts/kernel_resources.py) under it.
# Triton and, for its interpreter, a NumPy it works with (3.6's fails under NumPy >= 2.4: "only
# 0-dimensional arrays can be converted to Python scalars") go to .triton-VERSION/ (ignored by git), ahead of
# the venv's on PYTHONPATH; the venv itself is not changed.
#   bash scripts/triton_compat.sh [VERSION] [--json FILE]     (docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.6.0
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then version=$1; shift; fi
bash scripts/setup.sh
dir=.triton-$version
if [ ! -f "$dir/.done" ]; then
  rm -rf "$dir.part"
  .venv/bin/python -m pip install -q --no-deps --target "$dir.part" "triton==$version" "numpy<2.3"
  touch "$dir.part/.done"
  rm -rf "$dir" && mv "$dir.part" "$dir"  # complete or absent
fi
export PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -c "import triton; assert triton.__version__ == '$version', triton.__version__; print('triton', triton.__version__, triton.__file__)"
.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py tests/test_matmul_triton.py \
  tests/test_device_tree.py
.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_exact.py -k "path_kernel or cuda_kernels"  # its Triton ones
.venv/bin/python scripts/kernel_resources.py "$@"

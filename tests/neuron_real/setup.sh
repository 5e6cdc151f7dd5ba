#!/usr/bin/env bash
# The environment `make test-neuron` runs in: neuronx-distributed's real Python code (tag v2.28.0,
# Neuron SDK 2.28) on a CPU, next to this repository installed with constraints-trn1.txt.
#
#   PREFIX=~/.cache/moe-nxd-cpu bash tests/neuron_real/setup.sh
#
# PREFIX   where venv/ and nxd-src/ go (default ~/.cache/moe-nxd-cpu; about 7 GB)
# NXD_SRC  a copy of neuronx-distributed at v2.28.0 (a folder holding src/neuronx_distributed);
#          unset: cloned from GitHub (AWS does not publish the package outside its own pip index)
# PYTHON   a Python 3.10-3.12 interpreter (default python3)
#
# torch 2.9.0 and torch-xla 2.9.0 come from PyPI (the same versions torch-neuronx 2.9 uses). PyPI's
# torch 2.9.0 is the CUDA build, which loads 14 nvidia-*-cu12 libraries at import even without a
# GPU (torch/__init__.py _load_global_deps), so those come too: 4.3 GB of the venv.
set -euo pipefail
T0=$(date +%s)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PREFIX="${PREFIX:-$HOME/.cache/moe-nxd-cpu}"
PYTHON="${PYTHON:-python3}"
NXD_TAG=v2.28.0
NXD_VERSION='__version__ = "0.17.0"'  # src/neuronx_distributed/_version.py at v2.28.0 (commit 22cadad)
log() { echo "[test-neuron setup $(($(date +%s) - T0))s] $*"; }
mkdir -p "$PREFIX"

# -- neuronx-distributed's source -----------------------------------------------------------------
rm -rf "$PREFIX/nxd-src.partial"
if [ -n "${NXD_SRC:-}" ]; then
  [ -d "$NXD_SRC/src/neuronx_distributed" ] || { echo "NXD_SRC=$NXD_SRC has no src/neuronx_distributed" >&2; exit 2; }
  log "neuronx-distributed from NXD_SRC=$NXD_SRC"
  mkdir -p "$PREFIX/nxd-src.partial" && cp -r "$NXD_SRC/src" "$PREFIX/nxd-src.partial/src"
else
  log "cloning neuronx-distributed $NXD_TAG from GitHub"
  git clone -q --depth 1 --branch "$NXD_TAG" https://github.com/aws-neuron/neuronx-distributed.git \
    "$PREFIX/nxd-src.partial"
fi
grep -q "$NXD_VERSION" "$PREFIX/nxd-src.partial/src/neuronx_distributed/_version.py" \
  || { echo "neuronx-distributed there is not $NXD_TAG (_version.py is not 0.17.0)" >&2; exit 2; }
rm -rf "$PREFIX/nxd-src" && mv "$PREFIX/nxd-src.partial" "$PREFIX/nxd-src"

# -- the venv -------------------------------------------------------------------------------------
log "venv with $($PYTHON --version)"
rm -rf "$PREFIX/venv"
"$PYTHON" -m venv "$PREFIX/venv"
PIP="$PREFIX/venv/bin/pip"
"$PIP" install -q --upgrade pip
log "torch 2.9.0, torch-xla 2.9.0 and what NxD imports (pinned, no resolver)"
"$PIP" install -q --no-deps torch==2.9.0 torch_xla==2.9.0
"$PIP" install -q --no-deps -r "$HERE/requirements.txt"
log "this repository, with constraints-trn1.txt (transformers 4.52.4, Lightning 2.5.0)"
"$PIP" install -q -e "$REPO" -c "$REPO/constraints-trn1.txt"

log "smoke: import torch_xla and neuronx_distributed"
"$HERE/run.sh" --import-only
log "done: $(du -sh "$PREFIX" | cut -f1) in $PREFIX"

#!/usr/bin/env bash
# The environment `make test-neuron` runs in: neuronx-distributed's real Python code (tag v2.28.0,
# Neuron SDK 2.28) on a CPU, next to this repository installed with constraints-trn1.txt.
#
#   PREFIX=~/.cache/moe-nxd-cpu NXD_SRC=../shared/vendor/neuronx-distributed-v2.28.0 bash tests/neuron_real/setup.sh
#
# PREFIX   where venv/ and nxd-src/ go (default ~/.cache/moe-nxd-cpu; about 7.7 GB)
# NXD_SRC  a copy of neuronx-distributed at v2.28.0 (a folder holding src/neuronx_distributed);
#          unset: the copy already in PREFIX, else a clone from GitHub (AWS does not publish the
#          package outside its own pip index)
# PYTHON   a Python 3.10-3.12 interpreter (default python3)
#
# Idempotent: an environment whose fingerprint (the pins below, this script, pyproject.toml and the
# NxD source's files) matches is reused in a second; any change rebuilds it. First set-up: about
# 2 minutes with a warm PyPI cache, 7.7 GB.
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

source_hash() {  # the content of a neuronx-distributed source tree, as one hash
  (cd "$1" && find src/neuronx_distributed -type f -name '*.py' | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -c1-16
}
pins_hash() {
  cat "$HERE/requirements.txt" "$REPO/constraints-trn1.txt" "$REPO/pyproject.toml" "$HERE/setup.sh" \
    <("$PYTHON" --version 2>&1) | sha256sum | cut -c1-16
}

# -- neuronx-distributed's source -----------------------------------------------------------------
if [ -n "${NXD_SRC:-}" ]; then
  [ -d "$NXD_SRC/src/neuronx_distributed" ] || { echo "NXD_SRC=$NXD_SRC has no src/neuronx_distributed" >&2; exit 2; }
  grep -q "$NXD_VERSION" "$NXD_SRC/src/neuronx_distributed/_version.py" \
    || { echo "NXD_SRC=$NXD_SRC is not neuronx-distributed $NXD_TAG (_version.py is not 0.17.0)" >&2; exit 2; }
  if [ ! -d "$PREFIX/nxd-src" ] || [ "$(source_hash "$NXD_SRC")" != "$(source_hash "$PREFIX/nxd-src")" ]; then
    log "neuronx-distributed from NXD_SRC=$NXD_SRC"
    rm -rf "$PREFIX/nxd-src.partial" && mkdir -p "$PREFIX/nxd-src.partial"
    cp -r "$NXD_SRC/src" "$PREFIX/nxd-src.partial/src"
    rm -rf "$PREFIX/nxd-src" && mv "$PREFIX/nxd-src.partial" "$PREFIX/nxd-src"
  fi
elif [ ! -d "$PREFIX/nxd-src/src/neuronx_distributed" ]; then
  log "cloning neuronx-distributed $NXD_TAG from GitHub"
  rm -rf "$PREFIX/nxd-src.partial"
  git clone -q --depth 1 --branch "$NXD_TAG" https://github.com/aws-neuron/neuronx-distributed.git \
    "$PREFIX/nxd-src.partial"
  grep -q "$NXD_VERSION" "$PREFIX/nxd-src.partial/src/neuronx_distributed/_version.py" \
    || { echo "the clone is not $NXD_TAG (_version.py is not 0.17.0)" >&2; exit 2; }
  rm -rf "$PREFIX/nxd-src" && mv "$PREFIX/nxd-src.partial" "$PREFIX/nxd-src"
fi

# -- the venv, unless the one there was built from the same pins and source ---------------------------
FINGERPRINT="$(pins_hash)-$(source_hash "$PREFIX/nxd-src")"
if [ -x "$PREFIX/venv/bin/python" ] && [ "$(cat "$PREFIX/venv/.fingerprint" 2>/dev/null)" = "$FINGERPRINT" ]; then
  log "up to date: $PREFIX/venv (fingerprint $FINGERPRINT)"
  exit 0
fi
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
echo "$FINGERPRINT" > "$PREFIX/venv/.fingerprint"
log "done: $(du -sh "$PREFIX" | cut -f1) in $PREFIX"

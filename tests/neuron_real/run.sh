#!/usr/bin/env bash
# `make test-neuron`: our trn1 backend on neuronx-distributed's real code (v2.28.0) in its CPU
# mode, two processes per check (README.md says what runs and what is patched).
#
#   PREFIX=~/.cache/moe-nxd-cpu bash tests/neuron_real/run.sh [--import-only]
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PREFIX="${PREFIX:-$HOME/.cache/moe-nxd-cpu}"
export PATH="$PREFIX/venv/bin:$PATH"
export PYTHONPATH="$PREFIX/nxd-src/src:$HERE/stubs:$HERE:$REPO"
export NXD_CPU_MODE=1                # NxD's own CPU mode: gloo process groups, CPU tensors
export PJRT_DEVICE=CPU
export NEURON_LOGICAL_NC_CONFIG=1    # else NxD asks the (absent) runtime at import, modules/moe/model_utils.py:96
export OMP_NUM_THREADS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONWARNINGS=ignore
cd "$REPO"

if [ "${1:-}" = --import-only ]; then
  exec python -c "import torch_xla, neuronx_distributed, neuronx_distributed.lightning; print('neuronx_distributed', neuronx_distributed.__file__)"
fi

LOGS="$PREFIX/logs"; mkdir -p "$LOGS"; RUNS="$PREFIX/runs"; rm -rf "$RUNS"
pass=0; fail=0; port=29600
check() {  # name, processes, then the command run under torchrun
  local name=$1 procs=$2; shift 2; port=$((port + 1)); local t0=$(date +%s)
  if timeout 900 torchrun --nproc_per_node "$procs" --master_port $port "$@" > "$LOGS/$name.log" 2>&1; then
    pass=$((pass + 1)); echo "PASS $name ($(($(date +%s) - t0))s)"
  else
    fail=$((fail + 1)); echo "FAIL $name ($(($(date +%s) - t0))s): $LOGS/$name.log"; tail -20 "$LOGS/$name.log"
  fi
}
CHECK="$HERE/check_backend.py"
DROPLESS="moe_opt.capacity_factor=null moe_opt.eval_capacity_factor=null"
check tp2             2 "$CHECK" parallel.tp=2 moe_opt=nxd
check tp2_heavy_drops 2 "$CHECK" parallel.tp=2 moe_opt=nxd moe_opt.capacity_factor=0.5 moe_opt.eval_capacity_factor=0.5
check tp2_sp_dropless 2 "$CHECK" parallel.tp=2 parallel.sequence_parallel=true $DROPLESS
check pp2             2 "$CHECK" parallel.pp=2 trainer.accumulate_grad_batches=2 moe_opt=nxd
check dp2             2 "$CHECK" moe_opt=nxd
check tp2_pp2_sp      4 "$CHECK" parallel.tp=2 parallel.pp=2 parallel.sequence_parallel=true trainer.devices=4 \
                                 trainer.accumulate_grad_batches=2 moe_opt=nxd

# train.py end to end on NxD's Lightning strategy: 4 steps, then again from the step-2 checkpoint
TRAIN="hardware=trn1 trainer.devices=2 parallel.tp=2 parallel.zero_stage=0 trainer=smoke trainer.max_steps=4
       optimizer.warmup_steps=1 trainer.val_check_interval=2 trainer.checkpoint_every_n_steps=2"
check train_py        2 "$HERE/train_cpu.py" $TRAIN "hydra.run.dir=$RUNS/straight"
mkdir -p "$RUNS/resumed/checkpoints" && cp -r "$RUNS/straight/checkpoints/step-000002.ckpt" "$RUNS/resumed/checkpoints/"
check train_py_resume 2 "$HERE/train_cpu.py" $TRAIN "hydra.run.dir=$RUNS/resumed"
t0=$(date +%s)
if python "$HERE/check_run.py" "$RUNS/straight" "$RUNS/resumed" > "$LOGS/check_run.log" 2>&1; then
  pass=$((pass + 1)); echo "PASS resume_and_convert ($(($(date +%s) - t0))s): $(tail -1 "$LOGS/check_run.log")"
else
  fail=$((fail + 1)); echo "FAIL resume_and_convert: $LOGS/check_run.log"; tail -20 "$LOGS/check_run.log"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]

#!/usr/bin/env bash
# `make test-neuron`: our trn1 backend on neuronx-distributed's real code (v2.28.0) in its CPU
# mode, 2 to 8 processes per check (README.md says what runs and what is patched).
#
#   PREFIX=~/.cache/moe-nxd-cpu bash tests/neuron_real/run.sh [--import-only] [CHECK ...]
#
# CHECK names run only those checks (e.g. `tp2_ep2_zero1 train_py`); every check has a time limit
# (CHECK_TIMEOUT seconds, default 600) and a failure prints the tensors that differed and by how much.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PREFIX="${PREFIX:-$HOME/.cache/moe-nxd-cpu}"
CHECK_TIMEOUT="${CHECK_TIMEOUT:-600}"
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

ONLY=" $* "
LOGS="$PREFIX/logs"; mkdir -p "$LOGS"; RUNS="$PREFIX/runs"; rm -rf "$RUNS"; mkdir -p "$RUNS"
pass=0; fail=0; port=29600; T0=$(date +%s)
wanted() { [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $1 "* ]]; }
report() {  # name, seconds, exit status, log: a line (and the check's `summary:` lines), on failure what differed
  local name=$1 secs=$2 rc=$3 log=$4
  if [ "$rc" -eq 0 ]; then
    pass=$((pass + 1)); echo "PASS $name (${secs}s)"; { grep "^summary: " "$log" || true; } | sed 's/^summary: /  /' 
  else
    fail=$((fail + 1))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "FAIL $name: TIMEOUT after ${CHECK_TIMEOUT}s ($log)"
    else echo "FAIL $name (${secs}s): $log"; fi
    { grep -E "^\[rank [0-9]+\]   |^(summary|problem): " "$log" || true; } | sort -u | head -25
    grep -E "Error|error:" "$log" | grep -v "^\[rank" | sort -u | head -5
  fi
}
run() {  # name, then the command; under the time limit, logged to $LOGS/name.log
  local name=$1; shift
  wanted "$name" || return 0
  local t0=$(date +%s) log="$LOGS/$name.log"
  timeout --kill-after=20 "$CHECK_TIMEOUT" "$@" > "$log" 2>&1
  local rc=$?
  report "$name" $(($(date +%s) - t0)) $rc "$log"
}
check() {  # name, processes, then check_backend.py's overrides
  local name=$1 procs=$2; shift 2; port=$((port + 1))
  run "$name" torchrun --nproc_per_node "$procs" --master_port $port "$HERE/check_backend.py" "$@"
}
train() {  # name, processes, then train.py's overrides (train.py itself, under torchrun)
  local name=$1 procs=$2; shift 2; port=$((port + 1))
  run "$name" torchrun --nproc_per_node "$procs" --master_port $port "$HERE/train_cpu.py" "$@"
}

DROPLESS="moe_opt.capacity_factor=null moe_opt.eval_capacity_factor=null"
DROPS="moe_opt.capacity_factor=0.5 moe_opt.eval_capacity_factor=0.5"
EP="parallel.ep=2 parallel.zero_stage=1"   # NxD's expert parallelism with its ZeRO-1 (validate.py says why)
# one layout each, two optimizer steps and a validation batch against one process (check_backend.py)
check tp2               2 parallel.tp=2 moe_opt=nxd
check tp2_heavy_drops   2 parallel.tp=2 moe_opt=nxd $DROPS
check tp2_sp_dropless   2 parallel.tp=2 parallel.sequence_parallel=true $DROPLESS
check tp2_alibi         2 parallel.tp=2 moe_opt=nxd model.position_encoding=alibi
check tp2_yarn_dense    2 parallel.tp=2 moe_opt=nxd model.rope_type=yarn model.rope_factor=4 \
  model.rope_original_max_position_embeddings=64 model.dense_layers=[0]   # W's keys NxD's layers leave to ours
# the HF families' pieces NxD's layers carry (q/k/v and o biases, the router's bias) or our attention computes on
# each rank's heads (a per-head QK-norm, sinks): without and with sequence parallelism
HF_PIECES="model.qkv_bias=true model.o_bias=true model.qk_norm=per_head model.attention_sinks=true model.router_bias=true"
check tp2_hf_pieces     2 --checkpoint "$RUNS/tp2_hf_pieces" parallel.tp=2 moe_opt=nxd $HF_PIECES  # and NxD's files
check tp2_sp_hf_pieces  2 parallel.tp=2 parallel.sequence_parallel=true moe_opt=nxd $HF_PIECES
check pp2               2 parallel.pp=2 moe_opt=nxd
check dp2_zero1         2 parallel.zero_stage=1 moe_opt=nxd
check tp2_pp2_sp        4 parallel.tp=2 parallel.pp=2 parallel.sequence_parallel=true moe_opt=nxd
check tp2_ep2_zero1     4 parallel.tp=2 $EP moe_opt=nxd
check tp2_ep2_sp_drops  4 parallel.tp=2 $EP parallel.sequence_parallel=true moe_opt=nxd $DROPS
check pp2_ep2           4 parallel.pp=2 $EP moe_opt=nxd
check tp2_ep2_dp2       8 parallel.tp=2 $EP moe_opt=nxd
run slots python "$HERE/check_slots.py"   # NxD's slot arithmetic under each trn1 precision preset

# train.py end to end on NxD's Lightning strategy with expert parallelism and its ZeRO-1: 4 steps, then
# again from the step-2 checkpoint; the checkpoints joined into one file and exported to transformers
TRAIN="hardware=trn1 trainer.devices=4 parallel.tp=2 $EP trainer=smoke trainer.max_steps=4
       optimizer.warmup_steps=1 trainer.val_check_interval=2 trainer.checkpoint_every_n_steps=2"
train train_py        4 $TRAIN "hydra.run.dir=$RUNS/straight"
if wanted train_py_resume; then
  mkdir -p "$RUNS/resumed/checkpoints" && cp -r "$RUNS/straight/checkpoints/step-000002.ckpt" "$RUNS/resumed/checkpoints/"
fi
train train_py_resume 4 $TRAIN "hydra.run.dir=$RUNS/resumed"
run resume_and_convert python "$HERE/check_run.py" "$RUNS/straight" "$RUNS/resumed"

# a skipped step skips (skip_probe.py): train.py on tp 2 x ep 2 with ZeRO-1 and mixed precision's fp32 gradient
# accumulation (the gradients in main_grad), step 2's gradient made non-finite on rank 0, step 3 skipped by the
# rollback ledger; every rank's weights and ZeRO-1 state (moments, fp32 master shards) unchanged by both,
# step 4 updating
SKIP="hardware=trn1 trainer.devices=4 parallel.tp=2 $EP trainer=smoke trainer.max_steps=4 optimizer.warmup_steps=1
      trainer.log_every_n_steps=1 trainer.limit_val_batches=0 trainer.save_checkpoints=false trainer.spike_factor=0
      trainer.micro_batch_size=2 data.seq_len=32 model.hidden_size=64 model.intermediate_size=64 model.num_layers=2"
if wanted skip_py; then python "$HERE/skip_probe.py" --ledger "$RUNS/skip"; fi
train skip_py         4 $SKIP "hydra.run.dir=$RUNS/skip" "+callbacks.skip._target_=skip_probe.SkipProbe" \
  "+callbacks.skip.out=$RUNS/skip/probe"
run skip_check python "$HERE/skip_probe.py" "$RUNS/skip" 4

# KARAKURI's recipe (experiment=karakuri_8x7b_trn1) at reduced width with its structure in 8 processes:
# tp 2 x pp 2 x ep 2 (dp 2), 4 layers per pipeline stage, ALiBi, sequence parallel, ZeRO-1, MoE layers
# checkpointed, mixed precision; `make compile-neuron` itself (10 steps, validation at step 5, nothing
# saved), with what neuron_parallel_compile sets in place of the compiler
KARAKURI_STRUCTURE="experiment=karakuri_8x7b_trn1 trainer.num_nodes=1 parallel.tp=2 parallel.pp=2 parallel.ep=2
          model.num_layers=8 model.num_heads=8 model.num_kv_heads=2 model.vocab_size=512 data=sample
          data.path=data/sample/train.txt trainer.accumulate_grad_batches=4 trainer.global_batch_size=null"
KARAKURI="$KARAKURI_STRUCTURE model.hidden_size=256 model.intermediate_size=512 data.seq_len=256"
# the compile run at half those widths: its 10 steps are most of its time, and its structure is what it checks
KARAKURI_COMPILE="$KARAKURI_STRUCTURE model.hidden_size=128 model.intermediate_size=256 data.seq_len=128"
port=$((port + 1))
run karakuri_compile make -s compile-neuron NEURON_DEVICES=8 NEURON_COMPILE="env NEURON_EXTRACT_GRAPHS_ONLY=1" \
  TORCHRUN="torchrun --nproc_per_node=8 --master_port=$port" TRAIN_PY="$HERE/train_cpu.py" \
  NEURON_ARGS="$(echo $KARAKURI_COMPILE) hydra.run.dir=$RUNS/karakuri_compile"
port=$((port + 1))
run karakuri_memory torchrun --nproc_per_node 8 --master_port $port "$HERE/measure_memory.py" $KARAKURI \
  hardware.neuron_precision=fp32

echo "$pass passed, $fail failed in $(($(date +%s) - T0))s"
[ "$fail" -eq 0 ]

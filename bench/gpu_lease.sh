#!/usr/bin/env bash
# make gpu-check and the GPU benches sized to one short GPU lease (about 9 minutes on one H100, 2026-11-26):
# each stage in priority order under its own limit, the whole under BUDGET seconds, the output in
# $OUT/all.log, the runs' logs and metrics in $OUT/runs.tgz, one step's profile in $OUT/prof_stack.txt.
# Carried wheels (bash ../shared/gpu/wheels.sh fills .whl/) are installed first where present.
#     OUT=/tmp/out BUDGET=560 bash bench/gpu_lease.sh
set -u
T0=$(date +%s); BUDGET=${BUDGET:-560}; OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT" /tmp/gc
LOG=$OUT/all.log
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stage() {  # stage NAME SECONDS COMMAND...: run it if time is left, its output into the log and on screen
  local name=$1 want=$2; shift 2
  local l; l=$(left)
  if (( l < 25 )); then echo "=== SKIP $name: ${l}s left" | tee -a "$LOG"; return; fi
  (( want > l - 5 )) && want=$(( l - 5 ))
  echo "=== $name (limit ${want}s, ${l}s left): $*" | tee -a "$LOG"
  local s; s=$(date +%s)
  timeout -k 5 "$want" "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"
  echo "--- $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - s ))s" | tee -a "$LOG"
  tar czf "$OUT/runs.tgz" -C /tmp gc 2>/dev/null
}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__)" | tee -a "$LOG"
GC="python3 bench/gpu_check.py --no-bench --steps 20"
# 1. the step target's rows, each alone on the card, and train.py beside the bare loop
stage check_ddp_fsdp2 200 $GC --timeout 150 --out /tmp/gc/a --only ddp_bf16 fsdp2_zero3
stage bare_ddp 110 python3 bench/train_vs_bare.py --gpu --backend ddp --steps 10
stage bare_fsdp2 110 python3 bench/train_vs_bare.py --gpu --backend fsdp2 --steps 10
# 2. the layer beside torchtitan's, both shapes, then the stack with one step's profile
stage layer_mixtral 90 python3 bench/vs_torchtitan.py --device cuda --repeats 10 --steps 12 \
  --hidden 4096 --width 14336 --experts 8 --top-k 2 --tokens 16384
stage layer_fine 80 python3 bench/vs_torchtitan.py --device cuda --repeats 10 --steps 12 \
  --hidden 2048 --width 1408 --experts 64 --top-k 6 --tokens 16384
stage stack 90 python3 bench/gpu_moe_stack.py --profile "$OUT/prof_stack.txt"
stage stack_accumulate 90 python3 bench/gpu_moe_stack.py --accumulate 8 --steps 4 --warmup 2
# 2b. the expert layout and generation on the card: the stored [E, out, in] beside [E, in, out] in training and
#     decoding (bf16, FP8), then generate beside transformers (bf16, fp16, fp32; batch 1 and 8, time to first
#     token) and MLA's latent cache beside the expanded one
stage expert_layout 100 python3 bench/expert_layout.py --device cuda --dtype bf16 fp8 --hidden 4096 \
  --width 14336 --train-tokens 16384 --decode-tokens 1 8 64 --repeats 5
stage generate 150 python3 bench/generate.py --device cuda --dtype bf16 fp16 fp32 --batch 1 8 \
  --new-tokens 32 --hidden 1024 --layers 8 --vocab 32000 --repeats 5
stage mla_cache 60 python3 bench/mla_cache.py --device cuda --dtype bf16 --new-tokens 32
# 3. the stack compiled as model.compile=true compiles it (the MoE layers' regions too)
stage stack_compile 120 python3 bench/gpu_moe_stack.py --compile
# 4. the other paths: do they train? two at a time on the card (their tokens/s are not timings)
pairs() {
  trap 'kill $(jobs -p) 2>/dev/null' TERM
  $GC --timeout 140 --out /tmp/gc/b1 --only deepspeed_zero2_overlap > /tmp/gc/b1.out 2>&1 &
  $GC --timeout 140 --out /tmp/gc/b2 --only fsdp2_offload_experts > /tmp/gc/b2.out 2>&1 &
  wait; cat /tmp/gc/b1.out /tmp/gc/b2.out
  $GC --timeout 140 --micro-batch 4 --out /tmp/gc/b3 --only deepspeed_zero2 > /tmp/gc/b3.out 2>&1 &
  $GC --timeout 140 --micro-batch 4 --out /tmp/gc/b4 --only fsdp2_zero2 > /tmp/gc/b4.out 2>&1 &
  wait; cat /tmp/gc/b3.out /tmp/gc/b4.out
}
export -f pairs; export GC
stage check_pairs 300 bash -c pairs
# 5. the layer beside torchtitan's, both compiled
stage layer_mixtral_compiled 120 python3 bench/vs_torchtitan.py --device cuda --compile --repeats 10 --steps 12 \
  --hidden 4096 --width 14336 --experts 8 --top-k 2 --tokens 16384
stage layer_fine_compiled 110 python3 bench/vs_torchtitan.py --device cuda --compile --repeats 10 --steps 12 \
  --hidden 2048 --width 1408 --experts 64 --top-k 6 --tokens 16384
# 6. the compiled path alone, then the stack with whole blocks compiled (the MoE layers traced whole)
stage check_compile 170 $GC --timeout 160 --out /tmp/gc/c --only fsdp2_compile
stage stack_compile_all 150 python3 bench/gpu_moe_stack.py --compile all
# 7. the collector kept out of the step (trainer.gc_every_n_steps=50, torchtitan's gc_freq) beside stage 1's row
stage check_ddp_gc 110 $GC --timeout 100 --gc-every 50 --out /tmp/gc/g --only ddp_bf16
# 8. the routing weights in the SwiGLU (moe_opt.weights_in_activation) beside stage 3's row, then its loss
#    curve beside today's combine (200 steps, bf16-mixed)
stage stack_compile_weights_in_activation 120 python3 bench/gpu_moe_stack.py --compile --weights-in-activation
stage loss_weights_in_activation 120 python3 bench/lever_loss.py --gpu --precision bf16-mixed
# 9. the whole compiled blocks replayed as CUDA graphs (the GPU's idle time between launches) beside stage 6's
stage stack_compile_all_cuda_graphs 150 python3 bench/gpu_moe_stack.py --compile all --cuda-graphs
# 10. the experts' GEMMs in FP8 (moe_opt.fp8_experts, torch._scaled_grouped_mm) beside stage 3's row, then its
#     loss beside bf16's on the card
stage stack_compile_fp8_experts 120 python3 bench/gpu_moe_stack.py --compile --fp8-experts
stage loss_fp8_experts 150 python3 bench/lever_loss.py --gpu --precision bf16-mixed --lever moe_opt.fp8_experts=true
# 11. the experts' SwiGLU as eager ops, the peer of stage 2's row (eager blocks: the fused Triton kernels)
stage stack_eager_swiglu 90 python3 bench/gpu_moe_stack.py --swiglu eager
echo "=== done in $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
grep -h "^|\|rc=\|SKIP\|^train.py runs\|FAILED\|failed:" "$LOG"

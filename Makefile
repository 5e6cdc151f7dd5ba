# moe: `make train` then `make test` on a fresh machine. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help setup train eval data test test-slow test-slurm test-multinode test-neuron test-floor gpu-check coverage smoke sweep-smoke report bench lint compile-neuron clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP) ## create .venv (CPU torch 2.13.0, pinned by constraints.txt) and install moe
	@echo "venv ready: $(VENV)"

train: $(STAMP) ## default run: tiny MoE, bundled data, CPU (a few minutes); ARGS='key=value ...' to override
	$(PY) train.py $(ARGS)

RUN ?= last
eval: $(STAMP) ## lm-evaluation-harness on a run (RUN=runs/<name>, a checkpoint or a sharded one; default: the newest): the bundled offline tasks, a table, <run>/eval.json; ARGS='perplexity_file=F tasks=[...] task_dirs=[...]' (docs/EVALUATION.md)
	$(PY) -m moe.eval ckpt=$(RUN) $(ARGS)

# one intra-op thread a process unless the environment says otherwise: two workers and the processes their
# tests start share 2 cores, and at 2 threads each the tiny ops' spin-waits cost 4.8x (docs/TESTING.md)
test: export OMP_NUM_THREADS ?= 1
test: $(STAMP) ## fast test suite (about 3.5 minutes on 2 cores with TEST_WORKERS=2 pytest-xdist workers, 0: one process; one thread a process unless OMP_NUM_THREADS is set; CI runs it, then test-slurm beside test-multinode, test-slow, test-floor and test-neuron; docs/TESTING.md)
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# a launch's ranks start one after another (rank 0 imports and composes, then starts the rest), so one slow
# test leaves a core idle much of the time: two test modules at once, then the timing-sensitive ones alone
SLOW_WORKERS ?= 2
test-slow: $(STAMP) ## slow tests: multi-process equivalence, kill-and-resume, end-to-end sweeps (SLOW_WORKERS=2 modules at once, then the `serial` ones alone)
	$(PY) -m pytest -q -m 'slow and not serial' -n $(SLOW_WORKERS) --dist loadscope $(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m 'slow and serial' $(ARGS) || [ $$? -eq 5 ]

SLURM_TOOLS = munged slurmctld slurmd sbatch
test-slurm: $(STAMP) ## a real SLURM cluster, two slurmd on this host (needs root and Debian's munge slurmctld slurmd slurm-client): the sbatch scripts in slurm/ train (one node and two), pre-empt, requeue and resume; a submitit sweep (about 3 minutes)
	@for t in $(SLURM_TOOLS); do command -v $$t >/dev/null || { echo "make test-slurm needs $$t: apt-get install munge slurmctld slurmd slurm-client (as root)"; exit 2; }; done
	$(PY) -m pytest -q -m slurm tests/slurm $(ARGS)

test-multinode: $(STAMP) ## two torchrun nodes on this host (c10d rendezvous, one slower to start): DDP with EP and FSDP2 HSDP across the nodes equal one process, a worker SIGKILLed on one node and torchrun's restart resumes it exactly in one run dir, nodes with other arguments refused (about 2 minutes)
	$(PY) -m pytest -q -m multinode tests/multinode --durations=0 $(ARGS)

coverage: $(STAMP) ## the fast suite with line coverage of moe/ (in-process code; report in htmlcov/)
	$(PY) -m pytest -q --cov=moe --cov-report=term:skip-covered --cov-report=html $(ARGS)

NXD_CPU ?= $(HOME)/.cache/moe-nxd-cpu
test-neuron: ## the trn1 backend on neuronx-distributed v2.28.0's real code in CPU mode (NXD_SRC=copy; first run sets up 7.7 GB in NXD_CPU)
	@PREFIX=$(NXD_CPU) bash tests/neuron_real/setup.sh
	PREFIX=$(NXD_CPU) bash tests/neuron_real/run.sh $(CHECKS)

FLOOR_VENV ?= .venv-floor
# every backend's parity tests, the bf16 tests and the GPU emulations, at the oldest torch and Lightning admitted
FLOOR_TESTS ?= tests/test_gpu_paths.py tests/test_moe_layer.py tests/test_model.py tests/test_bf16.py \
  tests/test_expert_parallel_training.py::test_ep2_ddp_matches_single_process_and_its_sharded_checkpoint_reads_whole \
  tests/test_strategies_deepspeed.py::test_cpu_deepspeed_matches_single_process \
  tests/test_fsdp2.py::test_every_fsdp2_layout_matches_one_process \
  tests/test_folded_ep.py::test_tp2_ep2_on_4_ranks_equals_one_process \
  tests/test_fsdp2_offload.py tests/test_fused_ce.py tests/test_routing.py tests/test_compile_regions.py \
  tests/test_host_syncs.py::test_the_one_process_path_never_syncs tests/test_fp8_experts.py \
  tests/test_fused_swiglu.py
test-floor: ## every backend's parity tests, bf16 and the GPU emulations on the oldest stack pyproject admits (torch 2.9.0, Lightning 2.5.0: constraints-floor.txt; first run sets up 7.4 GB in FLOOR_VENV)
	@VENV=$(FLOOR_VENV) bash tests/floor/setup.sh
	$(FLOOR_VENV)/bin/python -m pytest -q -m '' -n $(SLOW_WORKERS) --dist loadscope $(FLOOR_TESTS) $(ARGS)

# the venv's Python where there is one, else the image's
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check: ## on CUDA GPUs, from a checkout (the venv's Python if any, else python3): every GPU path trains 30 steps of moe_1b at seq 2048, one table, then the GPU benches; ARGS=--cpu-smoke here
	$(GPU_PYTHON) bench/gpu_check.py $(ARGS)

smoke: $(STAMP) ## 20-step CPU run plus dry runs of the trn1, gpu (DeepSpeed), gpu_fsdp2 (pipelined too) and trn2 presets
	$(PY) train.py trainer=smoke run_name=smoke resume=false $(ARGS)
	$(PY) train.py dry_run=true experiment=karakuri_8x7b_trn1
	$(PY) train.py dry_run=true hardware=gpu parallel=dp2_ep8 model=mixtral_8x7b
	$(PY) train.py dry_run=true experiment=mixtral_8x7b_gpu_fsdp2
	$(PY) train.py dry_run=true experiment=mixtral_8x22b_gpu_fsdp2
	$(PY) train.py dry_run=true experiment=deepseek_v3_gpu_fsdp2
	$(PY) train.py dry_run=true experiment=switch_1t_gpu_fsdp2
	$(PY) train.py dry_run=true experiment=mixtral_8x7b_trn2

data: $(STAMP) ## prepare the bundled sample offline into data/prepared/sample (python data_prep.py data=sample)
	$(PY) data_prep.py data=sample overwrite=true $(ARGS)

REPORT_DIR = $(or $(DIR),$(shell ls -dt multirun/*/ runs/*/ 2>/dev/null | head -1))

sweep-smoke: $(STAMP) ## 3-point capacity sweep (1.0, 1.5, dropless) on the tiny model, then its report (multirun/sweep-smoke/)
	rm -rf multirun/sweep-smoke
	$(PY) train.py -m +sweep=sweep_smoke $(ARGS)
	$(PY) -m moe.report multirun/sweep-smoke

report: $(STAMP) ## report.md + PNGs for a run or sweep dir: make report DIR=multirun/<time> (default: the newest)
	@test -n "$(REPORT_DIR)" || { echo "make report: no run yet; pass DIR=runs/<name> or DIR=multirun/<time>" >&2; exit 2; }
	$(PY) -m moe.report $(REPORT_DIR) $(ARGS)

bench: $(STAMP) ## benchmarks side by side with their peers (figures go in docs/BENCHMARKS.md)
	$(PY) bench/moe_layer.py
	$(PY) bench/train_step.py
	$(PY) bench/generate.py
	$(PY) bench/data_prep.py
	$(PY) bench/folded_ep.py
	$(PY) bench/train_vs_bare.py

NEURON_DEVICES ?= 32
NEURON_ARGS ?= experiment=karakuri_8x7b_trn1
TORCHRUN ?= torchrun --nproc_per_node=$(NEURON_DEVICES)
NEURON_COMPILE ?= neuron_parallel_compile
TRAIN_PY ?= train.py
compile-neuron: ## trn1: compile the train and eval graphs ahead (neuron_parallel_compile, 10 steps, nothing saved); NEURON_ARGS, TORCHRUN
	$(NEURON_COMPILE) $(TORCHRUN) $(TRAIN_PY) $(NEURON_ARGS) trainer.devices=$(NEURON_DEVICES) \
	  trainer.max_steps=10 trainer.val_check_interval=5 trainer.limit_val_batches=1 optimizer.warmup_steps=1 \
	  run_name=neuron_compile resume=false
	rm -rf runs/neuron_compile

lint: $(STAMP) ## ruff check
	$(VENV)/bin/ruff check .

clean: ## remove runs/, multirun/ and caches (keeps .venv)
	rm -rf runs multirun outputs .pytest_cache .ruff_cache

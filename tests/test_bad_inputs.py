"""Bad-input matrix: configs, data, checkpoints and the command line.

Every case must end with exit code 2 (a config or input error, which the supervisor never
retries; Hydra's composition errors too), one message naming the field, the value and the fix, no traceback,
and no partial output: no metrics.csv, summary.json or checkpoints/ in the run dir (an
existing run dir is left byte for byte as it was; data_prep.py leaves no output dir).

Most cases run train.py's code path in-process (compose the config as Hydra does, call the
entry point wrapped in `exit_on_user_error`) so the matrix stays fast; the command-line cases
and one end-to-end case per entry point run the real scripts in a subprocess.
"""
import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_cfg, file_size_limit, run_entry
from omegaconf import OmegaConf

import moe.config  # noqa: F401  (registers the typed schema)
from moe.checkpoint.lightning_io import AtomicCheckpointIO
from moe.config.validate import validate
from moe.errors import UserError, exit_on_user_error
from moe.train.run import train

OUTPUTS = ("metrics.csv", "summary.json", "checkpoints")


def compose_train(*overrides):
    return compose_cfg("run_name=bad", *overrides)


def exit_of(function, *args) -> tuple[int, str]:
    """(exit code, stderr) of `function(*args)` under train.py's user-error handling."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            exit_on_user_error(function)(*args)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def run_train(run_dir, *overrides):
    """train.py's main in-process: (exit code, stderr)."""
    return exit_of(train, compose_train(*overrides), run_dir)


def snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_user_error(code, err, field, value, fix, problem=None):
    """Exit 2, a single `error: field=value <problem> ... Fix: <fix>` paragraph, no traceback (None: any)."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    message = lines[0]
    assert message.startswith(f"error: {field}={value} "), message
    said, _, fixed = message.partition("Fix: ")
    assert fixed and (fix is None or fix in fixed), message
    assert problem is None or problem in said, message


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two tiny data_prep outputs: `sample` (bundled tokenizer, vocab 512), `other` (a 300-token BPE)."""
    from moe.data import prepare

    root = tmp_path_factory.mktemp("prepared")
    text = root / "corpus.txt"
    text.write_text("".join(f"the {i} quick brown fox jumps over the lazy dog {i}.\n" for i in range(300)))
    common = {"input": str(text), "seq_len": 32, "val_fraction": 0.1}
    sample = prepare({**common, "output": str(root / "sample"), "tokenizer": str(REPO / "data" / "sample")},
                     progress=False)
    other = prepare({**common, "output": str(root / "other"), "vocab_size": 300}, progress=False)
    return {"sample": sample, "other": other}


# ------------------------------------------------------------------------------------------ configs
CONFIG_CASES = [
    # overrides, field, value as printed, words of the problem, words of the fix (None: not asserted)
    (["parallel.ep=3"], "parallel.ep", "3", None, "use an ep that divides model.num_experts=8"),
    (["parallel.dp=4"], "parallel.dp", "4", None, "set parallel.dp=null"),
    (["trainer.devices=3"], "trainer.devices", "3", "devices_per_node=2", "raise trainer.num_nodes"),
    (["optimizer.lr=-0.001"], "optimizer.lr", "-0.001", None, "use a positive learning rate"),
    (["data.seq_len=1024"], "data.seq_len", "1024",
     "max_position_embeddings=512", "raise model.max_position_embeddings"),
    (["trainer.max_steps=0"], "trainer.max_steps", "0", "positive", "positive number"),
    (["optimizer.warmup_steps=-5"], "optimizer.warmup_steps", "-5", None, "positive step count"),
    (["parallel.zero_stage=2"], "parallel.zero_stage", "2", None, "hardware=cpu_deepspeed"),
    (["trainer.global_batch_size=10"], "trainer.global_batch_size", "10", "= 8", "global_batch_size=null"),
    (["model.top_k=9"], "model.top_k", "9", "num_experts=8", "1 <= top_k <= model.num_experts=8"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "3", "num_heads=4", "divisor of model.num_heads=4"),
    (["moe_opt.capacity_factor=-1"], "moe_opt.capacity_factor", "-1.0", None, "null for dropless routing"),
    (["hardware.strategy=tpu"], "hardware.strategy", "'tpu'",
     None, "use one of ddp, deepspeed, fsdp2, neuron"),
    (["trainer.spike_action=explode"], "trainer.spike_action", "'explode'", None, "use one of warn, skip"),
    (["trainer.spike_factor=0.5"], "trainer.spike_factor", "0.5", None, "0 to turn detection off"),
    (["model.hidden_size=0"], "model.hidden_size", "0", None, "positive integer"),
    (["model.hidden_size=100"], "model.head_dim", "25", None, "use an even head_dim"),
    (["model.num_heads=0"], "model.num_heads", "0", None, "positive integer"),
    (["model.num_layers=0"], "model.num_layers", "0", None, "positive integer"),
    (["model.vocab_size=0"], "model.vocab_size", "0", None, "positive integer"),
    (["model.num_experts=0"], "model.num_experts", "0", "at least 1", "positive integer"),
    (["model.top_k=0"], "model.top_k", "0", "at least 1", "positive integer"),
    (["model.head_dim=3"], "model.head_dim", "3", None, "use an even head_dim"),
    (["model.position_encoding=alibix"], "model.position_encoding", "'alibix'",
     None, "use one of rope, alibi"),
    (["model.sliding_window=0"], "model.sliding_window", "0", None, "null for full attention"),
    (["model.rms_norm_eps=0"], "model.rms_norm_eps", "0.0", None, "small positive epsilon"),
    (["model.rope_theta=-1"], "model.rope_theta", "-1.0", None, "positive base such as 1e6"),
    (["model.shared_expert_intermediate_size=-1"], "model.shared_expert_intermediate_size", "-1",
     None, "0 (no shared expert)"),
    (["model.dense_intermediate_size=0"], "model.dense_intermediate_size", "0", None, "or null"),
    (["moe_opt.eval_capacity_factor=0"], "moe_opt.eval_capacity_factor", "0.0",
     None, "null for dropless routing"),
    (["moe_opt.min_capacity=-1"], "moe_opt.min_capacity", "-1", None, "use 0 or more"),
    (["moe_opt.drop_policy=random"], "moe_opt.drop_policy", "'random'",
     "not a known drop policy", "use one of probs, position"),
    (["moe_opt.aux_loss_coeff=-0.1"], "moe_opt.aux_loss_coeff", "-0.1", None, "0 or a positive coefficient"),
    (["moe_opt.z_loss_coeff=-1"], "moe_opt.z_loss_coeff", "-1.0", None, "0 or a positive coefficient"),
    (["moe_opt.jitter_eps=1.5"], "moe_opt.jitter_eps", "1.5", None, "0 turns jitter off"),
    (["moe_opt.router_dtype=fp8"], "moe_opt.router_dtype", "'fp8'", None, "use one of fp32, bf16, fp16"),
    (["moe_opt.aux_loss_group=world"], "moe_opt.aux_loss_group", "'world'", None, "use one of ep, dp"),
    (["moe_opt.load_balancing_type=magic"], "moe_opt.load_balancing_type", "'magic'",
     None, "use one of aux_loss, seq_aux_loss, none"),
    (["moe_opt.bias_update_rate=-1"], "moe_opt.bias_update_rate", "-1.0", None, "such as 1e-3"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size", "0", "at least 1", "1 or more"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", "0", None, "1 or more"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps", "0", None, "1 or more"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval", "0", None, "1 or more"),
    (["trainer.checkpoint_every_n_steps=0"], "trainer.checkpoint_every_n_steps", "0", None, "1 or more"),
    (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches", "-1", None, "0 (no validation)"),
    (["trainer.num_nodes=0"], "trainer.num_nodes", "0", None, "1 or more"),
    (["trainer.precision=fp8"], "trainer.precision", "'fp8'", None, "use one of 32-true"),
    (["trainer.spike_window=0"], "trainer.spike_window", "0", None, "use 1 or more steps"),
    (["trainer.spike_max_rollbacks=-1"], "trainer.spike_max_rollbacks", "-1", None, "use 0 or more"),
    (["trainer.max_nonfinite_steps=-1"], "trainer.max_nonfinite_steps", "-1", None, "0 (never stop)"),
    (["hardware.neuron_precision=fp4"], "hardware.neuron_precision", "'fp4'",
     None, "use one of auto, bf16_sr, mixed, fp32"),
    (["parallel.tp=0"], "parallel.tp", "0", None, "1 or more"),
    (["parallel.pp=0"], "parallel.pp", "0", None, "1 or more"),
    (["parallel.ep=0"], "parallel.ep", "0", "at least 1", "1 or more"),
    (["parallel.dp=0"], "parallel.dp", "0", None, "or null to derive it"),
    (["parallel.tp=2"], "parallel.tp", "2", None, "e.g. hardware=trn1"),
    (["parallel.pp=2"], "parallel.pp", "2", None, "e.g. hardware=trn1"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "True", "tp > 1", "parallel.tp > 1"),
    (["parallel.zero_stage=5"], "parallel.zero_stage", "5", None, "use 0, 1, 2 or 3"),
    (["parallel.activation_checkpointing=some"], "parallel.activation_checkpointing", "'some'",
     None, "use one of none, selective"),
    (["parallel.activation_checkpointing_every_n=0"], "parallel.activation_checkpointing_every_n", "0",
     "at least 1", "use 1 or more"),
    (["parallel.hybrid_shard_degree=2"], "parallel.hybrid_shard_degree", "2",
     None, "hybrid_shard_degree=null"),
    (["parallel=dp2_ep8"], "parallel.dp", "16", None, "trainer.devices=2 trainer.num_nodes=8"),
    (["hardware=trn1", "data.document_mask=true", "dry_run=true"], "data.document_mask", "True",
     "kernels/flash_attn.py:162-169", "set data.document_mask=false on trn1"),
    (["hardware=gpu_fsdp2", "parallel.pp=2", "trainer.devices=2", "dry_run=true", "data.document_mask=true"],
     "data.document_mask", "True", "pipeline stages", "train with parallel.pp=1"),
    (["hardware=trn1", "hardware.neuron_precision=bf16_sr", "dry_run=true"],
     "hardware.neuron_precision", "'bf16_sr'", None, "use hardware.neuron_precision=mixed"),
    (["hardware=trn1", "parallel=tp8_pp8_ep8", "moe_opt=dropless", "dry_run=true"],
     "moe_opt.capacity_factor", "None", None, "set moe_opt.capacity_factor (e.g. 2.0"),
    (["hardware=trn1", "parallel=tp8_pp8_ep8", "moe_opt.capacity_factor=4.0",
      "moe_opt.eval_capacity_factor=4.0", "dry_run=true"],
     "moe_opt.capacity_factor", "4.0", None, "below num_experts / top_k = 4"),
    (["hardware=trn1", "parallel=tp8_pp8_ep8", "parallel.zero_stage=0", "dry_run=true"],
     "parallel.zero_stage", "0", None, "set parallel.zero_stage=1 with parallel.ep > 1"),
    (["hardware=trn1", "parallel=tp8_pp8_ep8", "parallel.tp=4", "dry_run=true"], "parallel.tp", "4",
     None, "use tp 2 or 8 with parallel.ep > 1"),
    (["hardware=cpu_fsdp2", "parallel=dp2", "trainer.devices=2"], "parallel.zero_stage", "0",
     None, "set parallel.zero_stage=3"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_ep2", "trainer.devices=2", "parallel.hybrid_shard_degree=1"],
     "parallel.hybrid_shard_degree", "1", None, "is a multiple of parallel.ep=2"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "parallel.ep=3", "model.num_experts=6", "trainer.devices=6",
      "hardware.devices_per_node=6"], "parallel.ep", "3", "neither divides nor is a multiple of tp=2",
     "use an ep that is a multiple of parallel.tp=2"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "parallel.ep=4", "trainer.devices=2"], "parallel.ep", "4",
     "does not divide the 2 ranks", "use an ep that divides dp x tp = 2"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2", "trainer.micro_batch_size=1",
      "data.seq_len=127"], "trainer.micro_batch_size", "1", "cannot split evenly over the 2 TP ranks",
     "whose product divides by parallel.tp=2"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2", "parallel.sequence_parallel=true",
      "data.seq_len=127"], "data.seq_len", "127", "cannot be split evenly over the 2 TP ranks",
     "use a sequence length divisible by parallel.tp=2"),
    (["hardware=cpu_fsdp2", "model.tie_word_embeddings=true"], "model.tie_word_embeddings", "True",
     None, "set model.tie_word_embeddings=false"),
    (["hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "trainer.devices=2", "model.position_encoding=alibi"],
     "model.position_encoding", "'alibi'", None, "use rope with tensor parallelism"),
    (["hardware=cpu_fsdp2", "trainer.precision=bf16-true"], "trainer.precision", "'bf16-true'",
     None, "use one of 32-true, bf16-mixed"),
    (["model=tiny_deepseek_v3", "model.kv_lora_rank=null"], "model.kv_lora_rank", "None",
     None, "set model.kv_lora_rank to a positive integer (DeepSeek-V3: 512"),
    (["model=tiny_deepseek_v3", "model.qk_rope_head_dim=15"], "model.qk_rope_head_dim", "15",
     None, "use an even qk_rope_head_dim"),
    (["model.attention=mha"], "model.attention", "'mha'", None, "use one of gqa, mla"),
    (["lock_wait_s=-1"], "lock_wait_s", "-1.0", "must not be negative", "use 0 or more seconds"),
    (["parallel.collective_timeout_s=0"], "parallel.collective_timeout_s", "0.0", "must be positive",
     "use a positive number of seconds"),
    (["model.first_k_dense_replace=9"], "model.first_k_dense_replace", "9",
     None, "use 0 (no leading dense layers)"),
    (["data.kind=weird"], "data.kind", "'weird'", None, "use one of prepared, online"),
    (["data.format=weird"], "data.format", "'weird'", None, "use one of text, chat, sentence"),
    (["data.val_fraction=1.5"], "data.val_fraction", "1.5", None, "a fraction in [0, 1)"),
    (["data.num_workers=-1"], "data.num_workers", "-1", None, "0 (load in the training process)"),
    (["optimizer.lr=0"], "optimizer.lr", "0.0", "positive", "positive learning rate"),
    (["optimizer.min_lr=1"], "optimizer.min_lr", "1.0", None, "0 <= min_lr <= optimizer.lr"),
    (["optimizer.betas=[0.9,1.2]"], "optimizer.betas", "[0.9, 1.2]", None, "two values in [0, 1)"),
    (["optimizer.eps=0"], "optimizer.eps", "0.0", None, "small positive epsilon"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay", "-1.0", None, "use 0 or more"),
    (["optimizer.grad_clip=-1"], "optimizer.grad_clip", "-1.0", None, "or 0 for off"),
    (["optimizer.decay_steps=0"], "optimizer.decay_steps", "0", None, "null for trainer.max_steps"),
    (["hardware.strategy=horovod"], "hardware.strategy", "'horovod'", "not a known strategy", None),
    (["parallel.tp=2", "trainer.devices=2"], "parallel.tp", "2", "DDP", None),
    (["parallel.pp=2", "trainer.devices=2"], "parallel.pp", "2", "DDP", None),
    (["routing_skew=0.5"], "routing_skew", "0.5", "below its balanced share", "1.0 (perfect balance)"),
    (["hardware=cpu_fsdp2", "parallel.pp=2", "trainer.devices=2", "trainer.accumulate_grad_batches=2",
      "parallel.pp_schedule=ZBVZeroBubble"], "parallel.pp_schedule", "'ZBVZeroBubble'", "fail in eval()",
     "InterleavedZeroBubble"),
    (["hardware=cpu_fsdp2", "parallel.pp=2", "trainer.devices=2"], "trainer.accumulate_grad_batches", "1",
     "micro-batches 1F1B runs", "at least 2 micro-batches"),
    (["hardware=trn1", "parallel.tp=2", "trainer.devices=3"], "parallel.tp", "2",
     "does not divide the world size 3", None),
    (["parallel=dp2"], "parallel.dp", "2", "world is 1", None),
    (["parallel.ep=3", "trainer.devices=2", "trainer.num_nodes=3"], "parallel.ep", "3",
     "num_experts=8", None),
    (["parallel=ep2"], "parallel.ep", "2", "data-parallel size 1", None),
    (["hardware=cpu_deepspeed", "trainer.devices=2", "parallel.zero_stage=1",
      "parallel.hybrid_shard_degree=2"],
     "parallel.hybrid_shard_degree", "2", "not implemented by DeepSpeed", None),
    (["hardware=cpu_deepspeed", "parallel.zero_stage=4"], "parallel.zero_stage", "4",
     "not a ZeRO stage", None),
    (["hardware=cpu_deepspeed", "parallel.zero_stage=3"], "parallel.zero_stage", "3",
     "not available with DeepSpeed", None),
    (["hardware=trn1", "parallel.zero_stage=2"], "parallel.zero_stage", "2", "hardware=trn1", None),
    (["parallel.zero_stage=1"], "parallel.zero_stage", "1", "PyTorch DDP", None),
    (["hardware=cpu_deepspeed", "parallel.tp=2", "trainer.devices=2"], "parallel.tp", "2",
     "not implemented by DeepSpeed", None),
    (["hardware=trn1", "parallel.tp=8", "trainer.devices=8"], "parallel.tp", "8", "num_heads=4", None),
    (["hardware=trn1", "parallel.pp=8", "trainer.devices=8"], "parallel.pp", "8", "num_layers=4", None),
    (["hardware=trn1", "trainer.precision=bf16-mixed"], "trainer.precision", "'bf16-mixed'",
     "not used by neuronx-distributed", None),
    (["parallel.activation_checkpointing=sometimes"], "parallel.activation_checkpointing", "'sometimes'",
     "not a known policy", None),
    (["model.hidden_size=130"], "model.hidden_size", "130", "num_heads=4", None),
    (["model.moe_layer_frequency=0"], "model.moe_layer_frequency", "0", "at least 1", None),
    (["moe_opt.capacity_factor=0"], "moe_opt.capacity_factor", "0.0", "positive or null", None),
    (["moe_opt.eval_capacity_factor=-1"], "moe_opt.eval_capacity_factor", "-1.0", "positive or null", None),
    (["moe_opt.router_dtype=int8"], "moe_opt.router_dtype", "'int8'", "not a known router dtype", None),
    (["optimizer.min_lr=0.01"], "optimizer.min_lr", "0.01", "lr=0.003", None),
    (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps", "-1", "must not be negative", None),
    (["moe_opt.bias_update_rate=-0.001"], "moe_opt.bias_update_rate", "-0.001", "must not be negative", None),
    # reached numpy's seeding (a traceback after start-up) before it was checked
    (["seed=-1"], "seed", "-1", "is not a seed numpy accepts", "from 0 to 4294967295"),
    (["seed=4294967296"], "seed", "4294967296", "is not a seed numpy accepts", "from 0 to 4294967295"),
    (["data.split_seed=-3"], "data.split_seed", "-3", "is not a seed numpy accepts", "whole number"),
    (["parallel.overlap_comm=true"], "parallel.overlap_comm", "True", "DeepSpeed's ZeRO setting",
     "leave parallel.overlap_comm=null"),
    (["hardware.peak_tflops=0"], "hardware.peak_tflops", "0.0", "must be positive", "MFU divides by"),
    (["hardware.device_memory_gib=0"], "hardware.device_memory_gib", "0.0", "must be positive", "in GiB"),
    (["trainer.save_checkpoints=false", "trainer.spike_action=rollback"], "trainer.spike_action",
     "'rollback'", "writes none", "trainer.save_checkpoints=true"),
    (["moe_opt.fp8_experts=true", "trainer.precision=32-true"], "trainer.precision", "'32-true'",
     "the FP8 expert GEMMs write bf16", "trainer.precision=bf16-mixed"),
    (["moe_opt.fp8_experts=true", "trainer.precision=bf16-mixed", "model.intermediate_size=200"],
     "model.intermediate_size", "200", "not a multiple of 16", "use a multiple of 16 (e.g. 208)"),
]

ENVIRONMENT_CASES = [
    # what train() checks beyond the rules: the machine (moe/train/environment.py) and the directories
    # named; overrides, field, value, words of the fix
    (["model.init_from_hf=/nonexistent"], "model.init_from_hf", "'/nonexistent'",
     "written by save_pretrained"),
    (["model.upcycle_from_hf=/nonexistent"], "model.upcycle_from_hf", "'/nonexistent'",
     "written by save_pretrained"),
    (["hardware=trn1"], "hardware", "'trn1'", "Neuron SDK 2.28 environment"),
    (["hardware=trn2"], "hardware", "'trn2'", "TorchNeuron installed"),
    (["hardware=gpu"], "hardware", "'gpu'", "dry_run=true or simulate=true plan the GPU run"),
    (["logger=wandb", "logger.wandb.offline=false"], "logger.wandb.offline", "False", "export WANDB_API_KEY"),
    (["+callbacks.x._target_=nodots"], "callbacks.x._target_", "'nodots'", "naming a class"),
]


@pytest.mark.parametrize("overrides, field, value, problem, fix", CONFIG_CASES,
                         ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_bad_config(overrides, field, value, problem, fix):
    """Every rule of moe.config.validate: exit 2 and one paragraph naming the field, the value seen, the
    problem and the fix."""
    code, err = exit_of(validate, compose_train(*overrides))
    assert_user_error(code, err, field, value, fix, problem)


@pytest.mark.parametrize("overrides, field, value, fix", ENVIRONMENT_CASES,
                         ids=[" ".join(c[0]) for c in ENVIRONMENT_CASES])
def test_what_the_machine_lacks(tmp_path, monkeypatch, overrides, field, value, fix):
    """What the machine must offer and the directories the config names, refused by train() itself:
    nothing written."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    run_dir = tmp_path / "run"
    code, err = run_train(run_dir, *overrides)
    assert_user_error(code, err, field, value, fix)
    assert not run_dir.exists()  # nothing written: the check runs before anything is built


def test_a_thread_count_that_is_not_one(tmp_path, monkeypatch):
    """OMP_NUM_THREADS chooses a CPU run's threads (moe/backends/threads.py); a malformed one is refused
    before anything is written, not half-ignored by OpenMP."""
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    code, err = run_train(tmp_path / "run")
    assert_user_error(code, err, "OMP_NUM_THREADS", "'two'", "positive whole number")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ data
def test_missing_prepared_data_path(tmp_path):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={tmp_path / 'nowhere'}")
    assert_user_error(code, err, "data.path", repr(str(tmp_path / "nowhere")), "python data_prep.py")
    assert not (tmp_path / "run").exists()


def test_prepared_data_without_a_path(tmp_path):
    code, err = run_train(tmp_path / "run", "data=prepared")
    assert_user_error(code, err, "data.path", "None", "pass data.path=DIR")
    assert not (tmp_path / "run").exists()


def test_missing_raw_data_file(tmp_path):
    code, err = run_train(tmp_path / "run", f"data.path={tmp_path / 'missing.txt'}")
    assert_user_error(code, err, "data.path", repr(str(tmp_path / "missing.txt")), "check the path")
    assert not (tmp_path / "run").exists()


def test_online_data_without_a_tokenizer(tmp_path):
    code, err = run_train(tmp_path / "run", "data.tokenizer=null")
    assert_user_error(code, err, "data.tokenizer", "None", "pass data.tokenizer=DIR")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_template_dir_without_document_starts_is_refused_before_the_run(tmp_path):
    """A prepared dir's meta.json says how its rows were rendered and which columns it has: document_mask on
    rows of the tokenizer's own chat template written before data_prep.py recorded where each row starts
    is refused by train.py (exit 2, one paragraph, no run dir)."""
    data = tmp_path / "prep"
    (data / "tokenizer").mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps({"seq_len": 128, "columns": ["input_ids", "loss_mask"],
                                                "config": {"format": "chat", "chat_template": "tokenizer"}}))
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={data}", "data.document_mask=true")
    assert_user_error(code, err, "data.path", repr(str(data)), "prepare it again with data_prep.py")
    assert "doc_starts" in err
    assert not (tmp_path / "run").exists()


def test_prepared_data_from_another_tokenizer(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          f"data.tokenizer={prepared['other'] / 'tokenizer'}")
    assert_user_error(code, err, "data.tokenizer", repr(str(prepared["other"] / "tokenizer")),
                      "re-run data_prep.py with this tokenizer")
    assert "different vocabulary" in err
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_vocab_larger_than_the_model(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          "model.vocab_size=256")
    assert_user_error(code, err, "model.vocab_size", "256", "set model.vocab_size=512")
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_seq_len_above_max_positions(tmp_path, prepared):
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={prepared['sample']}",
                          "model.max_position_embeddings=16")
    assert code == 2 and "Traceback" not in err
    assert "32" in err and "max_position_embeddings" in err and "Fix: " in err  # meta.json's seq_len is 32
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


def test_prepared_dir_whose_tokenizer_changed_after_prep(tmp_path, prepared):
    data = tmp_path / "data"
    shutil.copytree(prepared["sample"], data)
    tok = data / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text() + "\n")
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={data}")
    assert_user_error(code, err, "data.path", repr(str(data)), "re-run data_prep.py")
    assert "sha256 differs from meta.json" in err
    assert not any((tmp_path / "run" / name).exists() for name in OUTPUTS)


# ------------------------------------------------------------------------------------------ checkpoints
def existing_run(tmp_path, hidden_size=128, name="last.ckpt"):
    """A run dir as a crashed run leaves it: metrics.csv and one checkpoint of a model config."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step,loss\n1,6.0\n")
    cfg = compose_train(f"model.hidden_size={hidden_size}")
    hparams = {"cfg": OmegaConf.to_container(cfg, resolve=True)}
    weights = {"model.w": torch.arange(4096, dtype=torch.float32)}
    state = {"global_step": 5, "state_dict": weights, "hyper_parameters": hparams}
    AtomicCheckpointIO().save_checkpoint(state, run_dir / "checkpoints" / name)
    return run_dir


def flip_a_tensor_byte(path):
    """One bit-rotted byte inside the tensor data (torch.load would read it without complaint)."""
    data = bytearray(path.read_bytes())
    at = data.index(torch.arange(4096, dtype=torch.float32)[2048:2052].numpy().tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_truncated_checkpoint_with_no_good_one_to_fall_back_to(tmp_path):
    run_dir = existing_run(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:200])
    before = snapshot(run_dir)
    code, err = run_train(run_dir)
    assert_user_error(code, err, "resume", "True", "set resume=false, or use another run_name")
    assert "found no loadable checkpoint" in err and "last.ckpt is 200 bytes" in err and "(truncated)" in err
    assert snapshot(run_dir) == before


def test_garbage_checkpoint_file(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000010.ckpt").write_text("not a checkpoint")
    before = snapshot(run_dir)
    code, err = run_train(run_dir)
    assert_user_error(code, err, "resume", "True", "resume=false")
    assert "step-000010.ckpt cannot be read" in err
    assert snapshot(run_dir) == before


def test_resume_with_a_changed_model_shape(tmp_path):
    run_dir = existing_run(tmp_path, hidden_size=64)
    before = snapshot(run_dir)
    code, err = run_train(run_dir)  # hidden_size back to the preset's 128
    assert_user_error(code, err, "model.hidden_size", "128", "resume=false")
    assert "model.hidden_size=64" in err and "another run_name" in err
    assert snapshot(run_dir) == before


def test_corrupt_checkpoint_without_its_sidecar_is_not_resumed(tmp_path):
    run_dir = existing_run(tmp_path, name="step-000005.ckpt")
    ckpt = run_dir / "checkpoints" / "step-000005.ckpt"
    (run_dir / "checkpoints" / "step-000005.ckpt.meta.json").unlink()  # copied without it, or a kill
    flip_a_tensor_byte(ckpt)
    before = snapshot(run_dir)
    code, err = run_train(run_dir)
    assert_user_error(code, err, "resume", "True", "resume=false")
    assert "step-000005.ckpt fails the CRC-32 of its record" in err and "(corrupt)" in err
    assert snapshot(run_dir) == before


def test_infer_refuses_a_corrupt_checkpoint_without_its_sidecar(tmp_path):
    run_dir = existing_run(tmp_path, name="step-000005.ckpt")
    ckpt = run_dir / "checkpoints" / "step-000005.ckpt"
    (run_dir / "checkpoints" / "step-000005.ckpt.meta.json").unlink()
    flip_a_tensor_byte(ckpt)
    proc = run_entry("infer.py", f"ckpt={ckpt}", "prompt=x", timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: ckpt='{ckpt}' fails the CRC-32 of its record" in proc.stderr and "Fix: " in proc.stderr


def test_disk_full_while_saving_a_checkpoint(tmp_path):
    """A real write failing half-way through a save (a file-size limit below one checkpoint): one paragraph,
    the temporary file removed, no summary.json (it was torch's `RuntimeError: ... unexpected pos`)."""
    run_dir = tmp_path / "run"
    with file_size_limit(2 * 2**20):
        code, err = run_train(run_dir, "trainer.max_steps=2", "model.num_layers=1")
    assert code == 2 and "Traceback" not in err, err
    ckpt = run_dir / "checkpoints" / "step-000002.ckpt"
    assert (f"error: checkpoint='{ckpt}' could not be written (File too large: EFBIG); its temporary "
            "file was removed. Fix: free space") in err
    assert not list(run_dir.rglob("*.tmp")) and not (run_dir / "summary.json").exists()
    assert not list((run_dir / "checkpoints").iterdir())


def test_a_logger_whose_package_is_missing(tmp_path, monkeypatch):
    from moe.train import environment

    monkeypatch.setattr(environment, "installed", lambda name: name not in ("tensorboard", "tensorboardX"))
    code, err = run_train(tmp_path / "run", "logger=tensorboard")
    assert_user_error(code, err, "logger.tensorboard", "'lightning.pytorch.loggers.TensorBoardLogger'",
                      "pip install tensorboard")
    assert "needs tensorboard or tensorboardX, which is not installed" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ command line
def run_cli(tmp_path, script, *overrides):
    run_dir = tmp_path / "run"
    proc = run_entry(script, f"hydra.run.dir={run_dir}", *overrides, timeout=300, here=True)
    return proc, run_dir


CLI_CASES = [
    ("model=tinyy", ["Could not find 'model/tinyy'", "Available options", "tiny_switch"]),  # unknown preset
    ("trainer.max_step=5", ["trainer.max_step", "Key 'max_step' not in 'TrainerConfig'"]),  # unknown key
    ("+trainer.max_step=5", ["trainer.max_step=5 is not a key of the config schema", "max_steps"]),  # with +
    ("+moe_opt.capacity=2", ["moe_opt.capacity=2 is not a key", "capacity_factor"]),
    ("trainer.max_steps=abc", ["trainer.max_steps", "'abc'", "could not be converted to Integer"]),  # type
    ("resume=maybe", ["resume", "'maybe'", "is not a valid bool"]),  # wrong type for a flag
    ("moe_opt.aux_loss_coeff=nan", ["moe_opt.aux_loss_coeff=nan is not a finite number"]),  # skipped all
    ("moe_opt.capacity_factor=inf", ["moe_opt.capacity_factor=inf is not a finite number"]),  # crashed
    ("optimizer.lr=-inf", ["optimizer.lr=-inf is not a finite number"]),
    ("parallel.ep=3", ["parallel.ep=3 does not divide num_experts=8"]),  # a rule of validate
    ("trainer.max_stesp=3", ["trainer.max_stesp", "did you mean trainer.max_steps?"]),  # a close key
    ("hardware=gpu_fsdp", ["hardware='gpu_fsdp'", "did you mean hardware=gpu_fsdp2?"]),  # a close preset
    ("+optimizer.lrr=1", ["optimizer.lrr=1 is not a key", "did you mean optimizer.lr?"]),
]


@pytest.mark.parametrize("override, needles", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_exits_2_before_the_run_dir_exists(tmp_path, override, needles):
    proc, run_dir = run_cli(tmp_path, "train.py", override)
    assert proc.returncode == 2, proc.stderr  # never retried by the supervisor
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1, proc.stderr
    assert "Fix: " in proc.stderr and "To append to your config use +" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not run_dir.exists()  # no .hydra/, no train.log: nothing half-written


def test_a_run_dir_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    proc = run_entry("train.py", f"hydra.run.dir={tmp_path / 'file' / 'run'}", timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"error: hydra.run.dir='{tmp_path / 'file' / 'run'}' cannot be created: {tmp_path / 'file'} "
            "is not a directory. Fix: ") in proc.stderr
    assert (tmp_path / "file").read_text() == "not a directory"


def test_a_read_only_run_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A run dir the user cannot write (a read-only mount, another user's directory). This machine runs
    tests as root, whom permissions do not stop, so the OS's answer is given to the check (os.access)."""
    from moe.train import preflight

    run_dir = tmp_path / "shared" / "run"
    run_dir.mkdir(parents=True)
    real_access = preflight.os.access
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False if Path(path) == run_dir
                        else real_access(path, mode))
    with pytest.raises(UserError) as err:
        preflight.check_writable(run_dir)
    assert str(err.value).startswith(f"hydra.run.dir='{run_dir}' cannot be created: {run_dir} cannot be "
                                     "written by this user. Fix: pick a writable place")
    assert sorted(run_dir.iterdir()) == []


def test_a_refused_resume_leaves_the_existing_run_byte_for_byte(tmp_path):
    """Hydra would rewrite .hydra/ and append to train.log before train() refuses: train.py checks first."""
    run_dir = existing_run(tmp_path, hidden_size=64)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  hidden_size: 64\n")
    (run_dir / "train.log").write_text("the first launch\n")
    before = snapshot(run_dir)
    proc, _ = run_cli(tmp_path, "train.py")  # hidden_size back to the preset's 128
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: model.hidden_size=128 differs from the run being resumed" in proc.stderr
    assert snapshot(run_dir) == before


def test_a_sweep_with_a_bad_job_exits_2_before_any_job_runs(tmp_path):
    """-m: every job is composed and checked first (job #1 here), with the job named."""
    sweep_dir = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    proc = run_entry("train.py", "-m", "model=tiny,tinyy", sweep_dir, timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr  # Hydra's own exit is 1
    assert "error: model='tinyy' is refused when composing the config" in proc.stderr
    assert "(in sweep job #1: model=tinyy" in proc.stderr
    assert not (tmp_path / "sweep").exists()  # job #0 never ran


def test_a_sweep_preset_whose_plugin_is_missing_says_what_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper"):
        pytest.skip("hydra-optuna-sweeper is installed here")
    sweep_dir = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    proc = run_entry("train.py", "-m", "+sweep=capacity_factor_optuna", sweep_dir, timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "Fix: install the Hydra plugin: pip install -e '.[optuna]'" in proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    proc, run_dir = run_cli(tmp_path, "train.py", "dry_run=true")
    assert proc.returncode == 0 and "memory per device" in proc.stdout, proc.stderr
    assert not run_dir.exists()


def test_train_py_user_error_end_to_end(tmp_path):
    proc, run_dir = run_cli(tmp_path, "train.py", "parallel.ep=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: parallel.ep=3 does not divide num_experts=8. Fix: " in proc.stderr
    assert not run_dir.exists()


def test_data_prep_bad_input_leaves_no_output(tmp_path):
    out = tmp_path / "prepared"
    proc = run_entry("data_prep.py", f"input={tmp_path / 'missing.txt'}", f"output={out}",
                     f"tokenizer={REPO / 'data' / 'sample'}", timeout=300, here=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: input='{tmp_path / 'missing.txt'}'" in proc.stderr and "Fix: " in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".prepared.tmp-*"))



# ------------------------------------------------------------------------------------------ weights files
def hf_dir_with(tmp_path, weights: bytes | None) -> Path:
    """A Mixtral directory this product exported, its model.safetensors replaced by `weights`."""
    from moe.infer.export import export_hf
    from moe.model import MoETransformer

    cfg = compose_train()
    model = MoETransformer(cfg.model, cfg.moe_opt, init_seed=0)
    out = export_hf(model, tmp_path / "hf", REPO / "data" / "sample")
    if weights is not None:
        (out / "model.safetensors").write_bytes(weights)
    return out


LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1234567\n")


def test_init_from_a_git_lfs_pointer_instead_of_weights(tmp_path):
    hf = hf_dir_with(tmp_path, LFS_POINTER)
    code, err = run_train(tmp_path / "run", f"model.init_from_hf={hf}")
    assert_user_error(code, err, "model.init_from_hf", repr(str(hf)), "git lfs pull",
                      "holds a git-lfs pointer in model.safetensors, not weights")
    assert not (tmp_path / "run").exists()


def test_init_from_a_safetensors_file_cut_short(tmp_path):
    hf = hf_dir_with(tmp_path, None)
    weights = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, err = run_train(tmp_path / "run", f"model.init_from_hf={hf}")
    assert_user_error(code, err, "model.init_from_hf", repr(str(hf)), "git lfs pull", "cut short")


def test_init_from_a_dir_whose_config_says_more_experts_than_its_weights_hold(tmp_path):
    """config.json with 16 experts beside weights of 8: refused at start-up, before any run dir, naming the
    tensor and both shapes (it was a traceback from the model's materialisation, mid-run)."""
    hf = hf_dir_with(tmp_path, None)
    config = json.loads((hf / "config.json").read_text())
    experts, hidden = config["num_local_experts"], config["hidden_size"]
    (hf / "config.json").write_text(json.dumps({**config, "num_local_experts": 2 * experts}))
    code, err = run_train(tmp_path / "run", f"model.init_from_hf={hf}")
    assert_user_error(code, err, "model.init_from_hf", repr(str(hf)),
                      "use the config.json saved with these weights",
                      f"holds our layers.0.ffn.router.weight as ({experts}, {hidden}), where its config.json "
                      f"implies ({2 * experts}, {hidden})")
    assert not (tmp_path / "run").exists()


def test_infer_from_an_hf_dir_whose_weights_file_is_empty(tmp_path):
    from moe.infer.command import run

    hf = hf_dir_with(tmp_path, b"")
    code, err = exit_of(run, icfg(hf_dir=str(hf), prompt="hello"))
    assert_user_error(code, err, "hf_dir", repr(str(hf)), "git lfs pull", "empty or cut short")


# ------------------------------------------------------------------------------------------ damaged data
@pytest.mark.parametrize("damage", ["truncated shard", "missing shard", "corrupt meta.json"])
def test_damaged_prepared_data_is_named_at_start_up(tmp_path, prepared, damage):
    data = tmp_path / "data"
    shutil.copytree(prepared["sample"], data)
    shard = next((data / "train").glob("*.arrow"))
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    elif damage == "missing shard":
        shard.unlink()
    else:
        (data / "meta.json").write_text('{"seq_len": 32, "tokenizer": ')
    code, err = run_train(tmp_path / "run", "data=prepared", f"data.path={data}")
    assert_user_error(code, err, "data.path", repr(str(data)), "prepare it again")
    assert "meta tensor" not in err and not (tmp_path / "run" / "metrics.csv").exists()


# ------------------------------------------------------------------------------------------ setup failures
@pytest.mark.parametrize("failure", [UserError("model.init_from_hf", "/x", "point elsewhere", "is wrong"),
                                     RuntimeError("parallelize failed here")], ids=["user error", "bug"])
def test_an_error_while_the_model_is_on_the_meta_device_reaches_the_user_as_itself(tmp_path, monkeypatch,
                                                                                   failure):
    """Lightning's teardown used to move the meta model to the CPU, and "Cannot copy out of meta tensor"
    hid the real error behind two chained tracebacks."""
    from moe.backends.base import Backend

    def parallelize(self, module):
        raise failure

    monkeypatch.setattr(Backend, "parallelize", parallelize)
    if isinstance(failure, UserError):
        code, err = run_train(tmp_path / "run")
        assert_user_error(code, err, "model.init_from_hf", "'/x'", "point elsewhere", "is wrong")
        return
    with pytest.raises(RuntimeError, match="parallelize failed here") as raised:
        train(compose_train(), tmp_path / "run")
    assert "meta tensor" not in repr(raised.value.__context__)


def test_an_error_in_the_datamodules_setup_is_not_hidden_by_the_teardown(tmp_path, monkeypatch):
    from moe.data.datamodule import MoEDataModule

    def setup(self, stage=None):
        raise UserError("data.path", "x", "prepare it", "failed in setup")

    monkeypatch.setattr(MoEDataModule, "setup", setup)
    code, err = run_train(tmp_path / "run")
    assert_user_error(code, err, "data.path", "'x'", "prepare it", "failed in setup")
    assert "meta tensor" not in err


# ------------------------------------------------------------------------------------------ infer, data_prep
def icfg(**kw):
    from moe.config.infer import InferConfig

    return OmegaConf.merge(OmegaConf.structured(InferConfig), kw)


def test_infer_prompts_file_with_a_prompt_that_is_not_text(tmp_path):
    from moe.infer.command import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 123}\n')
    code, err = exit_of(run, icfg(ckpt=str(tmp_path / "never-loaded.ckpt"), prompts_file=str(prompts)))
    assert_user_error(code, err, "prompts_file", repr(str(prompts)), "non-empty string", "on line 2")


def test_infer_output_file_that_is_a_directory_is_refused_before_generating(tmp_path):
    from moe.infer.command import run

    code, err = exit_of(run, icfg(ckpt=str(tmp_path / "never-loaded.ckpt"), prompt="hi",
                                  output_file=str(tmp_path)))
    assert_user_error(code, err, "output_file", repr(str(tmp_path)), "name a file", "is a directory")


def test_infer_seed_numpy_would_refuse(tmp_path):
    from moe.infer.command import run

    code, err = exit_of(run, icfg(ckpt="last", prompt="hi", seed=-1))
    assert_user_error(code, err, "seed", "-1", "from 0 to 4294967295", "is not a seed numpy accepts")


@pytest.mark.parametrize("override, field, value, fix", [
    ({"seed": -1}, "seed", "-1", "from 0 to 4294967295"),
    ({"vocab_size": 100, "tokenizer": None}, "vocab_size", "100", "more than 256"),
], ids=["data_prep seed=-1", "data_prep vocab_size=100"])
def test_data_prep_values_checked_before_reading_input(tmp_path, override, field, value, fix):
    from moe.data import prepare

    cfg = {"input": str(tmp_path / "never-read.txt"), "output": str(tmp_path / "out"),
           "tokenizer": str(REPO / "data" / "sample"), **override}
    code, err = exit_of(prepare, cfg)
    assert_user_error(code, err, field, value, fix)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ the table
DOC = REPO / "docs" / "FAULT_TOLERANCE.md"
SUCCEEDS = {"test_dry_run_prints_the_plan_and_writes_nothing"}  # exit 0, and still nothing written


def matrix_table() -> str:
    """The matrix as docs/FAULT_TOLERANCE.md shows it (`python tests/test_bad_inputs.py` prints it)."""
    rows = [(f"`{' '.join(o)}`", 2, f"`{field}={value}` {problem or '...'} ... Fix: {fix or '...'}")
            for o, field, value, problem, fix in CONFIG_CASES]
    rows += [(f"`{' '.join(o)}`", 2, f"`{field}={value}` ... Fix: {fix} ...") for o, field, value, fix in
             ENVIRONMENT_CASES]
    rows += [(f"`python train.py {o}`", 2, "; ".join(f"`{n}`" for n in needles)) for o, needles in CLI_CASES]
    functions = [name for name in globals() if name.startswith("test_") and name not in
                 ("test_bad_config", "test_what_the_machine_lacks",
                  "test_bad_command_line_exits_2_before_the_run_dir_exists",
                  "test_the_doc_lists_every_case_of_the_matrix")]
    rows += [(name[len("test_"):].replace("_", " "), 0 if name in SUCCEEDS else 2, f"see `{name}`")
             for name in functions]
    lines = ["| # | bad input | exit | what the message says (asserted) |", "|---|---|---|---|"]
    lines += [f"| {i} | {what} | {code} | {says.replace('|', '/')} |"
              for i, (what, code, says) in enumerate(rows, 1)]
    return "\n".join(lines) + "\n"


def test_the_doc_lists_every_case_of_the_matrix():
    table = matrix_table()
    assert table.count("\n") - 2 >= 90
    assert table in DOC.read_text(), "docs/FAULT_TOLERANCE.md is stale: paste python tests/test_bad_inputs.py"


if __name__ == "__main__":
    print(matrix_table(), end="")

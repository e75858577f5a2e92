"""Which code reads each config key: every key is implemented, a documented no-op, or refused.

tests/config/test_registry.py walks the schema against this table: a `Reads` key must be read
in each module named, a `NoOp` key must say "No-op" in its docstring and be read nowhere, and a
`Refused` key must fail validation at `example`, naming its feature. A new key needs a row here.
"""

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Reads:
    """Implemented: read by these modules (paths from the repository root)."""

    modules: tuple[str, ...]
    # Wired by a branch developed in parallel; the test expects the read to be missing until
    # that branch lands, and then fails until this flag is removed.
    pending: bool = False


@dataclass(frozen=True)
class NoOp:
    """A gpt-neox key with no meaning in neox: accepted, documented as a no-op, read nowhere."""


@dataclass(frozen=True)
class Refused:
    """A feature neox does not implement: `example` asks for it and validation must refuse it."""

    feature: str
    example: Any


Status = Union[Reads, NoOp, Refused]


def _reads(*modules: str, pending: bool = False) -> Reads:
    return Reads(tuple(modules), pending)


MODEL = "neox/model/"
PAR = "neox/parallel/"
LAUNCH = "neox/launcher/plan.py"
DERIVED = "neox/config/derived.py"
DS = "neox/config/ds_config.py"
SETUP = "neox/training/setup.py"
MEMORY = "neox/plan/memory.py"  # the estimate assumes what these keys make a run allocate
LOOP = "neox/training/loop.py"
CKPT = "neox/checkpoint/io.py"
METRICS = "neox/training/metrics.py"
GENERATE = "neox/inference/modes.py"
EVALUATION = "neox/inference/evaluation.py"
LM_EVAL = "neox/inference/lm_eval_adapter.py"
PREFLIGHT = "neox/plan/preflight.py"

KEYS: dict[str, Status] = {
    # model
    "num_layers": _reads(MODEL + "init.py", PAR + "topology.py"),
    "hidden_size": _reads(MODEL + "gpt.py", MODEL + "attention.py"),
    "num_attention_heads": _reads(MODEL + "attention.py"),
    "num_kv_heads": _reads(DERIVED),
    "intermediate_size": _reads(DERIVED),
    "mlp_multiple_of": _reads(DERIVED),
    "expansion_factor": _reads(DERIVED),
    "seq_length": _reads(SETUP),
    "max_position_embeddings": _reads(DERIVED),
    "sliding_window_width": _reads("neox/plan/attention_path.py"),
    "norm": _reads(MODEL + "norms.py"),
    "layernorm_epsilon": _reads(MODEL + "norms.py"),
    "rms_norm_epsilon": _reads(MODEL + "norms.py"),
    "scalenorm_epsilon": _reads(MODEL + "norms.py"),
    "use_bias_in_norms": _reads(MODEL + "norms.py"),
    "use_qk_layernorm": _reads(MODEL + "attention.py"),
    "pos_emb": _reads(MODEL + "gpt.py", MODEL + "attention.py"),
    "rotary_pct": _reads(DERIVED),
    "rotary_emb_base": _reads(MODEL + "attention.py"),
    "rotary_save_freqs_buffer": NoOp(),
    "no_weight_tying": _reads(MODEL + "gpt.py"),
    "gpt_j_residual": _reads(MODEL + "block.py"),
    "gpt_j_tied": _reads(MODEL + "block.py"),
    "activation": _reads(MODEL + "mlp.py"),
    "use_bias_in_attn_linear": _reads(MODEL + "attention.py"),
    "use_bias_in_mlp": _reads(MODEL + "mlp.py"),
    "hidden_dropout": _reads(MODEL + "block.py"),
    "attention_dropout": _reads(MODEL + "attention.py"),
    "init_method": _reads(MODEL + "init.py"),
    "output_layer_init_method": _reads(MODEL + "init.py"),
    "init_method_std": _reads(MODEL + "init.py"),
    "attention_config": _reads(DERIVED),
    "attention_impl": _reads("neox/plan/attention_path.py"),
    "scaled_upper_triang_masked_softmax_fusion": _reads("neox/plan/attention_path.py"),
    "scaled_masked_softmax_fusion": _reads("neox/plan/attention_path.py"),
    "attention_softmax_in_fp32": _reads(MODEL + "attention.py"),
    "apply_query_key_layer_scaling": NoOp(),
    "bias_gelu_fusion": _reads(MODEL + "mlp.py"),
    "bias_dropout_fusion": NoOp(),
    "rope_fusion": NoOp(),
    "layernorm_fusion": NoOp(),
    "rmsnorm_fusion": NoOp(),
    "make_vocab_size_divisible_by": _reads(DERIVED),
    "output_layer_parallelism": _reads(PAR + "tensor.py"),
    "use_cpu_initialization": NoOp(),
    "fp16_lm_cross_entropy": Refused("cross-entropy in fp16 is not implemented", True),
    "lm_loss_chunk_size": _reads(MODEL + "gpt.py", DERIVED, MEMORY),
    "opt_pos_emb_offset": _reads(MODEL + "gpt.py"),
    "fused_kernels_build_path": NoOp(),
    # parallel
    "model_parallel_size": _reads(DERIVED),
    "pipe_parallel_size": _reads("neox/config/parallel.py"),
    "pipe_partition_method": _reads(SETUP),
    "sequence_parallel": Refused("sequence_parallel is not implemented", True),
    "distributed_backend": _reads(SETUP),
    # optimizer
    "optimizer": _reads(DERIVED, SETUP),
    "weight_decay": _reads("neox/training/optim.py"),
    "lr_decay_style": _reads(SETUP),
    "lr_decay_iters": _reads(DERIVED),
    "lr_decay_fraction": _reads(DERIVED),
    "min_lr": _reads(SETUP),
    "warmup": _reads(DERIVED),
    "override_lr_scheduler": NoOp(),
    "use_checkpoint_lr_scheduler": Refused("use_checkpoint_lr_scheduler is not implemented", True),
    "optimizer_type": _reads(DERIVED),
    "lr": _reads(DERIVED),
    # precision
    "fp16": _reads(DERIVED, DS),
    "bf16": _reads(DERIVED, DS),
    "precision": _reads(DERIVED),
    "amp": _reads(DS),
    "fp32_allreduce": _reads(DS),
    "communication_data_type": _reads(DS),
    "dynamic_loss_scale": _reads(DS),
    "loss_scale": _reads(DS),
    "loss_scale_window": _reads(DS),
    "hysteresis": _reads(DS),
    "min_scale": _reads(DS),
    # tokenizer
    "tokenizer_type": _reads(SETUP, PREFLIGHT),
    "vocab_file": _reads(SETUP, PREFLIGHT),
    "merge_file": _reads(SETUP, PREFLIGHT),
    "padded_vocab_size": _reads(DERIVED),
    # data
    "data_path": _reads(SETUP, PREFLIGHT),
    "train_data_paths": _reads(SETUP),
    "valid_data_paths": _reads(SETUP),
    "test_data_paths": _reads(SETUP),
    "train_data_weights": _reads(SETUP),
    "valid_data_weights": _reads(SETUP),
    "test_data_weights": _reads(SETUP),
    "weight_by_num_documents": _reads(SETUP),
    "weighted_sampler_alpha": _reads(SETUP),
    "split": _reads(SETUP),
    "data_impl": Refused("only the mmap .bin/.idx format", "cached"),
    "dataset_impl": Refused("pairwise/reward/online datasets", "pairwise"),
    "pack_impl": Refused("unpacked samples", "unpacked"),
    "allow_chopped": NoOp(),
    "eod_mask_loss": _reads(LOOP),
    "reset_position_ids": _reads(LOOP),
    "reset_attention_mask": _reads(LOOP),
    "num_workers": _reads(SETUP),
    "data_cache_dir": _reads(SETUP),
    "mmap_warmup": NoOp(),
    "use_shared_fs": _reads(SETUP),
    "short_seq_prob": NoOp(),
    # training
    "train_micro_batch_size_per_gpu": _reads(DERIVED),
    "gradient_accumulation_steps": _reads(DERIVED),
    "train_batch_size": _reads(DERIVED),
    "batch_size": _reads(DERIVED),
    "train_iters": _reads(LOOP, DERIVED),
    "train_epochs": Refused("train_epochs is not implemented", 2),
    "seed": _reads(SETUP),
    "eval_interval": _reads(LOOP),
    "eval_iters": _reads(LOOP),
    "exit_interval": _reads(LOOP),
    "do_train": _reads(LOOP),
    "do_valid": _reads(LOOP),
    "do_test": _reads(LOOP),
    "gradient_clipping": _reads(DS),
    "clip_grad": _reads(DS),
    "checkpoint_activations": _reads(SETUP),
    "checkpoint_num_layers": _reads(SETUP, DS),
    "partition_activations": _reads(DS),
    "contiguous_checkpointing": _reads(DS),
    "checkpoint_in_cpu": _reads(DS),
    "synchronize_each_layer": _reads(DS),
    "profile_backward": _reads(DS),
    "deepspeed_activation_checkpointing": Refused("without DeepSpeed", False),
    "finetune": _reads(CKPT),
    "char_level_ppl": Refused("character-level perplexity", True),
    "iteration": _reads("neox/inference/loading.py", EVALUATION),
    "z_loss": Refused("z-loss auxiliary term is not implemented", 0.1),
    "torch_compile": _reads(SETUP, MEMORY),
    "flat_engine": _reads("neox/plan/engine_choice.py"),
    "torch_compile_backend": _reads(SETUP),
    # checkpoint
    "save": _reads(CKPT),
    "load": _reads(CKPT, PREFLIGHT),
    "checkpoint_factor": _reads(CKPT),
    "checkpoint_scale": _reads(CKPT),
    "extra_save_iters": _reads(CKPT),
    "keep_last_n_checkpoints": _reads(CKPT),
    "no_save_optim": Refused("no_save_optim is not implemented", True),
    "no_save_rng": _reads(CKPT),
    "no_load_optim": _reads(CKPT),
    "no_load_rng": _reads(CKPT),
    "checkpoint_validation_with_forward_pass": Refused("checkpoint validation", True),
    "save_iters": NoOp(),
    # logging
    "log_dir": _reads(LOOP),
    "tensorboard_dir": _reads(LOOP),
    "log_interval": _reads(LOOP),
    "steps_per_print": _reads(DS),
    "wall_clock_breakdown": _reads(DS),
    "log_grad_norm": _reads(LOOP),
    "max_nonfinite_steps": _reads(LOOP),
    "log_param_norm": Refused("log_param_norm is not implemented", True),
    "log_grad_pct_zeros": Refused("log_grad_pct_zeros is not implemented", True),
    "log_optimizer_states": Refused("log_optimizer_states is not implemented", True),
    "git_hash": _reads("deepy.py"),
    "memory_profiling": Refused("CUDA memory snapshots", True),
    "memory_profiling_path": NoOp(),
    "profile": _reads("neox/training/profiling.py"),
    "profile_step_start": _reads("neox/training/profiling.py"),
    "profile_step_stop": _reads("neox/training/profiling.py"),
    "peak_theoretical_tflops": _reads(METRICS),
    "use_wandb": _reads(LOOP),
    "wandb_project": _reads("neox/training/progress.py"),
    "wandb_group": _reads("neox/training/progress.py"),
    "wandb_team": _reads("neox/training/progress.py"),
    "wandb_host": _reads("neox/training/progress.py"),
    "wandb_init_all_ranks": _reads(LOOP),
    "wandb_run_name": _reads("neox/training/progress.py"),
    # launcher
    "hostfile": _reads(LAUNCH),
    "include": _reads(LAUNCH),
    "exclude": _reads(LAUNCH),
    "num_nodes": _reads(LAUNCH),
    "num_gpus": _reads(LAUNCH),
    "master_addr": _reads(LAUNCH),
    "master_port": _reads(LAUNCH, SETUP),
    "launcher": _reads(LAUNCH),
    "force_multi": _reads(LAUNCH),
    "no_ssh_check": _reads(LAUNCH),
    "ssh_port": _reads(LAUNCH),
    "detect_nvlink_pairs": NoOp(),
    "comment": _reads(LAUNCH),
    "account": _reads(LAUNCH),
    "deepspeed_mpi": _reads("neox/launcher/rank_env.py"),
    "deepspeed_slurm": _reads("neox/launcher/rank_env.py"),
    "export_env": _reads(LAUNCH),
    # generation (generate.py, eval.py)
    "text_gen_type": _reads(GENERATE),
    "temperature": _reads(GENERATE),
    "top_p": _reads(GENERATE),
    "top_k": _reads(GENERATE),
    "return_logits": _reads(GENERATE),
    "maximum_tokens": _reads(GENERATE),
    "prompt_end": _reads(GENERATE),
    "sample_input_file": _reads(GENERATE),
    "sample_output_file": _reads(GENERATE),
    "num_samples": _reads(GENERATE),
    "recompute": _reads(GENERATE),
    "eval_results_prefix": _reads(EVALUATION),
    "eval_tasks": _reads(EVALUATION, LM_EVAL),
    "eval_split": _reads(EVALUATION),
    "eval_input_file": _reads(EVALUATION),
    "eval_text_key": _reads(EVALUATION),
    "eval_stride": _reads(EVALUATION),
    "eval_lambada_file": _reads(EVALUATION),
    "eval_limit": _reads(EVALUATION, LM_EVAL),
    "eval_batch_size": _reads(EVALUATION, LM_EVAL),
    "eval_include_path": _reads(LM_EVAL),
    "eval_num_fewshot": _reads(LM_EVAL),
    # deepspeed
    "zero_optimization": _reads(DS, DERIVED),
    "zero_stage": _reads(DERIVED),
    "zero_reduce_scatter": _reads(DS),
    "zero_contiguous_gradients": _reads(DS),
    "zero_reduce_bucket_size": _reads(DS),
    "zero_allgather_bucket_size": _reads(DS),
    "activation_checkpointing": _reads(DS),
    "flops_profiler": _reads(DS),
    "comms_logger": _reads(DS),
    "autotuning": _reads(DS),
    "elasticity": _reads(DS),
    "csv_monitor": _reads(DS),
    "checkpoint": _reads(DS),
    "data_types": _reads(DS),
    "prescale_gradients": _reads(DS),
    "gradient_predivide_factor": _reads(DS),
    "sparse_gradients": Refused("DeepSpeed no longer", True),
    "dump_state": _reads(DS),
    "deepspeed": Refused("training without DeepSpeed", False),
    "deepspeed_extra_args": _reads(DS),
}

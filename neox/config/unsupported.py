"""gpt-neox keys of features neox does not implement, so a config using them fails by name."""

# key or key prefix -> the feature it belongs to
UNSUPPORTED_KEYS: dict[str, str] = {
    "moe_": "Mixture-of-Experts (MoE)",
    "mamba_": "Mamba layers",
    "dim_att": "RWKV",
    "head_size": "RWKV",
    "ffn_dim": "RWKV",
    "use_mup": "muP",
    "mup_": "muP",
    "coord_check": "muP",
    "save_base_shapes": "muP",
    "base_shapes_file": "muP",
    "use_comet": "Comet logging",
    "comet_": "Comet logging",
    "s3_path": "S3 checkpoint upload",
    "s3_chunk_size": "S3 checkpoint upload",
    "train_impl": "DPO/KTO/reward-model training",
    "dpo_": "DPO training",
    "kto_": "KTO training",
    "pos_train_": "DPO/KTO pairwise data",
    "neg_train_": "DPO/KTO pairwise data",
    "pos_valid_": "DPO/KTO pairwise data",
    "neg_valid_": "DPO/KTO pairwise data",
    "pos_test_": "DPO/KTO pairwise data",
    "neg_test_": "DPO/KTO pairwise data",
    "train_label_data_paths": "label data (DPO/RM)",
    "valid_label_data_paths": "label data (DPO/RM)",
    "test_label_data_paths": "label data (DPO/RM)",
    "train_reward_data_paths": "reward-model data",
    "valid_reward_data_paths": "reward-model data",
    "test_reward_data_paths": "reward-model data",
    "soft_prompt_tuning": "soft prompt tuning",
    "sparsity_config": "sparse attention",
    "sparse_attention": "sparse attention",
    "gmlp_attn_dim": "gMLP",
    "num_unique_layers": "layer sharing",
    "param_sharing_style": "layer sharing",
    "use_bnb_optimizer": "bitsandbytes optimizers",
    "te_": "Transformer Engine",
    "use_flashattn_swiglu": "flash-attn fused SwiGLU",
    "rpe_num_buckets": "relative position buckets (T5 RPE)",
    "rpe_max_distance": "relative position buckets (T5 RPE)",
    "curriculum_learning": "curriculum learning",
    "curriculum_seqlen": "curriculum learning",
    "data_efficiency": "DeepSpeed data efficiency",
    "compression_training": "DeepSpeed compression training",
    "precompute_model_name": "reward precomputation",
    "adlr_autoresume": "ADLR autoresume",
    "adlr_autoresume_interval": "ADLR autoresume",
    "expansion_factor_mamba": "Mamba layers",
    "onnx_safe": "ONNX export",
    "lazy_mpu_init": "lazy model-parallel init",
    "deepscale": "DeepScale",
    "deepscale_config": "DeepScale",
}

# gpt-neox runtime keys that launchers fill in and that neox recomputes; harmless in a config.
RUNTIME_KEYS = {
    "local_rank",
    "rank",
    "world_size",
    "global_num_gpus",
    "user_script",
    "config_files",
    "is_pipe_parallel",
    "autotuning_run",
    "label_data_paths",
}


def unsupported_feature(key: str) -> str | None:
    """The feature a gpt-neox key belongs to when neox does not implement it, else None."""
    if key in UNSUPPORTED_KEYS:
        return UNSUPPORTED_KEYS[key]
    for prefix, feature in UNSUPPORTED_KEYS.items():
        if prefix.endswith("_") and key.startswith(prefix):
            return feature
    return None


def is_inert(value: object) -> bool:
    """A value that leaves a feature off (false, 0, empty, None, 'normal' training)."""
    return value in (None, False, 0, "", [], {}, "normal", "none")

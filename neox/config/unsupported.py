"""gpt-neox keys of features neox does not implement, so a config using them fails by name."""

# key or key prefix -> the feature it belongs to
UNSUPPORTED_KEYS: dict[str, str] = {
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
    "soft_prompt_tuning": "soft prompt tuning",
    "sparsity_config": "sparse attention",
    "sparse_attention": "sparse attention",
    "gmlp_attn_dim": "gMLP",
    "num_unique_layers": "layer sharing",
    "param_sharing_style": "layer sharing",
    "use_bnb_optimizer": "bitsandbytes optimizers",
    "te_": "Transformer Engine",  # the te_* keys neox maps or refuses are fields (neox/config/float8.py)
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
    "serve_model_weights": "online RL weight serving",
    "weight_server_port": "online RL weight serving",
    "online_dataserver_ips": "online RL data server",
    "online_dataserver_ports": "online RL data server",
    "fp32_reinforce": "REINFORCE training",
    "kl_impl": "REINFORCE training",
    "kl_div_beta": "REINFORCE training",
    "reinforce_leave_one_out": "REINFORCE training",
    "log_gradient_noise_scale": "gradient noise scale logging",
    "gradient_noise_scale_": "gradient noise scale logging",
}

# gpt-neox's defaults for feature keys whose "off" value is not falsy: a config that writes them
# out (as gpt-neox's own files and saved args do) asks for nothing and is accepted.
FEATURE_OFF_DEFAULTS: dict[str, object] = {
    "rpe_num_buckets": 32,
    "rpe_max_distance": 128,
    "param_sharing_style": "grouped",
    "gmlp_attn_dim": 64,
    "mamba_selective_fp32_params": True,
    "mamba_use_bias_in_conv": True,
    "adlr_autoresume_interval": 1000,
    "s3_chunk_size": 104857600,
    "mup_init_scale": 1.0,
    "mup_attn_temp": 1.0,
    "mup_output_temp": 1.0,
    "mup_embedding_mult": 1.0,
    "mup_rp_embedding_mult": 1.0,
    "mup_width_scale": 2,
    "weight_server_port": 6000,
    "online_dataserver_ips": "localhost",
    "online_dataserver_ports": 10000,
    "fp32_reinforce": True,
    "kl_impl": "mse",
    "kl_div_beta": 0.1,
    "gradient_noise_scale_n_batches": 5,
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
    # deepspeed_args.py slots for objects gpt-neox builds at run time
    "scheduler",
    "tensorboard",
    "wandb",
}


def unsupported_feature(key: str) -> str | None:
    """The feature a gpt-neox key belongs to when neox does not implement it, else None."""
    if key in UNSUPPORTED_KEYS:
        return UNSUPPORTED_KEYS[key]
    for prefix, feature in UNSUPPORTED_KEYS.items():
        if prefix.endswith("_") and key.startswith(prefix):
            return feature
    return None


def is_inert(key: str, value: object) -> bool:
    """A value that leaves a feature off: falsy, 'normal' training, or gpt-neox's own default."""
    if value in (None, False, 0, "", [], {}, "normal", "none"):
        return True
    return key in FEATURE_OFF_DEFAULTS and value == FEATURE_OFF_DEFAULTS[key]

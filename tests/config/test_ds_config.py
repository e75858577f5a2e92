from neox.config import build_ds_config, derive, load_dict


def build(flat, world=1):
    cfg = load_dict(flat)
    return build_ds_config(cfg, derive(cfg, world))


def test_batch_and_clipping_reach_deepspeed():
    ds = build(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "gradient_clipping": 0.5,
        },
        world=2,
    )
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (2, 4, 16)
    assert ds["gradient_clipping"] == 0.5
    assert "optimizer" not in ds and "scheduler" not in ds  # neox builds both itself


def test_zero_shorthands_and_gpt_neox_cpu_offload():
    ds = build({"zero_stage": 2, "zero_optimization": {"overlap_comm": True, "cpu_offload": True}})
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] is True
    assert zero["offload_optimizer"] == {"device": "cpu"} and "cpu_offload" not in zero


def test_one_data_parallel_rank_drops_gradient_copies_that_serve_communication():
    flat = {"zero_optimization": {"stage": 1, "overlap_comm": True, "contiguous_gradients": True}}
    one = build(flat, world=1)["zero_optimization"]
    assert one["overlap_comm"] is False and one["contiguous_gradients"] is False
    two = build(flat, world=2)["zero_optimization"]
    assert two["overlap_comm"] is True and two["contiguous_gradients"] is True


def test_fp16_section_drops_gpt_neox_duplicate_flag():
    ds = build(
        {"fp16": {"fp16": True, "enabled": True, "loss_scale": 0, "initial_scale_power": 12}}
    )
    assert ds["fp16"]["enabled"] is True and "fp16" not in ds["fp16"]
    assert ds["fp16"]["initial_scale_power"] == 12
    assert "bf16" not in ds


def test_passthrough_sections_and_extra_args():
    ds = build(
        {"flops_profiler": {"enabled": True}, "deepspeed_extra_args": {"memory_breakdown": True}}
    )
    assert ds["flops_profiler"] == {"enabled": True}
    assert ds["memory_breakdown"] is True


def test_activation_checkpointing_from_neox_keys():
    ds = build(
        {"checkpoint_activations": True, "partition_activations": True, "checkpoint_num_layers": 2}
    )
    ac = ds["activation_checkpointing"]
    assert ac["partition_activations"] is True and ac["number_checkpoints"] == 2


def test_zero3_gathers_whole_blocks_unless_the_config_says():
    zero = build({"zero_optimization": {"stage": 3}})["zero_optimization"]
    assert zero["leaf_module"] == {"classes": ["neox.model.block.Block"]}
    assert "memory_efficient_linear" not in zero  # DeepSpeed's default (on) stays
    own = build({"zero_optimization": {"stage": 3, "leaf_module": {"classes": []}}})
    assert own["zero_optimization"]["leaf_module"] == {"classes": []}
    below = build({"zero_optimization": {"stage": 2}})["zero_optimization"]
    assert "leaf_module" not in below


def test_zero3_under_deepcompile_keeps_deepspeeds_hooks():
    """DeepCompile fails at the first backward with leaf modules (docs/benchmarks.md)."""
    ds = build(
        {
            "zero_optimization": {"stage": 3},
            "deepspeed_extra_args": {"compile": {"deepcompile": True}},
        }
    )
    assert "leaf_module" not in ds["zero_optimization"] and ds["compile"]["deepcompile"] is True

"""The DeepSpeed config's activation_checkpointing section reaches deepspeed.checkpointing."""

from neox.config import derive, load_dict
from neox.config.ds_config import build_ds_config
from neox.parallel.activation_checkpointing import configure_checkpointing
from tests.port_helpers import free_port


def test_every_checkpointing_flag_reaches_deepspeed(monkeypatch):
    import torch.distributed as dist
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    ours = not dist.is_initialized()
    if ours:  # DeepSpeed logs from rank 0 only, so it wants a group
        env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        for key, value in {**env, "MASTER_PORT": str(free_port())}.items():
            monkeypatch.setenv(key, value)
        from neox.parallel.distributed import start_deepspeed_comm

        start_deepspeed_comm("gloo")

    cfg = load_dict(
        {
            "partition_activations": True,
            "contiguous_checkpointing": True,
            "checkpoint_in_cpu": True,
            "synchronize_each_layer": True,
            "profile_backward": True,
            "checkpoint_num_layers": 2,
        }
    )
    section = build_ds_config(cfg, derive(cfg, 1))["activation_checkpointing"]
    try:
        configure_checkpointing(None, options=section)
        assert ds_ckpt.PARTITION_ACTIVATIONS and ds_ckpt.CONTIGUOUS_CHECKPOINTING
        assert ds_ckpt.CPU_CHECKPOINT and ds_ckpt.SYNCHRONIZE and ds_ckpt.PROFILE_TIME
        assert ds_ckpt.num_layers == 2
        configure_checkpointing(None)  # DeepSpeed keeps these module-wide: back to defaults
        assert not ds_ckpt.PARTITION_ACTIVATIONS and not ds_ckpt.CPU_CHECKPOINT
    finally:
        if ours:
            dist.destroy_process_group()

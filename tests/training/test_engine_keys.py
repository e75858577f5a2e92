"""Every DeepSpeed key a config can set, and which engine runs it, observed on one gloo rank.

For each key whose registry row says neox/config/ds_config.py reads it, a config setting it is
built the way the ranks build it (setup.make_engine), stepped twice through Engine.train_batch,
and what the key does is looked at: the engine built, the dtype gradients are reduced in, the
log line or the profiler file written, the optimizer class. A new DeepSpeed key fails
`test_every_deepspeed_key_has_a_case` until it gets a row here (and a decision in
neox/plan/engine_choice.py).
"""

import logging

import pytest
import torch

from neox.config import derive, load_dict
from neox.config.errors import ConfigError
from neox.config.registry import KEYS, Reads
from neox.model import build_model
from neox.plan.engine_choice import engine_for
from tests.training.test_flat_engine import micro_batches, rank  # noqa: F401  (a fixture)

DS = "neox/config/ds_config.py"  # the keys whose declared reader builds the DeepSpeed config

BASE = dict(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    precision="bfloat16",
    train_micro_batch_size_per_gpu=2,
    gradient_accumulation_steps=1,
    steps_per_print=10**6,
)
VOCAB = 64
FP16 = {"precision": "fp16"}


def comm(dtype):
    def check(engine, **_):
        assert engine.comm_dtype == dtype

    return check


def clip(value):
    def check(engine, **_):
        assert engine.clip == value

    return check


def logged(text):
    def check(engine, caplog, capfd, **_):
        out = capfd.readouterr().out + caplog.text
        assert text in out, out[-2000:]

    return check


def file_written(engine, tmp_path, **_):
    assert (tmp_path / "profile.txt").is_file()
    assert "flops" in (tmp_path / "profile.txt").read_text().lower()


def optimizer_is(name):
    def check(engine, **_):
        assert type(engine.ds.basic_optimizer).__name__ == name

    return check


# key: (config overrides, "flat" / "deepspeed" / "refused", what to look at or None).
# Keys of DeepSpeed's fp16 loss scaler are looked at in fp16 (DeepSpeed's engine: the flat
# engine has no fp16); they are not in a bf16 run's DeepSpeed config at all.
CASES = {
    "fp16": (FP16, "deepspeed", None),
    "bf16": ({"bf16": {"enabled": True}}, "flat", None),
    "amp": ({"precision": "fp16", "amp": {"enabled": True}}, "refused", None),
    "fp32_allreduce": ({"fp32_allreduce": True}, "flat", comm(torch.float32)),
    "communication_data_type": ({"communication_data_type": "fp16"}, "flat", comm(torch.float16)),
    "dynamic_loss_scale": ({**FP16, "dynamic_loss_scale": True}, "deepspeed", None),
    "loss_scale": ({**FP16, "loss_scale": 128}, "deepspeed", None),
    "loss_scale_window": ({**FP16, "loss_scale_window": 10}, "deepspeed", None),
    "hysteresis": ({**FP16, "hysteresis": 3}, "deepspeed", None),
    "min_scale": ({**FP16, "min_scale": 2}, "deepspeed", None),
    "gradient_clipping": ({"gradient_clipping": 0.5}, "flat", clip(0.5)),
    "clip_grad": ({"clip_grad": 0.25}, "flat", clip(0.25)),
    # Activation checkpointing is applied to the model (neox/parallel), under either engine.
    "checkpoint_num_layers": ({"checkpoint_num_layers": 2}, "flat", None),
    "partition_activations": ({"partition_activations": True}, "flat", None),
    "contiguous_checkpointing": ({"contiguous_checkpointing": True}, "flat", None),
    "checkpoint_in_cpu": ({"checkpoint_in_cpu": True}, "flat", None),
    "synchronize_each_layer": ({"synchronize_each_layer": True}, "flat", None),
    "profile_backward": ({"profile_backward": True}, "flat", None),
    "activation_checkpointing": (
        {"activation_checkpointing": {"partition_activations": True}},
        "flat",
        None,
    ),
    "steps_per_print": ({"steps_per_print": 2}, "flat", logged("step=2, lr=")),
    "wall_clock_breakdown": (
        {"wall_clock_breakdown": True, "steps_per_print": 2},
        "flat",
        logged("time (ms) | fwd:"),
    ),
    "zero_optimization": (
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
        "deepspeed",
        optimizer_is("DeepSpeedCPUAdam"),
    ),
    "zero_reduce_scatter": ({"zero_reduce_scatter": False}, "flat", None),
    "zero_contiguous_gradients": ({"zero_contiguous_gradients": False}, "flat", None),
    "zero_reduce_bucket_size": ({"zero_reduce_bucket_size": 1000}, "flat", None),
    "zero_allgather_bucket_size": ({"zero_allgather_bucket_size": 1000}, "flat", None),
    "flops_profiler": (
        {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": "profile.txt"}},
        "deepspeed",
        file_written,
    ),
    "comms_logger": ({"comms_logger": {"enabled": True}}, "deepspeed", None),
    "autotuning": ({"autotuning": {"enabled": True}}, "refused", None),
    "elasticity": ({"elasticity": {"enabled": True}}, "refused", None),
    "csv_monitor": ({"csv_monitor": {"enabled": True, "output_path": "csv"}}, "deepspeed", None),
    "checkpoint": ({"checkpoint": {"tag_validation": "Warn"}}, "deepspeed", None),
    # DeepSpeed accumulates bf16 gradients in fp32 at ZeRO 1 (at ZeRO 0 it refuses the mix).
    "data_types": (
        {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
        "deepspeed",
        None,
    ),
    "prescale_gradients": ({"prescale_gradients": True}, "deepspeed", None),
    "gradient_predivide_factor": ({"gradient_predivide_factor": 2.0}, "deepspeed", None),
    "dump_state": ({"dump_state": True}, "deepspeed", None),
    "deepspeed_extra_args": (
        {"deepspeed_extra_args": {"memory_breakdown": True}},
        "deepspeed",
        None,
    ),
}
# The same keys at values the flat engine honours as DeepSpeed's engine would.
FLAT_TOO = {
    "data_types": ({"data_types": {"grad_accum_dtype": "bf16"}}, "flat", None),
    "zero_optimization": (
        {"zero_optimization": {"stage": 1, "reduce_bucket_size": 10, "overlap_comm": True}},
        "flat",
        None,
    ),
    "communication_data_type": ({"communication_data_type": "fp32"}, "flat", comm(torch.float32)),
}


def deepspeed_keys() -> set[str]:
    return {k for k, s in KEYS.items() if isinstance(s, Reads) and DS in s.modules}


def test_every_deepspeed_key_has_a_case():
    assert set(CASES) == deepspeed_keys()


def fp16_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


@pytest.mark.usefixtures("rank")
@pytest.mark.parametrize(
    "key,case",
    [pytest.param(k, c, id=k) for k, c in CASES.items()]
    + [pytest.param(k, c, id=f"{k}-flat") for k, c in FLAT_TOO.items()],
)
def test_which_engine_runs_each_deepspeed_key(key, case, tmp_path, caplog, capfd, monkeypatch):
    from neox.training.deepspeed_engine import DeepSpeedAdapter
    from neox.training.flat_engine import FlatEngine
    from neox.training.setup import make_engine

    overrides, expected, check = case
    monkeypatch.chdir(tmp_path)  # files the key makes DeepSpeed write land here
    cfg = load_dict({**BASE, **overrides})
    derived = derive(cfg, 1, VOCAB)
    if expected == "refused":
        with pytest.raises(ConfigError, match=key):
            engine_for(cfg, derived)
        return
    choice = engine_for(cfg, derived)
    assert choice.engine == expected, choice.reason
    assert (choice.reason is None) == (expected == "flat")
    if derived.precision == "fp16" and not fp16_here():
        pytest.skip("DeepSpeed refuses fp16 on this CPU (no mkldnn fp16): decided, not built")
    caplog.set_level(logging.DEBUG, logger="neox")
    model = build_model(cfg.model, VOCAB, seed=0)
    engine = make_engine(cfg, derived, model, None)
    assert isinstance(engine, FlatEngine if expected == "flat" else DeepSpeedAdapter)
    try:
        stream = micro_batches()
        steps = [engine.train_batch(stream) for _ in range(2)]
        assert all(torch.isfinite(torch.as_tensor(float(s.loss))) for s in steps)
        if check is not None:
            check(engine, tmp_path=tmp_path, caplog=caplog, capfd=capfd)
    finally:
        if isinstance(engine, DeepSpeedAdapter):
            engine.destroy()


def _reduce_in(index: int, world: int, port: int, out: str, overrides: dict) -> None:
    """Rank body: the flat engine over 2 gloo ranks, the dtype of every all-reduce recorded."""
    import json
    import os

    import torch.distributed as dist

    from neox.parallel.topology import ProcessGroups, Topology
    from neox.training.setup import make_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=world)
    cfg = load_dict({**BASE, **overrides})
    derived = derive(cfg, world, VOCAB)
    groups = ProcessGroups(Topology(1, 1, world))
    model = build_model(cfg.model, VOCAB, seed=0)
    engine = make_engine(cfg, derived, model, groups)
    seen = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(str(tensor.dtype))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording
    engine.train_batch(micro_batches(seed=index))
    dist.all_reduce = real
    weights = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if index == 0:
        same = all(torch.equal(gathered[0], w) for w in gathered)
        with open(out, "w") as f:
            json.dump({"dtypes": seen, "same_weights": same}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides,dtype",
    [({}, "torch.bfloat16"), ({"fp32_allreduce": True}, "torch.float32")],
)
def test_flat_engine_reduces_gradients_in_the_configured_dtype(tmp_path, overrides, dtype):
    """Two gloo ranks: the gradient buffer goes through the all-reduce in fp32 with
    fp32_allreduce, in bf16 without; the ranks end the step with the same weights."""
    import json

    import torch.multiprocessing as mp

    from tests.port_helpers import free_port

    out = tmp_path / "seen.json"
    mp.spawn(_reduce_in, args=(2, free_port(), str(out), overrides), nprocs=2, join=True)
    seen = json.loads(out.read_text())
    # The gradient buffers (one per group) in `dtype`; the fp32 norm after them.
    assert seen["dtypes"][:2] == [dtype, dtype] and seen["same_weights"]

"""Train a tiny GPTNeoX with label-masked batches under a parallel layout and an engine; record
the losses (run on gloo ranks by tests/training/test_masking.py).

Four samples per step with very uneven masks (2, 12, 0 and 7 trained tokens), spread over
micro-batches and data-parallel ranks so that each rank's micro-batches count differently.
"Poisoned" batches hold random targets wherever the mask is 0 and random inputs after each row's
last trained position: they must train exactly as the clean ones.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from neox.config.model import ModelConfig
from neox.data.batch import Batch, build_batch

VOCAB, SEQ, SEED, LR, STEPS = 128, 16, 1234, 0.5, 3
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ)
# Per sample, the target positions [a, b) that are trained (None: nothing).
TRAINED = [(3, 5), (1, 13), None, (4, 11)]
SAMPLES = len(TRAINED)

# name -> layout, engine, ZeRO stage; world = tp * pp * dp, 4 samples a step.
CASES = {
    "flat_dp2": dict(tp=1, pp=1, dp=2, engine="flat", zero=1),
    "zero1_dp2": dict(tp=1, pp=1, dp=2, engine="deepspeed", zero=1),
    "tp2": dict(tp=2, pp=1, dp=1, engine="deepspeed", zero=0),
    "pp2": dict(tp=1, pp=2, dp=1, engine="deepspeed", zero=1),
    # The count's all-reduce over the data-parallel group inside model-parallel layouts.
    "tp2_dp2": dict(tp=2, pp=1, dp=2, engine="deepspeed", zero=1),
    "pp2_dp2": dict(tp=1, pp=2, dp=2, engine="deepspeed", zero=1),
}


def global_batch(poisoned: bool) -> Batch:
    """The step's 4 samples, built from text and label windows as the loop builds them."""
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, VOCAB - 1, (SAMPLES, SEQ + 1), generator=g)
    label = torch.full_like(text, -100)
    for k, span in enumerate(TRAINED):
        if span is not None:
            a, b = span
            label[k, a + 1 : b + 1] = text[k, a + 1 : b + 1]  # aligned with text, not shifted
    batch = build_batch(text, VOCAB - 1, label=label)
    if poisoned:
        g = torch.Generator().manual_seed(99)
        noise = torch.randint(0, VOCAB, batch.labels.shape, generator=g)
        batch.labels = torch.where(batch.loss_mask == 0, noise, batch.labels)
        for k, span in enumerate(TRAINED):
            last = 0 if span is None else span[1]  # no trained prediction reads inputs from here
            batch.tokens[k, last:] = torch.randint(0, VOCAB, (SEQ - last,), generator=g)
    return batch


def rows(batch: Batch, index: list[int]) -> Batch:
    return Batch(
        batch.tokens[index], batch.labels[index], batch.loss_mask[index], batch.position_ids[index]
    )


def split(batch: Batch, dp_rank: int, dp: int, gas: int) -> list[Batch]:
    """This rank's micro-batches: micro-batch m of rank d holds samples m*dp*mb + d*mb + j."""
    mb = SAMPLES // dp // gas
    return [rows(batch, [m * dp * mb + dp_rank * mb + j for j in range(mb)]) for m in range(gas)]


def reference_losses(poisoned: bool = False, per_micro_batch_of: int = 0) -> list[float]:
    """Dense single process, SGD on the mean over every trained token of the step; with
    per_micro_batch_of=n, the biased mean of per-micro-batch means over n micro-batches."""
    from neox.model import build_model, lm_loss

    net = build_model(ModelConfig(**MODEL), VOCAB, seed=SEED)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    b = global_batch(poisoned)
    losses = []
    for _ in range(STEPS):
        if per_micro_batch_of:
            parts = zip(*(t.chunk(per_micro_batch_of) for t in (b.tokens, b.labels, b.loss_mask)))
            loss = torch.stack([lm_loss(net(t), y, m) for t, y, m in parts]).mean()
        else:
            loss = lm_loss(net(b.tokens), b.labels, b.loss_mask)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _engine(case: dict, groups):
    from neox.parallel.build import engine_mpu, parallelize
    from neox.training.deepspeed_engine import DeepSpeedAdapter
    from neox.training.flat_engine import FlatEngine, FlatSettings

    gas = 2
    ds_config = {
        "train_batch_size": SAMPLES,
        "train_micro_batch_size_per_gpu": SAMPLES // case["dp"] // gas,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": case["zero"]},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    model = parallelize(ModelConfig(**MODEL), VOCAB, groups, SEED)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    mpu = engine_mpu(model, groups)
    if case["engine"] == "flat":
        settings = FlatSettings(
            ds_config["train_micro_batch_size_per_gpu"], gas, zero_stage=case["zero"]
        )
        return FlatEngine(settings, model, opt, mpu), gas
    return DeepSpeedAdapter(ds_config, model, opt, mpu), gas


def _run_case(case: dict, poisoned: bool) -> dict:
    from neox.parallel.topology import Topology

    groups = Topology(case["tp"], case["pp"], case["dp"]).build_groups()
    engine, gas = _engine(case, groups)
    mine = split(global_batch(poisoned), groups.get_data_parallel_rank(), case["dp"], gas)
    losses, trained = [], []
    for _ in range(STEPS):
        step = engine.train_batch(iter([Batch(**vars(b)) for b in mine]))
        loss = step.loss.detach().float().clone()
        dist.all_reduce(loss, group=groups.get_data_parallel_group())
        losses.append(loss.item() / case["dp"])
        trained.append(float(step.trained_tokens))
    return {"losses": losses, "trained_tokens": trained}


def run_cases(rank: int, world: int, names: list[str], out_dir: str) -> None:
    """Every rank runs every named case, clean and poisoned; rank 0 writes <out_dir>/<name>.json."""

    from neox.parallel.distributed import start_deepspeed_comm

    start_deepspeed_comm("gloo")
    for name in names:
        case = CASES[name]
        assert case["tp"] * case["pp"] * case["dp"] == world, name
        result = {kind: _run_case(case, kind == "poisoned") for kind in ("clean", "poisoned")}
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(result))

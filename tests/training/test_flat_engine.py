"""neox's flat engine on one rank against DeepSpeed's ZeRO-1 engine: same steps, checkpoints that
resume in either engine."""

import copy
import math

import pytest
import torch

from neox.checkpoint.io import save_plain_state
from neox.checkpoint.plain_state import PlainState
from neox.config.model import ModelConfig
from neox.data.batch import build_batch
from neox.model import build_model
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.flat_engine import FlatEngine, FlatSettings
from neox.training.optim import param_groups

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
    no_weight_tying=True,
)
VOCAB = 64
LR = 3e-3


def ds_config(precision="bf16", accum=1, clip=0.05, stage=1):
    cfg = {
        "train_batch_size": 2 * accum,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def flat_settings(precision="bf16", accum=1, clip=0.05, stage=1):
    """ds_config's run in the flat engine's own settings."""
    return FlatSettings(
        micro_batch=2, grad_accum=accum, clip=clip, bf16=precision == "bf16", zero_stage=stage
    )


def engine(kind, model, **cfg):
    """The flat engine ("own"), or DeepSpeed's own engine ("ds", from behind the adapter), as
    build_engine makes them: their DeepSpeed-style calls compared one for one."""
    built = built_engine(kind, model, **cfg)
    return built if kind == "own" else built.ds


def built_engine(kind, model, **cfg):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95))
    if kind == "own":
        return FlatEngine(flat_settings(**cfg), model, opt, None)
    return DeepSpeedAdapter(ds_config(**cfg), model, opt, None)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        text = torch.randint(0, VOCAB, (2, CFG.seq_length + 1), generator=g)
        yield text[:, :-1], text[:, 1:]


def train(eng, steps, accum=1, seed=0, lr=None):
    losses, norms = [], []
    device = next(eng.module.parameters()).device
    for i, (tokens, labels) in enumerate(batches(steps * accum, seed)):
        tokens, labels = tokens.to(device), labels.to(device)
        if lr is not None:
            for group in eng.optimizer.param_groups:
                group["lr"] = lr
        loss = eng(tokens, labels=labels)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            norms.append(float(eng.get_global_grad_norm()))
    return losses, norms


def weights(eng):
    return {k: v.float().cpu() for k, v in eng.module.state_dict().items()}


@pytest.fixture(scope="module")
def rank():
    """One rank as DeepSpeed's engine wants it: a process group (one for the module: DeepSpeed
    caches the groups it derives), DeepSpeed's comm started as neox starts it (else the first
    engine compiles DeepSpeed's shm all-reduce, a minute or more of C++) and its launcher's
    variables; all removed afterwards."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from neox.parallel.distributed import start_deepspeed_comm

    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
        start_deepspeed_comm("gloo")
        yield
        dist.destroy_process_group()
        groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = None


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, VOCAB, seed=3)


def zero_gradient_elements(model, micro_batches: int) -> dict[str, torch.Tensor]:
    """Per parameter, the elements whose gradient on `train`'s batches is zero in exact arithmetic
    (float64 leaves them at rounding noise, 1e-16 of the rest): the key bias outside the rotary
    dims, which adds the same q.b to every score of a query's row, a shift softmax ignores (and
    the embedding rows of tokens no batch holds)."""
    exact = copy.deepcopy(model).double()
    for tokens, labels in batches(micro_batches):
        exact(tokens, labels=labels).backward()
    grads = {name: p.grad.abs() for name, p in exact.named_parameters()}
    scale = max(g.max() for g in grads.values())
    return {name: g <= 1e-10 * scale for name, g in grads.items()}


def fp32_weight_atol(steps: int, lr: float, accum: int) -> float:
    """How far the engines' fp32 weights may drift apart: they sum in other orders (one norm over
    flat buffers, torch's fused AdamW against DeepSpeed's per-tensor steps). Adam divides each
    gradient by its own running magnitude, so an element's update is as exact as its gradient is
    relative to itself: n*u for a sum of n terms without cancellation (u = 2^-24), at most
    lr*n*u a step. n: the step's tokens plus each layer's widths the backward pass sums over
    (h, 3h, 4h, the T keys). 10x that bound for partial cancellation (an embedding row's few
    tokens reach half of it); elements whose gradient cancels to zero are compared apart."""
    u = 2.0**-24
    n = 2 * CFG.seq_length * accum + CFG.num_layers * (8 * CFG.hidden_size + CFG.seq_length)
    return 10 * steps * lr * n * u


@pytest.mark.parametrize(
    "precision,accum,clip",
    [("bf16", 1, 0.05), ("bf16", 2, 0.05), ("fp32", 1, 0.05), ("fp32", 2, 0.0)],
)
def test_steps_match_deepspeed_zero1(model, rank, precision, accum, clip):
    own = engine("own", model, precision=precision, accum=accum, clip=clip)
    ds = engine("ds", model, precision=precision, accum=accum, clip=clip)
    assert isinstance(own, FlatEngine) and not isinstance(ds, FlatEngine)
    steps = 6
    own_losses, own_norms = train(own, steps, accum)
    ds_losses, ds_norms = train(ds, steps, accum)
    # fp32: a norm sums ~3e4 squares in another order; rounding errors of random sign grow as
    # sqrt(N)*u = 1e-5 relative (u = 2^-24). The losses differ only through the weights.
    tol = dict(rel=1e-3) if precision == "bf16" else dict(rel=1e-5)
    assert own_losses == pytest.approx(ds_losses, **tol)
    assert own_norms == pytest.approx(ds_norms, **tol)
    if clip:
        assert max(own_norms) > clip  # clipping was active
    a, b = weights(own), weights(ds)
    if precision == "bf16":
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-2)
    else:
        # A zero gradient is rounding noise, which Adam scales up to steps of up to lr: each
        # engine moves those elements its own way (1e-5 apart after 6 steps, seen in CI), held
        # only to Adam's bound of lr a step.
        atol = fp32_weight_atol(steps, LR, accum)
        for name, zero in zero_gradient_elements(model, steps * accum).items():
            torch.testing.assert_close(a[name][~zero], b[name][~zero], atol=atol, rtol=0)
            assert torch.all((a[name][zero] - b[name][zero]).abs() <= steps * LR), name
    assert own.skipped_steps == ds.skipped_steps == 0


def test_a_non_finite_gradient_skips_the_step(model, rank):
    check_non_finite_skip(model)


def check_non_finite_skip(model):
    own = engine("own", model)
    train(own, 1)
    before = weights(own)
    state_before = {k: v["step"].clone() for k, v in own.optimizer.state.items()}
    tokens, labels = next(batches(1, seed=9))
    device = next(own.module.parameters()).device
    loss = own(tokens.to(device), labels=labels.to(device))
    own.backward(loss * float("nan"))
    own.step()
    assert own.skipped_steps == 1
    assert own.get_global_grad_norm() != own.get_global_grad_norm()  # NaN
    after = weights(own)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(state_before[k], own.optimizer.state[k]["step"]) for k in state_before)
    train(own, 1, seed=4)  # and the next finite step trains again
    assert not all(torch.equal(before[k], w) for k, w in weights(own).items())


@pytest.mark.parametrize("writer,reader", [("own", "own"), ("own", "ds"), ("ds", "own")])
def test_checkpoints_resume_across_engines(model, rank, tmp_path, writer, reader):
    """The state by plain name of either engine, written by neox's one writer, resumes in the
    other: the continued steps equal those of the writer going on uninterrupted (bit for bit
    when the same engine reads it back)."""
    first = built_engine(writer, model)
    train(getattr(first, "ds", first), 3, lr=3e-3)
    save_plain_state(first, tmp_path, {"iteration": 3})
    going_on, _ = train(getattr(first, "ds", first), 3, seed=1, lr=1e-3)

    second = built_engine(reader, build_model(CFG, VOCAB, seed=77))  # other weights until loaded
    state = PlainState(tmp_path)
    second.load_plain(state, load_optimizer_states=True)
    assert state.client_state == {"iteration": 3}
    second = getattr(second, "ds", second)
    assert second.global_steps == 3 and second.skipped_steps == 0
    resumed, _ = train(second, 3, seed=1, lr=1e-3)
    if writer == reader:
        assert resumed == going_on
        assert all(
            torch.equal(a, b)
            for a, b in zip(weights(getattr(first, "ds", first)).values(), weights(second).values())
        )
    else:
        assert resumed == pytest.approx(going_on, rel=1e-3)


def test_resumes_deepspeeds_zero1_files(model, rank, tmp_path):
    """A checkpoint in DeepSpeed's own ZeRO-1 files (DeepSpeed's engine writes it, as gpt-neox
    and neox before state/ did) resumes in the flat engine through Engine.load, with its
    counters, client state and optimizer moments: the next steps are DeepSpeed's own."""
    first = engine("ds", model)
    train(first, 3, lr=3e-3)
    first.save_checkpoint(str(tmp_path), tag="global_step3", client_state={"iteration": 3})
    (tmp_path / "latest").write_text("global_step3")
    going_on, _ = train(first, 3, seed=1, lr=1e-3)

    second = engine("own", build_model(CFG, VOCAB, seed=77))
    path, state = second.load(str(tmp_path), None, True, False)
    assert path is not None and state["iteration"] == 3
    assert second.global_steps == 3 and second.skipped_steps == 0
    assert all(s["exp_avg"].abs().sum() > 0 for s in second.optimizer.state.values())
    resumed, _ = train(second, 3, seed=1, lr=1e-3)
    assert resumed == pytest.approx(going_on, rel=1e-3)
    # Weights only (finetune): the module's weights, nothing of the run's counters or moments.
    third = engine("own", build_model(CFG, VOCAB, seed=77))
    third.load(str(tmp_path), "global_step3", True, True)
    assert third.global_steps == 0 and not third.optimizer.state
    loaded = {k: v.float() for k, v in weights(third).items()}
    saved = torch.load(tmp_path / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert all(torch.equal(loaded[k], v.float()) for k, v in saved["module"].items())


def test_consolidate_reads_its_checkpoint(model, rank, tmp_path):
    from neox.checkpoint.plain_state import plain_state_dict

    own = engine("own", model)
    train(own, 2)
    save_plain_state(own, tmp_path, {"iteration": 2})
    state = plain_state_dict(tmp_path)
    live = own.module.state_dict()
    assert state.keys() == live.keys()
    assert all(torch.equal(state[k].to(live[k].dtype), live[k]) for k in live)


def test_settings_are_those_deepspeed_reads_of_the_same_config():
    """FlatSettings.of reads neox's config as DeepSpeed's JSON, built from it, says: the alias
    clip_grad, fp32_allreduce, communication_data_type, overlap_comm and reduce_bucket_size (or
    the zero_reduce_bucket_size shorthand), deepspeed_extra_args last."""
    from neox.config import build_ds_config, derive, load_dict

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    base.update(max_position_embeddings=16, train_micro_batch_size_per_gpu=2)
    cases = [
        dict(gradient_accumulation_steps=2, clip_grad=0.3, zero_optimization={"stage": 1}),
        dict(bf16={"enabled": True}, fp32_allreduce=True, steps_per_print=7),
        dict(communication_data_type="bf16", precision="bfloat16", wall_clock_breakdown=True),
        dict(deepspeed_extra_args={"gradient_clipping": 0.25, "communication_data_type": "fp16"}),
        dict(zero_optimization={"stage": 1, "overlap_comm": True, "reduce_bucket_size": 10**4}),
        dict(zero_optimization={"stage": 0, "overlap_comm": True}, zero_reduce_bucket_size=99),
        dict(deepspeed_extra_args={"zero_optimization": {"stage": 1, "overlap_comm": True}}),
    ]
    for case in cases:
        cfg = load_dict({**base, **case})
        derived = derive(cfg, 2, 64)
        ds, settings = build_ds_config(cfg, derived), FlatSettings.of(cfg, derived)
        comm = ds.get("communication_data_type") or ("fp32" if ds.get("fp32_allreduce") else None)
        zero = ds["zero_optimization"]
        assert settings == FlatSettings(
            micro_batch=ds["train_micro_batch_size_per_gpu"],
            grad_accum=ds["gradient_accumulation_steps"],
            clip=ds["gradient_clipping"],
            bf16=bool(ds.get("bf16", {}).get("enabled")),
            zero_stage=zero["stage"],
            comm_dtype=comm,
            steps_per_print=ds["steps_per_print"],
            wall_clock_breakdown=ds["wall_clock_breakdown"],
            overlap_comm=zero.get("overlap_comm", False),
            reduce_bucket_size=zero.get("reduce_bucket_size", 500_000_000),
        ), case


def micro_batches(seed=0):
    """Batches as the loop hands them to Engine.train_batch (no EOD resets)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        text = torch.randint(0, VOCAB, (2, CFG.seq_length + 1), generator=g)
        yield build_batch(text, VOCAB - 1, False, False, False)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_train_batch_is_the_same_step_on_both_engines(model, rank, precision):
    """The loop's one call, Engine.train_batch, on either engine: same losses, norms, no
    skips, the metrics as tensors or numbers the loop reads later; eval_batch likewise."""
    own = built_engine("own", model, precision=precision, accum=2)
    ds = built_engine("ds", model, precision=precision, accum=2)
    assert isinstance(own, FlatEngine) and isinstance(ds, DeepSpeedAdapter)
    results = {}
    for name, eng in (("own", own), ("ds", ds)):
        stream = micro_batches()
        steps = [eng.train_batch(stream) for _ in range(3)]
        eng.eval()
        evals = float(eng.eval_batch(micro_batches(seed=5)))
        eng.train()
        results[name] = (
            [float(s.loss) for s in steps],
            [float(s.grad_norm) for s in steps],
            [bool(s.skipped) for s in steps],
            [s.loss_scale for s in steps],
            evals,
        )
    tol = dict(rel=1e-3) if precision == "bf16" else dict(rel=1e-5)
    (own_loss, own_norm, own_skip, own_scale, own_eval) = results["own"]
    (ds_loss, ds_norm, ds_skip, ds_scale, ds_eval) = results["ds"]
    assert own_loss == pytest.approx(ds_loss, **tol) and own_norm == pytest.approx(ds_norm, **tol)
    assert own_eval == pytest.approx(ds_eval, **tol)
    assert own_skip == ds_skip == [False] * 3
    assert own_scale == ds_scale == [None] * 3
    assert own.global_steps == ds.ds.global_steps == 3


@pytest.mark.parametrize("kind,stage", [("own", 1), ("ds", 0), ("ds", 1)])
def test_train_batch_reports_a_non_finite_step_as_skipped(model, rank, kind, stage):
    """Either engine drops a step with a NaN gradient and says so: the flat engine itself,
    DeepSpeed's ZeRO-1 through its (fused) overflow check, and DeepSpeed without ZeRO in fp32,
    where the adapter computes the norm and skips the step (DeepSpeed would apply the NaNs)."""
    eng = built_engine(kind, model, precision="fp32", stage=stage)
    stream = micro_batches()
    assert not bool(eng.train_batch(stream).skipped)
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    poisoned = next(stream)
    poisoned.loss_mask = poisoned.loss_mask * float("nan")
    step = eng.train_batch(iter([poisoned]))
    assert bool(step.skipped) and not math.isfinite(float(step.grad_norm))  # DeepSpeed: inf
    after = eng.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not bool(eng.train_batch(stream).skipped)  # and the next finite step trains again


def test_wall_clock_timers_reset_inside_a_running_step():
    """steps_per_print's report on a rank other than 0 resets the timers from inside the
    step's timer (wall_clock_breakdown: true), which must keep running."""
    from neox.training.flat_engine import STEP, _timers

    timers = _timers(True)
    with timers(STEP):
        timers.reset()
    assert not timers.timers(STEP).started_

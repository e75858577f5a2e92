"""The MoE MLP against a per-token, per-expert loop; router, capacity and auxiliary losses; the
compiled block: no graph break on the GPU path, the same values as eager."""

import copy

import pytest
import torch
import torch.nn.functional as F

from neox.config import ConfigError, load_dict
from neox.model import build_model
from neox.model import moe as moe_module
from neox.model.moe import MoE, moe_aux_loss, sinkhorn

BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}


def moe_layer(seed: int = 0, **keys) -> MoE:
    cfg = load_dict({**BASE, "moe_num_experts": 4, "moe_top_k": 2, **keys}).model
    model = build_model(cfg, 64, seed=seed)
    return model.layers[0].mlp


def reference(moe: MoE, x: torch.Tensor, capacity=None) -> torch.Tensor:
    """Each token through each chosen expert, one at a time (first choices before second ones
    for capacity)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _, _ = moe.router(tokens)
    ex, act = moe.experts, moe.experts.act
    out = torch.zeros_like(tokens)
    taken = [0] * moe.num_experts
    for choice in range(experts.shape[1]):
        for n in range(tokens.shape[0]):
            e = int(experts[n, choice])
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            up = ex.dense_h_to_4h[e] @ tokens[n]
            h = act(ex.gate[e] @ tokens[n]) * up if ex.gate is not None else act(up)
            out[n] += weights[n, choice] * (ex.dense_4h_to_h[e] @ h)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(tokens)
    return out.view(x.shape)


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Gradients equal to float32 rounding, relative to each one's scale (the input's are
    ~1e-4 at init, under any fixed atol)."""
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.detach().abs().max()), rtol=1e-4)


@pytest.mark.parametrize(
    "keys",
    [
        {"moe_router_type": "topk"},
        {"moe_router_type": "topk", "activation": "swiglu", "moe_norm_topk_prob": True},
        {"moe_router_type": "topk", "moe_score_func": "sigmoid", "moe_num_shared_experts": 2},
        {"moe_router_type": "sinkhorn", "moe_ffn_hidden_size": 24},
    ],
    ids=["topk", "swiglu-norm", "sigmoid-shared", "sinkhorn"],
)
def test_moe_matches_per_expert_loop(keys):
    moe = moe_layer(**keys).eval()
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = moe(x)
    want = reference(moe, x)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    # Gradients reach every expert weight the same way as through the loop.
    grads = torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])
    assert_grads_close(grads, torch.autograd.grad(want.square().sum(), [x, *moe.parameters()]))


def test_parameter_names_and_layout():
    """The names HF converters map: router, stacked (E, out, in) experts, shared experts; MoE
    every moe_expert_interval layers from layer 0."""
    cfg = load_dict(
        {
            **BASE,
            "num_layers": 3,
            "moe_num_experts": 4,
            "moe_expert_interval": 2,
            "moe_ffn_hidden_size": 24,
            "moe_num_shared_experts": 1,
            "activation": "swiglu",
            "use_bias_in_mlp": False,
        }
    ).model
    shapes = {n: tuple(p.shape) for n, p in build_model(cfg, 64).named_parameters()}
    assert shapes["layers.0.mlp.router.weight"] == (4, 32)
    assert shapes["layers.0.mlp.experts.dense_h_to_4h"] == (4, 24, 32)
    assert shapes["layers.0.mlp.experts.gate"] == (4, 24, 32)
    assert shapes["layers.0.mlp.experts.dense_4h_to_h"] == (4, 32, 24)
    assert shapes["layers.0.mlp.shared_experts.dense_4h_to_h.weight"] == (32, 24)
    assert "layers.1.mlp.dense_h_to_4h.weight" in shapes  # dense layer between MoE layers
    assert "layers.2.mlp.router.weight" in shapes


def test_experts_initialised_independently_of_each_other():
    """Expert e's initial weights are a function of its name and index alone."""
    a = moe_layer(seed=3).experts.dense_h_to_4h.detach()
    assert not torch.equal(a[0], a[1])
    b = moe_layer(seed=3, moe_num_experts=6).experts.dense_h_to_4h.detach()
    torch.testing.assert_close(a, b[:4])


def test_token_dropping_keeps_first_choices_up_to_capacity():
    moe = moe_layer(
        moe_type="deepspeed",
        moe_token_dropping=True,
        moe_eval_capacity_factor=0.5,
        moe_min_capacity=1,
    ).eval()
    x = torch.randn(1, 16, 32, requires_grad=True)
    cap = moe.capacity(16)
    assert cap == 4  # ceil(0.5 * 16 tokens * 2 choices / 4 experts)
    y, want = moe(x), reference(moe, x, capacity=cap)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert moe.stats.dropped > 0
    # A dropped assignment passes no gradient: the same as the loop that skips it.
    params = [x, *moe.parameters()]
    grads = torch.autograd.grad(y.square().sum(), params)
    assert_grads_close(grads, torch.autograd.grad(want.square().sum(), params))
    # The dropless layer with the same weights differs: something was dropped.
    moe.capacity_factors = None
    assert not torch.allclose(moe(x), reference(moe, x, capacity=cap))


def test_sinkhorn_balances_the_experts():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, generator=g) * 2 + torch.tensor([5.0, 0.0, 0.0, 0.0])
    plan = sinkhorn(logits)
    # Columns carry equal mass and rows too (64 tokens, 4 experts).
    torch.testing.assert_close(plan.sum(0), torch.full((4,), 1 / 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(plan.sum(1), torch.full((64,), 1 / 64), atol=1e-3, rtol=0)
    # Top-1 of raw logits favours expert 0; the balanced plan spreads the tokens out.
    assert logits.argmax(-1).bincount(minlength=4)[0] > 48
    assert plan.argmax(-1).bincount(minlength=4).max() < 32


def test_sinkhorn_stops_where_the_plain_loop_does():
    """sinkhorn's while_loop gives what a Python loop that stops on the same test gives, to
    the bit: the same iterations, the same arithmetic."""

    def plain_loop(logits, iters=100, tol=1e-4):
        cost = torch.exp(logits - logits.max())
        n, e = cost.shape
        col = torch.ones(e)
        for _ in range(iters):
            row = 1.0 / (n * (cost @ col + 1e-8))
            new_col = 1.0 / (e * (row @ cost + 1e-8))
            done = (new_col - col).abs().mean() < tol
            col = new_col
            if done:
                break
        return cost * row[:, None] * col[None, :]

    g = torch.Generator().manual_seed(1)
    for scale, iters in ((0.1, 100), (3.0, 100), (3.0, 2)):  # quick, slow, cut short
        logits = torch.randn(48, 6, generator=g) * scale
        assert torch.equal(sinkhorn(logits, iters), plain_loop(logits, iters))


def test_auxiliary_losses():
    moe = moe_layer(moe_router_type="topk", moe_z_loss_coeff=0.01).train()
    with torch.no_grad():
        moe.router.weight.zero_()  # every expert scored alike: the balance loss is 1 at best
    moe(torch.randn(2, 8, 32))
    s = moe.stats
    torch.testing.assert_close(s.load.sum(), torch.tensor(1.0))
    # Uniform scores: P_e = 1/E, so E * sum_e f_e / E = 1 whatever the load; logits 0: z = ln(E)^2.
    torch.testing.assert_close(s.balance_loss, torch.tensor(1.0))
    torch.testing.assert_close(s.z_loss, torch.tensor(4.0).log().square())
    torch.testing.assert_close(moe.aux_loss(), 0.1 * s.balance_loss + 0.01 * s.z_loss)
    # An unbalanced router pays more: all tokens to expert 0 with P_0 high.
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    moe(torch.ones(2, 8, 32))
    assert moe.stats.balance_loss > 1.5
    assert moe.stats.load[0] == 0.5  # top-2: half the assignments to expert 0


def test_training_loss_adds_the_router_losses():
    """In training the loss is the LM loss plus every MoE layer's weighted router losses; in
    evaluation the LM loss alone."""
    keys = {"moe_num_experts": 4, "moe_top_k": 2, "moe_router_type": "topk", "moe_z_loss_coeff": 1}
    model = build_model(load_dict({**BASE, **keys}).model, 64)
    ids = torch.randint(0, 64, (2, 17))
    train_loss = model.train()(ids[:, :-1], labels=ids[:, 1:])
    aux = moe_aux_loss(model.layers)
    assert aux > 0.1 * 2  # two layers; the z-loss is positive
    eval_loss = model.eval()(ids[:, :-1], labels=ids[:, 1:])
    torch.testing.assert_close(
        eval_loss, F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    )
    torch.testing.assert_close(train_loss, eval_loss + aux)


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"moe_num_experts": 4, "moe_top_k": 5}, "moe_top_k=5 exceeds moe_num_experts=4"),
        ({"moe_num_experts": 4, "moe_token_dropping": True}, "needs moe_type: deepspeed"),
        ({"moe_use_residual": True}, "residual MoE"),
    ],
)
def test_moe_keys_refused_by_name(keys, message):
    with pytest.raises(ConfigError, match=message):
        load_dict({**BASE, **keys})


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_grouped_mm_and_padded_bmm_agree():
    """CUDA's path (torch's grouped GEMM over a transposed slice of the stacked weights, offsets
    as cumulative counts) and the padded bmm compute the same products; torch runs grouped_mm's
    forward on CPU too (not its backward), which checks the layout convention here."""
    from neox.model.moe import _grouped_mm, _padded_bmm

    w = torch.randn(6, 32, 16)[1:5]  # a slice, as expert parallelism takes one
    x = torch.randn(20, 16)
    counts = torch.tensor([3, 0, 9, 8])
    grouped = _grouped_mm(counts.cumsum(0).to(torch.int32))(x, w)
    torch.testing.assert_close(grouped, _padded_bmm(counts)(x, w), atol=1e-5, rtol=1e-5)
    # Rows past the counts (dropped assignments) belong to no expert: both paths compute the
    # others alike; the padded one leaves zeros there.
    counts = torch.tensor([3, 0, 6, 5])
    grouped = _grouped_mm(counts.cumsum(0).to(torch.int32))(x, w)
    padded = _padded_bmm(counts)(x, w)
    torch.testing.assert_close(grouped[:14], padded[:14], atol=1e-5, rtol=1e-5)
    assert not padded[14:].any()


def reference_grouped_mm(mat_a, mat_b, *, offs, bias=None, out_dtype=None):
    """torch's grouped_mm (2D x 3D) in differentiable plain ops, in any dtype and device; the
    rows past offs[-1], which the kernel leaves undefined, are NaN here."""
    out = torch.full((mat_a.shape[0], mat_b.shape[-1]), float("nan"), dtype=mat_a.dtype)
    start = 0
    for group, end in enumerate(offs.tolist()):
        out[start:end] = mat_a[start:end] @ mat_b[group]
        start = end
    return out


@pytest.mark.parametrize(
    "keys",
    [
        {"moe_num_experts": 8, "moe_top_k": 2},
        {"moe_type": "deepspeed", "moe_token_dropping": True, "moe_train_capacity_factor": 0.5},
    ],
    ids=["dropless", "dropping"],
)
def test_gpu_path_matches_the_padded_bmm(monkeypatch, keys):
    """The GPU path's layer (grouped GEMM offsets; dropped assignments past them, in rows no
    expert computes) gives the CPU path's output and gradients, with grouped_mm's semantics
    stood in by plain ops, so that nothing undefined (NaN here) is read."""
    moe = moe_layer(**{**OLMOE_LIKE, **keys}).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    results = []
    for gpu_path in (False, True):
        monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda x, gpu=gpu_path: gpu)
        monkeypatch.setattr(F, "grouped_mm", reference_grouped_mm)
        loss = moe(x).square().sum() + moe.aux_loss()
        results.append([loss, *torch.autograd.grad(loss, [x, *moe.parameters()])])
    assert moe.stats.dropped > 0 if "moe_token_dropping" in keys else moe.stats.dropped == 0
    assert all(t.isfinite().all() for t in results[1])
    assert_grads_close(*results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("counts", [[40, 0, 100, 60], [40, 0, 100, 20]], ids=["all", "dropped"])
def test_experts_on_cuda_in_bf16_run_grouped_mm_like_the_float32_bmm(counts):
    """On a GPU in bf16 the experts run as torch's grouped GEMM, forward and backward, and
    agree with the float32 padded bmm of the same weights (to bf16 rounding); rows past the
    counts (dropped assignments: 40 of 200 in "dropped") are left out of both."""
    from neox.model.moe import grouped_mm_runs

    experts = moe_layer(activation="swiglu").experts.cuda()
    counts = torch.tensor(counts, device="cuda")
    rows = int(counts.sum())
    x = torch.randn(200, 32, device="cuda")
    fast = copy.deepcopy(experts).bfloat16()
    xb = x.bfloat16().requires_grad_()
    x32 = x.clone().requires_grad_()
    assert grouped_mm_runs(xb) and not grouped_mm_runs(x32)
    y, want = fast(xb, counts)[:rows], experts(x32, counts)[:rows]
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    y.float().square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xb.grad.float()[:rows], x32.grad[:rows], atol=5e-2, rtol=5e-2)
    for name in ("dense_h_to_4h", "gate", "dense_4h_to_h"):
        got, exp = getattr(fast, name).grad.float(), getattr(experts, name).grad
        torch.testing.assert_close(got, exp, atol=5e-2, rtol=5e-2, msg=name)


OLMOE_LIKE = {
    "activation": "swiglu",
    "norm": "rmsnorm",
    "use_bias_in_mlp": False,
    "moe_router_type": "topk",
    "moe_ffn_hidden_size": 16,
    "moe_z_loss_coeff": 0.001,
}


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"moe_num_shared_experts": 1, "moe_shared_expert_gate": True, "moe_jitter_eps": 0.01},
        {"moe_router_type": "sinkhorn"},  # its loop stops on a device value
        {"moe_type": "deepspeed", "moe_token_dropping": True, "moe_train_capacity_factor": 0.5},
    ],
    ids=["olmoe", "shared-jitter", "sinkhorn", "dropping"],
)
def test_compiled_block_on_the_gpu_path_is_one_graph(monkeypatch, training, keys):
    """The path GPUs run (bf16, grouped GEMM) traces an MoE block into one graph: the router,
    its losses and statistics, the dispatch (capacity included) and the combine break nothing.
    torch runs grouped_mm's forward on CPU, so dynamo runs that path here."""
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda x: True)
    cfg = load_dict({**BASE, "moe_num_experts": 8, "moe_top_k": 2, **OLMOE_LIKE, **keys}).model
    block = build_model(cfg, 64).bfloat16().train(training).layers[0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(torch.randn(2, 16, 32, dtype=torch.bfloat16))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize(
    "keys",
    [
        {"moe_num_experts": 8, "moe_top_k": 2},
        {"moe_num_experts": 8, "moe_top_k": 2, "moe_router_type": "sinkhorn"},
        {"moe_type": "deepspeed", "moe_token_dropping": True, "moe_train_capacity_factor": 0.5},
    ],
    ids=["dropless", "sinkhorn", "dropping"],
)
def test_compiled_moe_matches_eager(keys):
    """The compiled layer (dispatch and combine traced as their own autograd functions)
    computes the eager layer's output, losses and gradients."""
    moe = moe_layer(**{**OLMOE_LIKE, **keys}).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager")
    results = []
    for run in (moe, compiled):
        y = run(x)
        loss = y.square().sum() + moe.aux_loss()
        results.append([y, *torch.autograd.grad(loss, [x, *moe.parameters()])])
    assert_grads_close(*results)


@pytest.mark.parametrize(
    "n,dtype", [(64, torch.uint8), (256, torch.uint8), (300, torch.int16), (40_000, torch.int64)]
)
def test_narrow_ids_sort_in_the_same_stable_order(n, dtype):
    from neox.model.moe import narrow_ids

    ids = torch.randint(0, n, (5_000,), generator=torch.Generator().manual_seed(n))
    narrow = narrow_ids(ids, n)
    assert narrow.dtype == dtype
    assert torch.equal(torch.argsort(narrow, stable=True), torch.argsort(ids, stable=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_choices_is_the_weighted_sum_over_k_in_the_rows_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 5, 6, generator=g).to(dtype)
    weights = torch.rand(5, 8, generator=g).to(dtype)
    want = (rows.double() * weights.t().unsqueeze(-1).double()).sum(0)
    got = moe_module.sum_choices(rows, weights)
    assert got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(moe_module.sum_choices(rows).double(), rows.double().sum(0), **tol)

"""Rank-side checks of the vocab-parallel cross-entropy (neox/parallel/layers.py) against the
dense F.cross_entropy over the gathered logits, eager and compiled with the head (gloo ranks).

Compiled with inductor's CPU backend in float32 (its C++ code for bf16 did not compile on
these machines, docs/benchmarks.md; fp32 also keeps the dense comparison tight), and bf16 only
through the partitioner without code generation (aot_eager_decomp_partition).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from neox.model.loss import lm_loss
from neox.parallel.layers import vocab_parallel_cross_entropy, vocab_parallel_logits
from neox.parallel.tensor import lm_loss_parallel
from neox.parallel.topology import Topology

TOL = dict(rtol=1e-5, atol=1e-6)
B, T, HIDDEN, VOCAB = 2, 6, 8, 24


def _inputs(world: int) -> tuple[torch.Tensor, ...]:
    """The same numbers on every rank: hidden states, the full head weight, targets (on every
    shard, each shard's first and last column among them) and a loss mask with zeros."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, T, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 4  # large logits: the max shift matters
    target = torch.randint(0, VOCAB, (B, T), generator=g)
    per = VOCAB // world
    edges = torch.tensor([r * per + c for r in range(world) for c in (0, per - 1)])
    target.view(-1)[: edges.numel()] = edges
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0, 0] = 0.0
    return h, w, target, mask


def _dense(h, w, target, mask, weights):
    """Per-token losses, the masked mean and the gradients of h, w and the logits."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h @ w.T
    logits.retain_grad()
    losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    mean = lm_loss(logits, target, mask)
    ((losses * weights).sum() + mean).backward()
    return losses.detach(), mean.detach(), h.grad, w.grad, logits.grad


def _head_and_loss(h, w_shard, target, mask, weights, group):
    """The tied head's logits shard, its per-token losses, the masked mean; one scalar."""
    logits = vocab_parallel_logits(h, w_shard, group)
    losses = vocab_parallel_cross_entropy(logits, target, group)
    mean = lm_loss_parallel(logits, target, mask, group)
    return (losses.flatten() * weights).sum() + mean, losses, mean, logits


def _check(rank: int, world: int, group, compile_backend=None) -> None:
    h, w, target, mask = _inputs(world)
    weights = torch.linspace(0, 1, B * T)
    losses_ref, mean_ref, dh_ref, dw_ref, dz_ref = _dense(h, w, target, mask, weights)
    cols = slice(VOCAB // world * rank, VOCAB // world * (rank + 1))

    fn = _head_and_loss
    if compile_backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(_head_and_loss, backend=compile_backend, fullgraph=True)
    h_tp, w_tp = h.clone().requires_grad_(), w[cols].clone().requires_grad_()
    total, losses, mean, logits = fn(h_tp, w_tp, target, mask, weights, group)
    if compile_backend is None:  # a compiled graph's intermediates hold no .grad
        logits.retain_grad()
    total.backward()
    msg = f"backend {compile_backend}"
    torch.testing.assert_close(losses.flatten(), losses_ref, **TOL, msg=msg)
    torch.testing.assert_close(mean, mean_ref, **TOL, msg=msg)
    torch.testing.assert_close(h_tp.grad, dh_ref, **TOL, msg=msg)
    torch.testing.assert_close(w_tp.grad, dw_ref[cols], **TOL, msg=msg)
    if compile_backend is None:
        torch.testing.assert_close(logits.grad, dz_ref[..., cols], **TOL, msg=msg)


def _check_logits_gradient(rank: int, world: int, group, backend) -> None:
    """d loss / d logits shard = (softmax - onehot) x the token's weight, this rank's columns:
    the logits as the compiled function's input."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(B, T, VOCAB, generator=g) * 8
    target = torch.randint(0, VOCAB, (B, T), generator=g)
    weights = torch.rand(B, T, generator=g)
    z_ref = z.clone().requires_grad_()
    ref = F.cross_entropy(z_ref.flatten(0, 1), target.flatten(), reduction="none")
    (ref * weights.flatten()).sum().backward()
    cols = slice(VOCAB // world * rank, VOCAB // world * (rank + 1))

    def loss(shard, target, weights):
        return (vocab_parallel_cross_entropy(shard, target, group) * weights).sum()

    torch._dynamo.reset()
    fn = loss if backend is None else torch.compile(loss, backend=backend, fullgraph=True)
    shard = z[..., cols].clone().requires_grad_()
    got = fn(shard, target, weights)
    got.backward()
    torch.testing.assert_close(got, (ref * weights.flatten()).sum(), **TOL)
    torch.testing.assert_close(shard.grad, z_ref.grad[..., cols], **TOL)


def _check_no_graph_break(group) -> None:
    h, w, target, mask = _inputs(dist.get_world_size(group))
    w_shard = w.chunk(dist.get_world_size(group))[dist.get_rank(group)]
    weights = torch.linspace(0, 1, B * T)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_head_and_loss)(
        h.requires_grad_(), w_shard.requires_grad_(), target, mask, weights, group
    )
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _saved_logit_sized(rank: int, world: int, group, backend: str, dtype) -> list[tuple]:
    """(shape, dtype) of each (B, T, V/tp)-sized tensor the compiled head and loss save for
    backward, with weights and hidden states in `dtype`."""
    h, w, target, mask = _inputs(world)
    h, w_shard = h.to(dtype).requires_grad_(), w.chunk(world)[rank].to(dtype).requires_grad_()
    torch._dynamo.reset()

    def fn(h, w_shard, target, mask):  # the scalar loss alone, as model.loss returns it
        return lm_loss_parallel(vocab_parallel_logits(h, w_shard, group), target, mask, group)

    fn = torch.compile(fn, backend=backend, fullgraph=True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == B * T * VOCAB // world:
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(h, w_shard, target, mask)
    loss.backward()
    return saved


def check_vocab_parallel_loss(rank: int, world: int) -> None:
    group = Topology(tp=world).build_groups().tensor
    for backend in (None, "aot_eager", "inductor"):
        _check(rank, world, group, backend)
        _check_logits_gradient(rank, world, group, backend)
    _check_no_graph_break(group)
    # The compiled graph keeps the logits (or nothing of their size), no fp32 softmax besides
    # them; in bf16, partitioned as inductor partitions, what it keeps of that size is bf16.
    assert len(_saved_logit_sized(rank, world, group, "inductor", torch.float32)) <= 1
    saved = _saved_logit_sized(rank, world, group, "aot_eager_decomp_partition", torch.bfloat16)
    assert len(saved) <= 1 and all(dtype == torch.bfloat16 for _, dtype in saved), saved


def check_compiled_pipeline_loss(rank: int, world: int) -> None:
    """pp=2, tied and untied head: compiled, the last stage's forward ends at the final norm and
    its loss_fn runs head and loss, with the eager pipeline's loss and gradients; the layers
    DeepSpeed saves and loads (those with a state_dict) are the same modules."""
    from neox.config.model import ModelConfig
    from neox.parallel.build import parallelize
    from tests.parallel.equivalence_helpers import MODELS, SEQ, VOCAB

    groups = Topology(pp=world).build_groups()
    for model in ("A", "B"):  # tied, untied
        cfg = ModelConfig(**MODELS[model])
        eager = parallelize(cfg, VOCAB, groups, seed=0)
        compiled = parallelize(
            cfg, VOCAB, groups, seed=0, torch_compile=True, torch_compile_backend="aot_eager"
        )
        layers = [
            [list(f.state_dict()) for f in pipe.forward_funcs if hasattr(f, "state_dict")]
            for pipe in (eager, compiled)
        ]
        assert layers[0] == layers[1], layers
        if eager.stage_id != eager.num_stages - 1:
            continue
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(2, SEQ, cfg.hidden_size, generator=g)
        labels = (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.ones(2, SEQ))
        results = []
        for pipe in (eager, compiled):
            x = hidden.clone().requires_grad_()
            out = pipe(x)
            loss = pipe.loss_fn(out, labels)
            loss.backward()
            grads = [p.grad for p in pipe.parameters()]
            results.append((out.shape[-1], loss.detach(), x.grad, grads))
        (width_e, loss_e, dx_e, dp_e), (width_c, loss_c, dx_c, dp_c) = results
        assert (width_e, width_c) == (VOCAB, cfg.hidden_size)  # logits; hidden states
        torch.testing.assert_close(loss_c, loss_e, **TOL)
        torch.testing.assert_close(dx_c, dx_e, **TOL)
        torch.testing.assert_close(dp_c, dp_e, **TOL)

"""Rank-side checks of TP mappings and layers vs dense math on the same numbers (gloo ranks)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neox.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from neox.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from neox.parallel.topology import Topology

TOL = dict(rtol=1e-5, atol=1e-6)


def _check_mappings(rank: int, world: int, group) -> None:
    # Each rank holds its rank + 1; the reduced value is 1 + 2 + ... + world.
    total = world * (world + 1) / 2
    x = torch.full((3, 4), float(rank + 1), requires_grad=True)
    y = reduce_from_tensor_parallel(x, group)
    assert torch.equal(y, torch.full((3, 4), total))
    y.backward(torch.full((3, 4), float(rank + 1)))
    assert torch.equal(x.grad, torch.full((3, 4), float(rank + 1)))  # backward is identity

    x = torch.ones(3, 4, requires_grad=True)
    copy_to_tensor_parallel(x, group).backward(torch.full((3, 4), float(rank + 1)))
    assert torch.equal(x.grad, torch.full((3, 4), total))  # backward sums the ranks

    full = torch.arange(2 * 4 * world, dtype=torch.float32).view(2, 4 * world).requires_grad_()
    part = scatter_to_tensor_parallel(full, group)
    assert torch.equal(part, full.detach()[:, 4 * rank : 4 * (rank + 1)])
    part.backward(torch.full_like(part, float(rank + 1)))
    want = torch.cat([torch.full((2, 4), float(r + 1)) for r in range(world)], dim=-1)
    assert torch.equal(full.grad, want)

    part = torch.full((2, 3), float(rank), requires_grad=True)
    gathered = gather_from_tensor_parallel(part, group)
    assert torch.equal(
        gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(world)], -1)
    )
    gathered.backward(torch.arange(3.0 * world).expand(2, -1))
    assert torch.equal(part.grad, torch.arange(3.0 * rank, 3.0 * (rank + 1)).expand(2, -1))


def _check_linears(rank: int, world: int, group) -> None:
    torch.manual_seed(0)  # same full weights and inputs on every rank
    fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(2, 5, 16)
    x_ref = x.clone().requires_grad_()
    ref = fc2(F.gelu(fc1(x_ref)))
    ref.pow(2).sum().backward()

    col = ColumnParallelLinear(16, 32, group)
    row = RowParallelLinear(32, 16, group)
    col.load_full_(fc1.weight, fc1.bias)
    row.load_full_(fc2.weight, fc2.bias)
    x_tp = x.clone().requires_grad_()
    out = row(F.gelu(col(x_tp)))
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **TOL)
    rows = slice(32 // world * rank, 32 // world * (rank + 1))
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad[rows], **TOL)
    torch.testing.assert_close(col.bias.grad, fc1.bias.grad[rows], **TOL)
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad[:, rows], **TOL)
    torch.testing.assert_close(row.bias.grad, fc2.bias.grad, **TOL)
    assert col.weight.tensor_model_parallel and not hasattr(row.bias, "tensor_model_parallel")

    # The other modes: gathered column output, row layer that scatters its own input.
    gcol = ColumnParallelLinear(16, 32, group, gather_output=True)
    gcol.load_full_(fc1.weight, fc1.bias)
    torch.testing.assert_close(gcol(x), fc1(x), **TOL)
    srow = RowParallelLinear(32, 16, group, input_is_parallel=False)
    srow.load_full_(fc2.weight, fc2.bias)
    h = torch.randn(2, 5, 32)
    torch.testing.assert_close(srow(h), fc2(h), **TOL)


def _check_vocab(rank: int, world: int, group) -> None:
    torch.manual_seed(1)
    vocab, hidden = 24, 8
    emb = nn.Embedding(vocab, hidden)
    ids = torch.randint(0, vocab, (3, 7))
    ids[0, :world] = torch.arange(world) * (vocab // world)  # every shard's first row is used
    emb(ids).sum().backward()

    vemb = VocabParallelEmbedding(vocab, hidden, group)
    vemb.load_full_(emb.weight)
    out = vemb(ids)
    torch.testing.assert_close(out, emb(ids), **TOL)
    out.sum().backward()
    rows = slice(vocab // world * rank, vocab // world * (rank + 1))
    torch.testing.assert_close(vemb.weight.grad, emb.weight.grad[rows], **TOL)

    # Tied head + vocab-parallel CE vs full logits + F.cross_entropy: loss and both grads.
    h = torch.randn(3, 7, hidden)
    target = torch.randint(0, vocab, (3, 7))
    h_ref = h.clone().requires_grad_()
    w_ref = emb.weight.detach().clone().requires_grad_()
    loss_ref = F.cross_entropy((h_ref @ w_ref.T).flatten(0, 1), target.flatten(), reduction="none")
    (loss_ref * torch.linspace(0, 1, loss_ref.numel())).sum().backward()

    h_tp = h.clone().requires_grad_()
    w_tp = emb.weight.detach()[rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(vocab_parallel_logits(h_tp, w_tp, group), target, group)
    assert loss.shape == target.shape
    torch.testing.assert_close(loss.flatten(), loss_ref, **TOL)
    (loss.flatten() * torch.linspace(0, 1, loss.numel())).sum().backward()
    torch.testing.assert_close(h_tp.grad, h_ref.grad, **TOL)
    torch.testing.assert_close(w_tp.grad, w_ref.grad[rows], **TOL)


def _check_rng(groups) -> None:
    from neox.parallel.tensor import fork_tensor_parallel_rng, seed_parallel_rng

    seed_parallel_rng(1234, groups)
    with fork_tensor_parallel_rng():
        inside = torch.rand(8)  # e.g. attention dropout on this rank's heads
    outside = torch.rand(8)  # e.g. hidden dropout on the replicated residual stream
    both = [torch.empty(2, 8) for _ in range(2)]
    dist.all_gather(both, torch.stack([inside, outside]), group=groups.tensor)
    assert not torch.equal(both[0][0], both[1][0]), "tp ranks must draw different masks"
    assert torch.equal(both[0][1], both[1][1]), "outside the tp region masks must agree"


def _check_compiled_mappings(rank: int, world: int, group) -> None:
    """Compiled, each mapping (tensor and sequence parallel) gives eager's values and gradients,
    under dynamo's graph alone (as `torch_compile_backend: eager` runs it) and through
    AOTAutograd, and no graph dynamo or AOTAutograd traces (the autograd.Functions' forwards and
    backwards included) mutates a tensor in place. torch 2.11 misroutes the gradient of a
    Function whose forward returns a tensor written in place (pytorch issue 180642): dynamo
    traced the in-place all-reduce as such a write, and a tp=2 run with torch_compile learned
    from wrong gradients on GPUs; the functional collective's wait counts too (the reduce's
    gradient, dynamo's graph alone, torch 2.11, 2026-11-29)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: list[torch.fx.GraphModule] = []

    def dynamo_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def aot_graph(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    # Mapping -> the output's shape for an x of (2, 2 world, 4).
    t = 2 * world
    fns = {
        "reduce": (reduce_from_tensor_parallel, (2, t, 4)),
        "copy": (copy_to_tensor_parallel, (2, t, 4)),
        "gather": (gather_from_tensor_parallel, (2, t, 4 * world)),
        "reduce_scatter_sequence": (reduce_scatter_to_sequence_parallel, (2, 2, 4)),
        "gather_sequence": (gather_from_sequence_parallel, (2, t * world, 4)),
        "scatter_sequence": (scatter_to_sequence_parallel, (2, 2, 4)),
    }
    torch.manual_seed(0)  # the same x on every rank, a different output gradient on each
    x = torch.randn(2, t, 4)
    for name, (mapping, out_shape) in fns.items():

        def fn(t, mapping=mapping):
            return mapping(t * 2, group) * 3

        grad_out = torch.randn(out_shape) * (rank + 1)
        x_eager = x.clone().requires_grad_()
        want = fn(x_eager)
        want.backward(grad_out)
        aot = aot_autograd(fw_compiler=aot_graph, bw_compiler=aot_graph)
        for backend in (dynamo_graph, "eager", aot):
            torch._dynamo.reset()
            x_compiled = x.clone().requires_grad_()
            got = torch.compile(fn, backend=backend, fullgraph=True)(x_compiled)
            got.backward(grad_out)
            what = f"{name}, backend {getattr(backend, '__name__', backend)}"
            torch.testing.assert_close(got, want, **TOL, msg=f"{what}: forward")
            torch.testing.assert_close(x_compiled.grad, x_eager.grad, **TOL, msg=f"{what}: grad")
    in_place = [
        node.format_node()
        for gm in graphs
        for sub in gm.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for node in sub.graph.nodes
        if node.op in ("call_function", "call_method") and _is_in_place(node.target)
    ]
    assert not in_place, in_place


def _is_in_place(target) -> bool:
    """copy_, add_, _c10d_functional.all_reduce_.default, ...: a trailing underscore."""
    name = str(getattr(target, "__name__", target)).split(".")[0]
    return name.endswith("_") and not name.startswith("_")


def check_all_ranks(rank: int, world: int) -> None:
    groups = Topology(tp=world).build_groups()
    assert groups.get_tensor_model_parallel_rank() == rank
    assert dist.get_world_size(groups.tensor) == world
    _check_mappings(rank, world, groups.tensor)
    _check_linears(rank, world, groups.tensor)
    _check_vocab(rank, world, groups.tensor)
    _check_rng(groups)
    _check_compiled_mappings(rank, world, groups.tensor)

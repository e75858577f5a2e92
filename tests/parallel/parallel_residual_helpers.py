"""Rank functions of tests/parallel/test_parallel_residual.py: a parallel-residual block under
tp all-reduces its two branches once (apply_tensor_parallel), with the dense block's output and
gradients; the other blocks keep a reduce per row-parallel layer."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from neox.config.model import ModelConfig
from neox.model import build_model, lm_loss
from neox.model.block import Block
from neox.parallel.build import parallelize
from neox.parallel.layers import shard
from neox.parallel.tensor import apply_tensor_parallel
from neox.parallel.topology import ProcessGroups, Topology

TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)  # sums over every token, in another order per layout
B, T, C = 2, 8, 32
BASE = dict(num_layers=2, hidden_size=C, num_attention_heads=4, seq_length=T, gpt_j_residual=True)


@contextlib.contextmanager
def counted_collectives() -> Iterator[Counter]:
    """Counts the calls of torch.distributed's collectives and their functional (compiled)
    forms by name, e.g. {"all_reduce": 1}, while inside."""
    calls: Counter = Counter()
    patched = []
    for module, names in (
        (dist, ("all_reduce", "reduce_scatter", "all_gather")),
        (funcol, ("all_reduce", "reduce_scatter_tensor", "all_gather_tensor")),
    ):
        for name in names:
            original = getattr(module, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(module, name, counted)
            patched.append((module, name, original))
    try:
        yield calls
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def is_fused(block: Block) -> bool:
    rows = (block.attention.dense, getattr(block.mlp, "dense_4h_to_h", None))
    flags = [getattr(m, "parallel_output", False) for m in rows]
    assert flags in ([True, True], [False, False]), flags
    return "add_branches" in vars(block) and all(flags)


def _block_pair(cfg: ModelConfig, groups: ProcessGroups, moe: bool = False) -> tuple[Block, Block]:
    """(dense block, its tp copy): the same weights on every rank (one seed)."""
    torch.manual_seed(0)
    dense = Block(cfg, moe=moe)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.2)  # biases too: a bias added tp times or dropped would show
    return dense, apply_tensor_parallel(copy.deepcopy(dense), groups, cfg)


def _assert_grads_match(tp_module: torch.nn.Module, dense: torch.nn.Module, rank: int, world: int):
    reference = dict(dense.named_parameters())
    for name, param in tp_module.named_parameters():
        want = reference[name].grad
        if getattr(param, "tensor_model_parallel", False):
            want = shard(want, param.partition_dim, rank, world)
        torch.testing.assert_close(param.grad, want, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _run(block: Block, x: torch.Tensor, grad_out: torch.Tensor, seed: int = 1):
    """Output and input gradient of one forward and backward, the dropout masks drawn from
    `seed` (the default generator: equal on every tp rank, as seed_parallel_rng leaves it)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = block(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def check_block_matches_dense(rank: int, world: int) -> None:
    """Output, input gradient and every parameter gradient of a fused tp block equal the dense
    block's, with and without hidden dropout (the same masks: the same default generator), one
    norm or two, biases or none; and its forward all-reduces once."""
    groups = ProcessGroups(Topology(tp=world))
    variants = {
        "two norms": {},
        "gpt_j_tied": dict(gpt_j_tied=True),
        "hidden_dropout": dict(hidden_dropout=0.3),
        "no biases, swiglu": dict(use_bias_in_attn_linear=False, use_bias_in_mlp=False,
                                  activation="swiglu"),
    }  # fmt: skip
    g = torch.Generator().manual_seed(2)
    x, grad_out = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    for name, keys in variants.items():
        cfg = ModelConfig(**BASE, **keys)
        dense, block = _block_pair(cfg, groups)
        assert is_fused(block), name
        want, want_dx = _run(dense, x, grad_out)
        got, dx = _run(block, x, grad_out)
        torch.testing.assert_close(got, want, **TOL, msg=name)
        torch.testing.assert_close(dx, want_dx, **TOL, msg=name)
        _assert_grads_match(block, dense, rank, world)
        with counted_collectives() as calls, torch.no_grad():
            block(x)
        assert calls == Counter(all_reduce=1), (name, calls)
        if keys.get("hidden_dropout"):
            block.eval()  # and in eval (generation, evaluation) dropout is the identity
            dense.eval()
            with torch.no_grad():
                torch.testing.assert_close(block(x), dense(x), **TOL)


def check_other_blocks_reduce_per_layer(rank: int, world: int) -> None:
    """Sequential-residual and MoE blocks keep an all-reduce per row-parallel layer; sequence
    parallelism its two reduce-scatters (the fusion is not applied); all equal the dense block."""
    g = torch.Generator().manual_seed(2)
    x, grad_out = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    groups = ProcessGroups(Topology(tp=world))
    cases = {
        "sequential": (dict(BASE, gpt_j_residual=False), False, Counter(all_reduce=2)),
        "moe": (dict(BASE, moe_num_experts=2), True, Counter(all_reduce=1)),
    }
    for name, (keys, moe, forward_calls) in cases.items():
        cfg = ModelConfig(**keys)
        dense, block = _block_pair(cfg, groups, moe=moe)
        assert not is_fused(block), name
        with counted_collectives() as calls, torch.no_grad():
            block(x)
        assert calls == forward_calls, (name, calls)
        want, want_dx = _run(dense, x, grad_out)
        got, dx = _run(block, x, grad_out)
        torch.testing.assert_close(got, want, **TOL, msg=name)
        torch.testing.assert_close(dx, want_dx, **TOL, msg=name)

    sp = ProcessGroups(Topology(tp=world), sequence_parallel=True)
    dense, block = _block_pair(ModelConfig(**BASE), sp)
    assert not is_fused(block)
    chunk = x.chunk(world, dim=1)[rank]  # this rank's tokens
    with counted_collectives() as calls, torch.no_grad():
        got = block(chunk)
    # One all-gather per norm (input_layernorm, post_attention_layernorm), a reduce-scatter per
    # row-parallel layer.
    assert calls == Counter(all_gather=2, reduce_scatter=2), calls
    with torch.no_grad():
        torch.testing.assert_close(got, dense(x).chunk(world, dim=1)[rank], **TOL)


def check_compiled_block(rank: int, world: int, backend: str) -> None:
    """A fused tp block compiles to one graph (fullgraph: a break raises) whose forward holds one
    all-reduce (AOTAutograd's forward graph; the backward's are the column-parallel inputs'
    copies), and gives eager's output and gradients; then through `backend` itself."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    groups = ProcessGroups(Topology(tp=world))
    _, block = _block_pair(ModelConfig(**BASE), groups)
    assert is_fused(block)
    g = torch.Generator().manual_seed(2)
    x, grad_out = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    want, want_dx = _run(block, x, grad_out)
    eager_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    forward = block.forward

    forward_graphs: list[torch.fx.GraphModule] = []

    def keep_forward(gm: torch.fx.GraphModule, example_inputs):
        forward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    counting = aot_autograd(
        fw_compiler=keep_forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)
    )
    for compiler in (counting, backend):
        torch._dynamo.reset()
        block.zero_grad(set_to_none=True)
        block.forward = torch.compile(forward, backend=compiler, fullgraph=True)
        try:
            got, dx = _run(block, x, grad_out)
        finally:
            block.forward = forward
            torch._dynamo.reset()
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(dx, want_dx, **TOL)
        for name, param in block.named_parameters():
            torch.testing.assert_close(param.grad, eager_grads[name], **TOL, msg=name)
    assert len(forward_graphs) == 1
    reduces = [n for n in forward_graphs[0].graph.nodes if "all_reduce" in str(n.target)]
    assert len(reduces) == 1, [n.format_node() for n in reduces]


def check_model_matches_dense(rank: int, world: int) -> None:
    """The tp model that training builds (parallelize: meta init, the tp RNG streams) has the
    dense model's loss and gradients with hidden dropout on (the same masks on every rank and in
    the dense model, whose default generator parallelize seeds alike)."""
    cfg = ModelConfig(**BASE, hidden_dropout=0.2, pos_emb="rotary", no_weight_tying=True)
    vocab, seed = 64, 5
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]

    dense = build_model(cfg, vocab, seed=seed)
    torch.manual_seed(seed)  # parallelize's default generator at pp rank 0: seed
    want = lm_loss(dense(ids), labels, None)
    want.backward()

    model = parallelize(cfg, vocab, ProcessGroups(Topology(tp=world)), seed=seed)
    assert all(is_fused(b) for b in model.layers)
    got = model(ids, labels=labels)
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    _assert_grads_match(model, dense, rank, world)

"""Rank functions of tests/parallel/test_context.py: one micro-batch through the model on cp
ranks (a chunk each, the Ulysses exchange in every attention layer) against the same model on
the whole batch in one process."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from neox.config.model import ModelConfig
from neox.data.batch import build_batch
from neox.model import build_model
from neox.parallel.context import apply_context_parallel, context_chunk
from neox.parallel.topology import ProcessGroups, Topology
from neox.training.engine import forward_loss, weigh_micro_batches

VOCAB, EOD = 64, 0
BASE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=32,
    max_position_embeddings=32,
    pos_emb="rotary",
    rotary_pct=0.5,
    attention_impl="torch",
)
# Each case one model shape and one batch style; together they cover what attention does.
CASES = {
    "plain": ({}, {}),
    "packed_gqa_window": (
        {"num_kv_heads": 2, "sliding_window_width": 6},
        {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True},
    ),
    "mqa_replicated_alibi": ({"num_kv_heads": 1, "pos_emb": "alibi"}, {}),
    "rope_scaling_sft_mask": (
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "gpt_j_residual": True},
        {"label_mask": True},
    ),
}


def case_batch(name: str, seed: int = 0):
    """The whole micro-batch (B=2) of case `name`: documents of random lengths, EOD between."""
    _, batch_keys = CASES[name]
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, VOCAB, (2, BASE["seq_length"] + 1), generator=g)
    text[torch.rand(text.shape, generator=g) < 0.12] = EOD
    label = None
    keys = dict(batch_keys)
    if keys.pop("label_mask", False):
        label = text.clone()
        # A prompt that is not trained, longer than the first rank's chunk: that rank trains
        # no token of its own and still passes gradients to the other's through attention.
        label[:, : BASE["seq_length"] * 5 // 8] = -100
    return build_batch(text, EOD, label=label, **keys)


def check_case(rank: int, world: int, name: str) -> None:
    """Loss and every gradient of the cp-rank model equal the one-process model's."""
    torch.manual_seed(0)
    model_keys, _ = CASES[name]
    cfg = ModelConfig(**{**BASE, **model_keys})
    whole = case_batch(name)
    reference = build_model(cfg, VOCAB, seed=3)
    want = forward_loss(reference, whole)
    want.backward()

    groups = ProcessGroups(Topology(cp=world))
    model = build_model(cfg, VOCAB, seed=3)
    apply_context_parallel(model, groups)
    chunk = context_chunk(whole, groups.get_context_parallel_rank(), world)
    # As the engines weigh and average it: this rank's tokens over the global count.
    weigh_micro_batches([chunk], groups.get_data_parallel_group())
    loss = forward_loss(model, chunk)
    (loss / world).backward()  # the engines' average over the gradient group
    total = loss.detach() / world
    dist.all_reduce(total, group=groups.get_data_parallel_group())
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=groups.get_data_parallel_group())
        torch.testing.assert_close(grad / 1, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")


def check_all(rank: int, world: int) -> None:
    for name in CASES:
        check_case(rank, world, name)


def check_compiled_block(rank: int, world: int) -> None:
    """A transformer block compiled under cp: dynamo traces the exchange (no graph break, no
    eager collective in its forward or backward), the compiled block's output and gradients
    equal the eager block's, and a layer's eager forward and backward each make two all-to-alls
    (q, k, v packed; the output): MHA, GQA with kv heads divisible by cp sending only those, and
    MQA with its kv heads replicated."""
    torch.manual_seed(0)
    calls: list[torch.Size] = []  # the received buffer's shape, per eager all-to-all
    collective = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return collective(*args, **kwargs)

    @contextlib.contextmanager
    def counting():
        calls.clear()
        dist.all_to_all_single = counted
        try:
            yield
        finally:
            dist.all_to_all_single = collective

    for kv in (4, 2, 1):  # MHA, GQA that shares out, MQA (replicated)
        cfg = ModelConfig(**{**BASE, "num_kv_heads": kv})
        model = build_model(cfg, VOCAB, seed=3)
        apply_context_parallel(model, ProcessGroups(Topology(cp=world)))
        block = model.layers[0]
        t = BASE["seq_length"] // world
        x = torch.randn(2, t, BASE["hidden_size"], generator=torch.Generator().manual_seed(rank))
        positions = (torch.arange(t) + rank * t).expand(2, t)

        x_eager = x.clone().requires_grad_()
        with counting():
            want = block(x_eager, position_ids=positions)
            forward_calls = len(calls)
            want.square().sum().backward()
        assert (forward_calls, len(calls)) == (2, 4), (kv, calls)
        kv_heads = BASE["num_attention_heads"] if kv % world else kv  # MQA: one per q head
        assert calls[0][2] == (BASE["num_attention_heads"] + 2 * kv_heads) // world, calls

        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(x, position_ids=positions)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(block, backend="aot_eager")
        x_compiled = x.clone().requires_grad_()
        with counting():
            got = compiled(x_compiled, position_ids=positions)
            got.square().sum().backward()
        assert calls == [], "the compiled block (forward or backward) left its graph to exchange"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-5, atol=1e-6)

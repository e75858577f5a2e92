"""Rank functions of tests/parallel/test_context.py: one micro-batch through the model on cp
ranks (a chunk each, the Ulysses exchange in every attention layer) against the same model on
the whole batch in one process."""

from __future__ import annotations

import contextlib
import itertools
import re

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

from neox.config.model import ModelConfig
from neox.data.batch import build_batch
from neox.model import build_model
from neox.parallel.build import compile_blocks
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


# The exchange in head groups (context_parallel_chunks): (case, groups, model keys over the
# case's). At 2 ranks and 4 heads each rank attends with 2: MHA cuts its kv heads with them,
# GQA's one kv head a rank travels with both groups, MQA's replicated kv heads and the ALiBi
# slopes follow their query heads. At 8 heads, 4 groups of one; at 12 heads and 4 kv heads,
# 2 kv heads a rank that 3 groups cannot share out (replicated, one per query head, first).
CHUNKED = [
    ("plain", 2, {}),
    ("packed_gqa_window", 2, {}),
    ("mqa_replicated_alibi", 2, {}),
    ("rope_scaling_sft_mask", 2, {}),
    ("packed_gqa_window", 4, {"num_attention_heads": 8}),
    ("mqa_replicated_alibi", 4, {"num_attention_heads": 8}),
    ("plain", 3, {"num_attention_heads": 12, "num_kv_heads": 4, "hidden_size": 48}),
]


def _cp_loss_and_grads(cfg: ModelConfig, whole, world: int, chunks: int):
    """The loss and the gradients (summed over the ranks) of the model on cp ranks."""
    groups = ProcessGroups(Topology(cp=world))
    model = build_model(cfg, VOCAB, seed=3)
    apply_context_parallel(model, groups, chunks)
    chunk = context_chunk(whole, groups.get_context_parallel_rank(), world)
    # As the engines weigh and average it: this rank's tokens over the global count.
    weigh_micro_batches([chunk], groups.get_data_parallel_group())
    loss = forward_loss(model, chunk)
    (loss / world).backward()  # the engines' average over the gradient group
    total = loss.detach() / world
    dist.all_reduce(total, group=groups.get_data_parallel_group())
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.clone()
        dist.all_reduce(grads[n], group=groups.get_data_parallel_group())
    return total, grads


def check_case(rank: int, world: int, name: str, chunks: int = 1, keys: dict | None = None) -> None:
    """Loss and every gradient of the cp-rank model (its exchange in `chunks` head groups)
    equal the one-process model's, and at chunks > 1 the one-group exchange's."""
    torch.manual_seed(0)
    model_keys, _ = CASES[name]
    cfg = ModelConfig(**{**BASE, **model_keys, **(keys or {})})
    whole = case_batch(name)
    reference = build_model(cfg, VOCAB, seed=3)
    want = forward_loss(reference, whole)
    want.backward()

    total, grads = _cp_loss_and_grads(cfg, whole, world, chunks)
    what = f"{name} in {chunks} groups"
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6, msg=what)
    for (n, grad), q in zip(grads.items(), reference.parameters()):
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{what}: {n}")
    if chunks > 1:
        one_total, one_grads = _cp_loss_and_grads(cfg, whole, world, 1)
        torch.testing.assert_close(total, one_total, rtol=1e-6, atol=1e-7, msg=what)
        for n, grad in grads.items():
            torch.testing.assert_close(grad, one_grads[n], rtol=1e-5, atol=1e-7, msg=n)


def check_all(rank: int, world: int) -> None:
    for name in CASES:
        check_case(rank, world, name)


def check_compiled_block(rank: int, world: int) -> None:
    """A transformer block compiled under cp: dynamo traces the exchange (no graph break, no
    eager collective in its forward or backward), the compiled block's output and gradients
    equal the eager block's, and a layer's eager forward and backward each make two all-to-alls
    (q, k, v packed; the output), 2 G in G head groups: MHA, GQA with kv heads divisible by cp
    sending only those, and MQA with its kv heads replicated. In 2 groups AOTAutograd's forward
    and backward graphs keep the overlapped order (assert_overlapped). Dynamo's graph run alone
    (no AOTAutograd) gives the same output and gradients too."""
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

    graphs: dict[str, list] = {}

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, _):
            graphs[kind] = graph_events(gm)
            return make_boxed_func(gm)

        return compiler

    for kv, chunks in itertools.product((4, 2, 1), (1, 2)):  # MHA, GQA that shares out, MQA
        cfg = ModelConfig(**{**BASE, "num_kv_heads": kv})
        model = build_model(cfg, VOCAB, seed=3)
        apply_context_parallel(model, ProcessGroups(Topology(cp=world)), chunks)
        block = model.layers[0]
        t = BASE["seq_length"] // world
        x = torch.randn(2, t, BASE["hidden_size"], generator=torch.Generator().manual_seed(rank))
        positions = (torch.arange(t) + rank * t).expand(2, t)

        x_eager = x.clone().requires_grad_()
        with counting():
            want = block(x_eager, position_ids=positions)
            forward_calls = len(calls)
            want.square().sum().backward()
        assert (forward_calls, len(calls)) == (2 * chunks, 4 * chunks), (kv, chunks, calls)
        kv_heads = BASE["num_attention_heads"] if kv % world else kv  # MQA: one per q head
        kv_heads = max(kv_heads // world // chunks, 1) * world * chunks  # a kv head per group
        heads = (BASE["num_attention_heads"] + 2 * kv_heads) // world // chunks
        assert calls[0][2] == heads, (kv, chunks, calls)

        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(x, position_ids=positions)
        assert explained.graph_break_count == 0, explained.break_reasons
        graphs.clear()
        backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
        compiled = torch.compile(block, backend=backend)
        x_compiled = x.clone().requires_grad_()
        with counting():
            got = compiled(x_compiled, position_ids=positions)
            got.square().sum().backward()
        assert calls == [], "the compiled block (forward or backward) left its graph to exchange"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
        if chunks > 1:
            assert_overlapped(graphs["forward"], "AOTAutograd forward")
            assert_overlapped(graphs["backward"], "AOTAutograd backward")
        if kv == 4:  # dynamo's graph alone (torch_compile_backend: eager), see mappings.fresh
            torch._dynamo.reset()
            x_graph = x.clone().requires_grad_()
            got = torch.compile(block, backend="eager")(x_graph, position_ids=positions)
            got.square().sum().backward()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(x_graph.grad, x_eager.grad, rtol=1e-5, atol=1e-6)


# ---- the overlapped order of the exchange in head groups ----
# A pass (forward or backward) as the events it ran: ("start", key) when an all-to-all is
# started, ("wait", key) when it is waited for, ("kernel", None) when a group's attention
# kernel (or its backward) begins.


def assert_overlapped(events: list[tuple[str, object]], what: str) -> None:
    """The order of a layer's exchange in 2 head groups that overlaps the kernel (forward; the
    backward is its mirror, with output gradients first): both groups' first exchanges start
    before the first kernel, the second group's is waited for after it, and an exchange (the
    first group's second) starts between the two kernels and is waited for after the second.
    An exchange that is started and waited for before the next kernel fails it."""
    at = {event: i for i, event in enumerate(events)}
    kernels = [i for i, (kind, _) in enumerate(events) if kind == "kernel"]
    assert len(kernels) == 2, f"{what}: {events}"
    first, second = kernels

    def started(lo: int, hi: int) -> list[object]:
        return [key for kind, key in events[lo:hi] if kind == "start"]

    early = started(0, first)
    assert len(early) >= 2, f"{what}: the second group's exchange waits for the first kernel"
    assert at["wait", early[1]] > first, f"{what}: waited for before the first kernel: {events}"
    between = started(first, second)
    assert between, f"{what}: nothing leaves during the second kernel: {events}"
    assert at["wait", between[0]] > second, f"{what}: waited for before the kernel: {events}"


def graph_events(gm: torch.fx.GraphModule) -> list[tuple[str, object]]:
    """An AOTAutograd graph's events: the softmax (or its backward) marks a group's kernel."""
    events: list[tuple[str, object]] = []
    for node in gm.graph.nodes:
        target = str(node.target)
        if "all_to_all_single" in target:
            events.append(("start", node.name))
        elif "wait_tensor" in target:
            events.append(("wait", node.args[0].name))
        elif "_softmax" in target:
            events.append(("kernel", None))
    return events


def code_events(code: str) -> list[tuple[str, object]]:
    """Inductor's generated code's events: its fused softmax kernels mark a group's kernel."""
    events: list[tuple[str, object]] = []
    for line in code.splitlines():
        line = line.strip()
        if re.match(r"\w+ = torch\.ops\._c10d_functional\.all_to_all_single\.", line):
            events.append(("start", line.split(" = ")[0]))
        elif m := re.match(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)", line):
            events.append(("wait", m.group(1)))
        elif re.match(r"cpp_fused__softmax\w*\(", line):
            events.append(("kernel", None))
    return events


def check_overlapped_order(rank: int, world: int) -> None:
    """A block's attention in 2 head groups runs in the overlapped order (assert_overlapped),
    forward and backward: eagerly (recorded at dist.all_to_all_single's start and its work's
    wait, and at the kernel), and compiled by inductor as compile_blocks compiles under
    context_parallel_chunks > 1 (read from the generated code)."""
    events: list[tuple[str, object]] = []

    class Kernel(torch.autograd.Function):
        """Identity that records where a group's kernel backward begins."""

        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            events.append(("kernel", None))
            return grad

    class Work:
        def __init__(self, work, key: int) -> None:
            self.work, self.key = work, key

        def wait(self):
            events.append(("wait", self.key))
            return self.work.wait()

    collective = dist.all_to_all_single

    def recorded(*args, **kwargs):
        key = sum(kind == "start" for kind, _ in events)
        events.append(("start", key))
        return Work(collective(*args, **kwargs), key)

    model = build_model(ModelConfig(**BASE), VOCAB, seed=3)
    apply_context_parallel(model, ProcessGroups(Topology(cp=world)), 2)
    block = model.layers[0]
    attend = block.attention._attend

    def kernel(*args):
        events.append(("kernel", None))
        return Kernel.apply(attend(*args))

    t = BASE["seq_length"] // world
    x = torch.randn(2, t, BASE["hidden_size"], requires_grad=True)
    positions = (torch.arange(t) + rank * t).expand(2, t)
    block.attention._attend = kernel
    dist.all_to_all_single = recorded
    try:
        y = block(x, position_ids=positions)
        assert_overlapped(list(events), "eager forward")
        events.clear()
        y.square().sum().backward()
        assert_overlapped(list(events), "eager backward")
    finally:
        dist.all_to_all_single = collective
        del block.attention._attend

    torch._dynamo.reset()
    compile_blocks(model, "inductor", overlap_comms=True)
    _, codes = run_and_get_code(lambda: block(x, position_ids=positions).sum().backward())
    assert len(codes) == 2, "one forward and one backward graph"
    assert_overlapped(code_events(codes[0]), "inductor forward")
    assert_overlapped(code_events(codes[1]), "inductor backward")

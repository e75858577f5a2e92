"""compile_blocks (neox/parallel/build.py): activation_memory_budget reaches torch.compile's
partitioner, so a compiled block keeps fewer activations and its gradients do not change."""

import pytest
import torch

from neox.config import ConfigError, load_dict
from neox.model import build_model
from neox.parallel.build import compile_blocks

TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
}
VOCAB = 128


def saved_bytes_and_grads(
    budget: float, backend: str = "aot_eager_decomp_partition", device: str = "cpu"
) -> tuple[int, list[torch.Tensor]]:
    """Bytes the compiled blocks save for backward, and the weight gradients. The default
    backend is the min-cut partitioner without code generation: quick on CPU, the same
    partition decisions as inductor's."""
    torch._dynamo.reset()
    cfg = load_dict(TINY).model
    model = build_model(cfg, VOCAB, seed=0).to(device)
    compile_blocks(model, backend, device, activation_memory_budget=budget)
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    logits.float().pow(2).mean().backward()
    return sum(saved), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "backend,device",
    [
        ("aot_eager_decomp_partition", "cpu"),
        pytest.param("inductor", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_budget_keeps_fewer_activations_and_the_same_gradients(backend, device):
    try:
        full, grads_full = saved_bytes_and_grads(1.0, backend, device)
        half, grads_half = saved_bytes_and_grads(0.5, backend, device)
        none, _ = saved_bytes_and_grads(0.0, backend, device)
    finally:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 1.0  # process-wide: back to torch's default
        torch._dynamo.reset()
    assert none < half < full
    for a, b in zip(grads_full, grads_half):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_budget_without_compilation_or_with_full_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="torch_compile is false"):
        load_dict({"activation_memory_budget": 0.5, "torch_compile": False})
    with pytest.raises(ConfigError, match="set checkpoint_activations: false"):
        load_dict({"activation_memory_budget": 0.5, "checkpoint_activations": True})
    assert load_dict({"activation_memory_budget": 0.5}).training.activation_memory_budget == 0.5


def test_every_block_compiles_when_each_needs_its_own_graph(monkeypatch):
    """ZeRO-3 numbers every parameter (ds_id) and DeepSpeed's linear reads the number, which
    dynamo guards on as a constant (seen on an H100): each block then needs its own entry in
    Block.forward's one dynamo cache, and past the recompile limit (8) the rest ran eagerly,
    16 of Pythia-1.4B's 24 blocks. Here a linear that reads such a number does the same."""
    import torch._dynamo.config as dynamo_config
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    plain = F.linear

    def numbered_linear(x, weight, bias=None):
        if getattr(weight, "ds_id", 0) < 0:  # an int attribute: a guard on its value
            raise AssertionError
        return plain(x, weight, bias)

    monkeypatch.setattr(F, "linear", numbered_linear)
    torch._dynamo.reset()
    counters.clear()
    layers = 11
    model = build_model(load_dict({**TINY, "num_layers": layers}).model, VOCAB, seed=0)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with dynamo_config.patch(recompile_limit=8), torch.no_grad():  # compile_blocks raises it
        compile_blocks(model, "eager")
        model(tokens)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= layers, f"{graphs} graphs for {layers} blocks: some ran eagerly"


@pytest.mark.slow
def test_compiled_pipeline_runs_its_head_inside_the_loss():
    """The last stage's head moves into its compiled loss_fn: the same loss and gradients, the
    same layers saved in checkpoints (tests/parallel/vocab_loss_helpers.py)."""
    from tests.parallel.rank_helpers import run_ranks
    from tests.parallel.vocab_loss_helpers import check_compiled_pipeline_loss

    run_ranks(check_compiled_pipeline_loss, 2)

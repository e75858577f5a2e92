"""On 2 gloo ranks: each HF family model, converted to neox, computes transformers' logits when
split over tp=2 (apply_tensor_parallel) and over pp=2 stages (to_pipeline, hidden states passed
between the stages by hand); q/k norm gradients under tp=2 equal the dense model's."""

import copy

import torch
import torch.distributed as dist

from neox.checkpoint.writer import pipeline_layers, shard_tensor_parallel
from neox.model import lm_loss
from neox.parallel.build import parallelize
from neox.parallel.mappings import gather_from_tensor_parallel
from neox.parallel.pipeline import to_pipeline
from neox.parallel.tensor import apply_tensor_parallel
from neox.parallel.topology import Topology
from tests.hf_family_helpers import PADDED, VOCAB, neox_pair, token_ids

ATOL = 1e-4


def check_tensor_parallel(name: str) -> None:
    _, cfg, model, hf = neox_pair(name)
    ids = token_ids()
    with torch.no_grad():
        expected = hf(ids).logits
    groups = Topology(tp=2).build_groups()
    copied = apply_tensor_parallel(copy.deepcopy(model), groups, cfg, copy_weights=True)
    # The training path: built on meta, sharded, materialised, then the weights loaded.
    tp_model = parallelize(cfg, PADDED, groups)
    rank = groups.get_tensor_model_parallel_rank()
    tp_model.load_state_dict(shard_tensor_parallel(model.state_dict(), 2)[rank])
    for built in (copied, tp_model):
        with torch.no_grad():
            logits = gather_from_tensor_parallel(built(ids), groups.tensor)[..., :VOCAB]
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    if cfg.use_qk_layernorm:
        # Each rank's q/k norm sees half the heads; the summed gradient is the dense one.
        model.train(), tp_model.train()
        lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        tp_model(ids[:, :-1], labels=ids[:, 1:]).backward()
        for norm in ("q_layernorm", "k_layernorm"):
            dense = getattr(model.layers[1].attention, norm).weight.grad
            split = getattr(tp_model.layers[1].attention, norm).weight.grad
            torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-6)


def check_pipeline(name: str) -> None:
    _, cfg, model, hf = neox_pair(name)
    ids = token_ids()
    groups = Topology(pp=2).build_groups()
    pipe = to_pipeline(cfg, PADDED, groups)
    layers = pipeline_layers(model.state_dict(), cfg.num_layers)
    for offset, layer in enumerate(pipe.forward_funcs):
        if hasattr(layer, "load_state_dict"):
            layer.load_state_dict(layers[pipe._local_start + offset])
    for tied in pipe.tied_modules.values():  # the tied head on the last stage
        tied.load_state_dict({k: v for k, v in layers[0].items() if k in tied.state_dict()})
    shape = (*ids.shape, cfg.hidden_size)
    with torch.no_grad():
        if pipe.stage_id == 0:
            dist.send(pipe(ids).contiguous(), dst=groups.topo.rank(1, 0, 0))
            return
        hidden = torch.empty(shape)
        dist.recv(hidden, src=groups.topo.rank(0, 0, 0))
        logits = pipe(hidden)[..., :VOCAB]
        torch.testing.assert_close(logits, hf(ids).logits, rtol=0, atol=ATOL)


def run(rank: int, world: int, names: list[str]) -> None:

    from neox.parallel.distributed import start_deepspeed_comm

    start_deepspeed_comm("gloo")
    for name in names:
        check_tensor_parallel(name)
        check_pipeline(name)

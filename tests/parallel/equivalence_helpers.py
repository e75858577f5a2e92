"""Train a tiny GPTNeoX for a few Adam steps under a parallel layout; record the losses.

`reference_losses` is the dense single-process run (plain model, torch Adam, no DeepSpeed);
`run_cases` runs on every rank of a gloo world, builds each case through neox.parallel and the
real DeepSpeed engine, and writes <out_dir>/<case>.json with the per-step losses.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from neox.config.model import ModelConfig

VOCAB, SEQ, BATCH, STEPS, LR, CLIP, SEED = 128, 16, 4, 5, 1e-3, 0.5, 1234

# A: tied embeddings, learned positions, grouped-query attention, gelu.
# B: untied head, rotary, multi-head attention, swiglu, parallel residual.
MODELS = {
    "A": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=SEQ),
    "B": dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ,
        pos_emb="rotary",
        no_weight_tying=True,
        activation="swiglu",
        gpt_j_residual=True,
    ),
    # C: Llama-style: RMSNorm, SwiGLU, grouped-query attention, rotary, untied head.
    "C": dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        seq_length=SEQ,
        pos_emb="rotary",
        norm="rmsnorm",
        activation="swiglu",
        no_weight_tying=True,
        use_bias_in_attn_linear=False,
        use_bias_in_mlp=False,
    ),
}

# name -> layout, ZeRO stage, features; world size = tp * pp * dp.
# Pipeline cases use ZeRO-1: DeepSpeed 0.19's fp32 pipeline path clips with runtime.utils
# clip_grad_norm_, which keeps only model-parallel rank 0's replicated parameters (stage 0's)
# in the norm, so without ZeRO a clipped pipeline run drifts from the dense one (~4e-5 by step 2);
# train.py's adapter replaces that clip (tests/parallel/test_stock_layouts.py), this worker not.
CASES = {
    "tp2": dict(model="A", tp=2, pp=1, dp=1, zero=0, checkpoint=True, partition=True),
    "pp2": dict(model="A", tp=1, pp=2, dp=1, zero=1, checkpoint=True),
    "dp2_zero1": dict(model="A", tp=1, pp=1, dp=2, zero=1),
    "dp2_zero2": dict(model="A", tp=1, pp=1, dp=2, zero=2),
    "dp2_zero3": dict(model="A", tp=1, pp=1, dp=2, zero=3),
    "tp2_pp2": dict(model="B", tp=2, pp=2, dp=1, zero=1),
    "tp2_dp2_zero1": dict(model="B", tp=2, pp=1, dp=2, zero=1),
    # Sequence parallelism (sp): the same losses as the dense run, with activation checkpointing
    # (its recompute re-runs the collectives; partition_activations is turned off), ZeRO-3 and compiled blocks (aot_eager: the
    # functional collectives traced, no C compiler needed).
    "tp2_sp": dict(model="A", tp=2, pp=1, dp=1, zero=0, checkpoint=True, partition=True, sp=True),
    "tp2_sp_llama_zero3": dict(model="C", tp=2, pp=1, dp=1, zero=3, sp=True),
    "tp2_sp_zero2": dict(model="B", tp=2, pp=1, dp=1, zero=2, sp=True),
    "tp2_sp_llama_compiled": dict(model="C", tp=2, pp=1, dp=1, zero=1, sp=True, compile=True),
    "tp2_pp2_sp": dict(model="C", tp=2, pp=2, dp=1, zero=1, checkpoint=True, sp=True),
    # Compiled, the loss with the head as one graph: the plain tp model's (tied head), and the
    # last pipeline stage's loss_fn with the head moved into it (tied: the embedding's weight;
    # untied under sequence parallelism: the head saving its chunk).
    "tp2_compiled": dict(model="A", tp=2, pp=1, dp=1, zero=1, compile=True),
    "pp2_compiled": dict(model="A", tp=1, pp=2, dp=1, zero=1, compile=True),
    "tp2_pp2_sp_compiled": dict(model="C", tp=2, pp=2, dp=1, zero=1, sp=True, compile=True),
    "tp2_dp2_zero1_sp": dict(model="B", tp=2, pp=1, dp=2, zero=1, sp=True),
}


def batches():
    """STEPS x two alternating fixed batches: ids (B, T), next-token labels, loss mask."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        mask = torch.ones(BATCH, SEQ)
        mask[:, -2:] = 0  # same count per sample, so mean of per-rank means is the global mean
        out.append((tokens[:, :-1], tokens[:, 1:], mask))
    return [out[i % 2] for i in range(STEPS)]


def reference_losses(model: str) -> list[float]:
    """Dense single-process run: plain model, torch Adam, clip_grad_norm_."""
    from neox.model import build_model, lm_loss

    torch.manual_seed(SEED)
    net = build_model(ModelConfig(**MODELS[model]), VOCAB, seed=SEED)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses = []
    for ids, labels, mask in batches():
        loss = lm_loss(net(ids), labels, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _ds_config(case: dict) -> dict:
    from neox.config.ds_config import SEQUENCE_PARALLEL_PIPELINE

    gas = 2 if case["pp"] > 1 else 1  # the pipeline runs two micro-batches per step
    pipeline = {"pipeline": SEQUENCE_PARALLEL_PIPELINE} if case.get("sp") else {}
    return {
        **pipeline,
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // case["dp"] // gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": case["zero"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _run_case(case: dict) -> list[float]:
    import deepspeed

    from neox.parallel.build import engine_mpu, parallelize, pipeline_batch
    from neox.parallel.topology import ProcessGroups, Topology

    topo = Topology(case["tp"], case["pp"], case["dp"])
    groups = ProcessGroups(topo, sequence_parallel=case.get("sp", False))
    cfg = ModelConfig(**MODELS[case["model"]])
    model = parallelize(
        cfg,
        VOCAB,
        groups,
        SEED,
        checkpoint_activations=case.get("checkpoint", False),
        checkpoint_num_layers=2 if case["pp"] == 1 else 1,
        partition_activations=case.get("partition", False),
        torch_compile=case.get("compile", False),
        torch_compile_backend="aot_eager",
    )
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=_ds_config(case), mpu=engine_mpu(model, groups)
    )
    dp, d = case["dp"], groups.get_data_parallel_rank()
    losses = []
    for ids, labels, mask in batches():
        part = slice(d * BATCH // dp, (d + 1) * BATCH // dp)  # this replica's samples
        ids, labels, mask = ids[part], labels[part], mask[part]
        if case["pp"] > 1:
            micro = [pipeline_batch(*t) for t in zip(ids.chunk(2), labels.chunk(2), mask.chunk(2))]
            loss = engine.train_batch(data_iter=iter(micro))
        else:
            loss = engine(ids, None, None, labels, mask)
            engine.backward(loss)
            engine.step()
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=groups.data)
            loss /= dp
        losses.append(loss.item())
    return losses


def run_cases(rank: int, world: int, names: list[str], out_dir: str) -> None:
    """Every rank runs every named case in turn; rank 0 writes <out_dir>/<name>.json."""

    from neox.parallel.distributed import start_deepspeed_comm

    start_deepspeed_comm("gloo")
    linear = torch.nn.functional.linear
    for name in names:
        case = CASES[name]
        assert case["tp"] * case["pp"] * case["dp"] == world, name
        losses = _run_case(case)
        # Each case as in its own train.py process: DeepSpeed's ZeRO-3 replaces F.linear with its
        # autograd Function for the rest of the process, which torch 2.11 traced wrongly in the
        # compiled blocks of the cases after it (pp2_compiled, docs/benchmarks.md, 2026-11-29).
        torch.nn.functional.linear = linear
        torch._dynamo.reset()
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(losses))


if __name__ == "__main__":  # under a launcher: RANK/WORLD_SIZE in the environment
    import sys

    dist.init_process_group("gloo")
    run_cases(dist.get_rank(), dist.get_world_size(), sys.argv[2:], sys.argv[1])
    os._exit(0)

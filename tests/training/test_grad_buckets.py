"""overlap_comm in the flat engine (neox/training/grad_buckets.py): buckets reduced during the
backward train exactly as the step's one reduction does, launch during the backward, and in one
order on every rank, also when a parameter gets no gradient on one of them."""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neox.training.grad_buckets import bucket_bounds

VOCAB = 64


def test_buckets_are_runs_of_whole_parameters_cut_from_the_end():
    assert bucket_bounds([5, 3, 4, 2], 6) == [(0, 1), (1, 2), (2, 4)]
    assert bucket_bounds([5, 3, 4, 2], 100) == [(0, 4)]
    # A parameter larger than a bucket is a bucket alone; the first bucket holds what is left.
    assert bucket_bounds([2, 2, 9, 1, 1], 4) == [(0, 2), (2, 3), (3, 5)]
    assert bucket_bounds([7], 1) == [(0, 1)]


class Stack(nn.Module):
    """Embedding, residual tanh layers and a head; the layers in `skip` are left out of the
    forward, so their parameters get no gradient."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)
        self.skip: set[int] = set()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def flat_engine(model, groups, accum, overlap, bucket_size, **settings):
    from neox.training.flat_engine import FlatEngine, FlatSettings
    from neox.training.optim import param_groups

    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    config = FlatSettings(
        micro_batch=2,
        grad_accum=accum,
        clip=0.05,
        overlap_comm=overlap,
        reduce_bucket_size=bucket_size,
        **settings,
    )
    return FlatEngine(config, model, opt, groups)


class Launches:
    """Every bucket collective the engine issues (dist.all_reduce, called through), as the
    bucket's index in the engine's launch order."""

    def __init__(self, engine) -> None:
        self.engine, self.seen = engine, []
        self.real = dist.all_reduce

    def __enter__(self):
        def all_reduce(tensor, *args, **kwargs):
            if kwargs.get("async_op"):
                ptrs = [b.grad.data_ptr() for b in self.engine.buckets.buckets]
                self.seen.append(ptrs.index(tensor.data_ptr()))
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        text = torch.randint(0, VOCAB, (2, 17), generator=g)
        yield text[:, :-1], text[:, 1:]


def weights(engine):
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def check_unused_layer_and_launch_order(rank: int, groups) -> None:
    """The Stack, 2 accumulation steps, a bucket per weight: at step 2 rank 0 skips layer 1
    (its bucket cannot complete there), at step 3 both skip layer 3."""
    skips = {(1, 0): {1}, (1, 1): set(), (2, 0): {3}, (2, 1): {3}}
    runs = {}
    for overlap in (False, True):
        engine = flat_engine(Stack(), groups, 2, overlap, 100)
        losses, norms, launches = [], [], []
        with Launches(engine) as spy:
            for i, (tokens, labels) in enumerate(batches(8, seed=rank)):
                step = i // 2
                engine.module.skip = skips.get((step, rank), set())
                before = len(spy.seen)
                loss = engine(tokens, labels=labels)
                engine.backward(loss)
                during = spy.seen[before:]  # launched before backward returned
                engine.step()
                losses.append(loss.item())
                if i % 2 == 0:
                    assert not spy.seen[before:], "launched at a micro batch before the last"
                else:
                    norms.append(float(engine.get_global_grad_norm()))
                    launches.append((during, spy.seen[before:]))
        runs[overlap] = (losses, norms, weights(engine), launches, engine)
    plain, over = runs[False], runs[True]
    assert over[0] == plain[0] and over[1] == plain[1]
    assert all(torch.equal(over[2][k], plain[2][k]) for k in plain[2])
    engine, launches = over[4], over[3]
    assert plain[4].buckets is None and len(engine.buckets.groups) == 2  # weights and biases
    n = len(engine.buckets.buckets)
    for _, everything in launches:
        assert everything == list(range(n))  # one order, every bucket, once
    # Step 1: all in the backward; step 2 on rank 0: up to layer 1's weight bucket, the rest at
    # step(); step 3: up to layer 3's on both.
    first = [b.first for b in engine.buckets.buckets]
    position = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    layer1, layer3 = position["layers.1.weight"], position["layers.3.weight"]
    expected = [n, first.index(layer1) if rank == 0 else n, first.index(layer3)]
    assert [len(during) for during, _ in launches[:3]] == expected
    # Every rank issued the same collectives in the same order: each bucket's elements.
    issued = [[engine.buckets.buckets[i].grad.numel() for i in e] for _, e in launches]
    everyone = [None, None]
    dist.all_gather_object(everyone, issued)
    assert everyone[0] == everyone[1]


def check_gpt_train_batch_and_resume(rank: int, groups, out_dir: str) -> None:
    """The GPT model through train_batch (the loop's call), 2 accumulation steps, buckets of
    300 elements in both groups; then a checkpoint of the overlapped engine resumes exactly."""
    from neox.checkpoint.io import save_plain_state
    from neox.checkpoint.plain_state import PlainState
    from neox.model import build_model
    from tests.training.test_flat_engine import CFG, micro_batches

    model = build_model(CFG, VOCAB, seed=3)
    results = {}
    for overlap in (False, True):
        engine = flat_engine(model, groups, 2, overlap, 300)
        stream = micro_batches(seed=rank)
        steps = [engine.train_batch(stream) for _ in range(3)]
        results[overlap] = (
            [float(s.loss) for s in steps],
            [float(s.grad_norm) for s in steps],
            weights(engine),
        )
    assert len(engine.buckets.groups) == 2 and len(engine.buckets.buckets) > 10
    assert results[True][:2] == results[False][:2]
    assert all(torch.equal(results[True][2][k], w) for k, w in results[False][2].items())

    save_plain_state(engine, Path(out_dir), {"iteration": 3})
    dist.barrier()
    going_on = [float(engine.train_batch(stream).loss) for _ in range(2)]
    second = flat_engine(build_model(CFG, VOCAB, seed=77), groups, 2, True, 300)
    second.load_plain(PlainState(out_dir), load_optimizer_states=True)
    resumed_stream = micro_batches(seed=rank)
    for _ in range(3 * 2):
        next(resumed_stream)
    assert [float(second.train_batch(resumed_stream).loss) for _ in range(2)] == going_on
    assert all(torch.equal(w, second.module.state_dict()[k]) for k, w in weights(engine).items())


def run_checks(rank: int, world: int, out_dir: str) -> None:
    from neox.parallel.topology import Topology

    groups = Topology(1, 1, world).build_groups()
    # Reduced in another dtype than the gradients' own: after the backward, as without overlap.
    assert flat_engine(Stack(), groups, 1, True, 100, comm_dtype="bf16").buckets is None
    check_unused_layer_and_launch_order(rank, groups)
    check_gpt_train_batch_and_resume(rank, groups, out_dir)
    # A second backward before step(): gradients would land in buckets already reduced.
    engine = flat_engine(Stack(), groups, 1, True, 100)
    tokens, labels = next(batches(1, seed=rank))
    engine.backward(engine(tokens, labels=labels))
    with pytest.raises(RuntimeError, match="set zero_optimization.overlap_comm: false"):
        engine.backward(engine(tokens, labels=labels))
    engine.buckets.finish()


def test_one_rank_has_nothing_to_overlap():
    """overlap_comm on one rank: no buckets, no hooks; the step trains as without it."""
    engine = flat_engine(Stack(), None, 1, True, 100)
    assert engine.buckets is None
    before = weights(engine)
    tokens, labels = next(batches(1, seed=0))
    engine.backward(engine(tokens, labels=labels))
    engine.step()
    assert not torch.equal(before["head.weight"], engine.module.head.weight)


@pytest.mark.slow
def test_overlapped_reduction_trains_as_the_step_reduction_on_two_ranks(tmp_path):
    from tests.parallel.rank_helpers import run_ranks

    run_ranks(run_checks, 2, str(tmp_path))

"""eval.py's work on one rank: load the checkpoint, score each configured part, write the results.

Every rank holds the whole model and scores every world_size-th document; the sums are
all-reduced, so any number of data-parallel ranks gives the one-rank numbers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from neox.checkpoint.consolidate import load_model, resolve_checkpoint
from neox.config import ConfigError, NeoXConfig
from neox.config.derived import precision_of
from neox.inference.lambada import LambadaSums, lambada_metrics, score_lambada, split_last_word
from neox.inference.loading import generation_dtype
from neox.inference.perplexity import TextSums, score_texts, text_metrics
from neox.model import GPTNeoX
from neox.prep.readers import InputError, iter_documents
from neox.tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger(__name__)


def load_eval_model(
    load: str,
    iteration: Optional[int],
    device: torch.device,
    dtype: torch.dtype,
    trust: bool = False,
    allow_unverified: bool = False,
) -> tuple[GPTNeoX, str]:
    """The whole model of checkpoint `iteration` (None: latest) in `load`, whatever layout
    trained it, and the checkpoint's tag (trust: trust_checkpoint_code)."""
    tag_dir = resolve_checkpoint(load, iteration, allow_unverified=allow_unverified)
    model, _ = load_model(
        tag_dir, device=device, dtype=dtype, trust=trust, allow_unverified=allow_unverified
    )
    return model, tag_dir.name


def split_documents_of(cfg: NeoXConfig, split: str) -> Iterator[np.ndarray]:
    """Token ids of every document of the valid or test split of the config's data."""
    from neox.data.indexed import IndexedDataset
    from neox.data.loader import split_documents

    d = cfg.data
    if d.data_path:
        indexed = IndexedDataset(d.data_path)
        which = {"valid": 1, "test": 2}[split]
        for i in split_documents(d.split, len(indexed.sizes))[which]:
            yield indexed[int(i)]
        return
    paths = getattr(d, f"{split}_data_paths") or []
    for prefix in paths:
        indexed = IndexedDataset(prefix)
        for i in range(len(indexed.sizes)):
            yield indexed[i]


def split_texts(cfg: NeoXConfig, split: str, tokenizer: Tokenizer) -> Iterator[tuple[list, int]]:
    """(ids, UTF-8 bytes of their decoded text) of the split's documents, EOD tokens dropped."""
    for tokens in split_documents_of(cfg, split):
        ids = [int(t) for t in tokens if t != tokenizer.eod]
        yield ids, len(tokenizer.decode(ids).encode("utf-8"))


def file_texts(path: str, key: str) -> Iterator[str]:
    """Document texts of a jsonl / jsonl.zst / txt file (a bad line is an error naming it)."""
    for doc in iter_documents(path, keys=(key,), strict=True):
        yield doc[key]


def take_shard(items, limit: Optional[int], rank: int, world: int) -> list:
    """This rank's share (every world-th item) of the first `limit` items."""
    shard = []
    for i, item in enumerate(items):
        if limit is not None and i >= limit:
            break
        if i % world == rank:
            shard.append(item)
    return shard


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def results_path(cfg: NeoXConfig) -> Path:
    """<log_dir>/<eval_results_prefix>_eval_results_<time>.json, as gpt-neox names it."""
    prefix = cfg.eval.eval_results_prefix
    name = f"{prefix}_eval_results" if prefix else "eval_results"
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
    return Path(cfg.logging.log_dir or ".") / f"{name}_{stamp}.json"


def write_results(path: Path, results: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
    return path


def evaluate_parts(
    cfg: NeoXConfig,
    model: GPTNeoX,
    tokenizer: Tokenizer,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
) -> dict[str, Any]:
    """Metrics of every part eval.py is configured for, keyed by part."""
    e = cfg.eval
    max_len = model.cfg.seq_length
    stride = e.eval_stride or max_len
    if stride > max_len:
        raise ConfigError(f"eval_stride={stride} exceeds seq_length={max_len}; lower eval_stride")
    common = dict(max_len=max_len, batch_size=e.eval_batch_size, device=device)
    results: dict[str, Any] = {}
    text_parts = []
    if e.eval_split:
        text_parts.append((e.eval_split, split_texts(cfg, e.eval_split, tokenizer)))
    if e.eval_input_file:
        encoded = (
            (tokenizer.encode(t), len(t.encode("utf-8")))
            for t in file_texts(e.eval_input_file, e.eval_text_key)
        )
        text_parts.append(("eval_input_file", encoded))
    for name, docs in text_parts:
        mine = take_shard(docs, e.eval_limit, rank, world)
        sums = score_texts(model, mine, eod=tokenizer.eod, stride=stride, **common)
        results[name] = text_metrics(TextSums.from_list(all_reduce_sums(sums.as_list(), device)))
        if rank == 0:  # every rank holds the same reduced sums; eval.py prints them all at the end
            log.debug("%s: %s", name, results[name])
    if e.eval_lambada_file:
        texts = take_shard(
            file_texts(e.eval_lambada_file, e.eval_text_key), e.eval_limit, rank, world
        )
        for t in texts:  # a malformed passage fails before any scoring
            try:
                split_last_word(t)
            except ValueError as err:
                raise InputError(f"eval_lambada_file={e.eval_lambada_file!r}: {err}") from None
        sums = score_lambada(model, tokenizer, texts, **common)
        results["lambada"] = lambada_metrics(
            LambadaSums.from_list(all_reduce_sums(sums.as_list(), device))
        )
        if rank == 0:
            log.debug("lambada: %s", results["lambada"])
    if e.eval_tasks:
        from neox.inference.lm_eval_adapter import run_lm_eval_tasks

        results["lm_eval"] = run_lm_eval_tasks(model, tokenizer, cfg, device, rank, world)
    return results


def run_evaluation(cfg: NeoXConfig) -> Optional[tuple[Path, dict[str, Any]]]:
    """The whole eval.py job on this rank; rank 0 writes the results file and returns it with
    the results (other ranks return None)."""
    from neox.parallel.distributed import init_distributed

    device = init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tag = load_eval_model(
        cfg.checkpoint.load,
        cfg.training.iteration,
        device,
        generation_dtype(precision_of(cfg), device),
        trust=cfg.checkpoint.trust_checkpoint_code,
        allow_unverified=cfg.checkpoint.allow_unverified_checkpoint,
    )
    t = cfg.tokenizer
    tokenizer = build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but checkpoint {cfg.checkpoint.load} "
            f"has {model.vocab_size} embedding rows; use the tokenizer the model was trained with"
        )
    results = evaluate_parts(cfg, model, tokenizer, device, rank, world)
    if rank != 0:
        return None
    e = cfg.eval
    record = {
        "checkpoint": cfg.checkpoint.load,
        "tag": tag,
        "ranks": world,
        "seq_length": model.cfg.seq_length,
        "eval_stride": e.eval_stride or model.cfg.seq_length,
        "eval_limit": e.eval_limit,
        "results": results,
    }
    return write_results(results_path(cfg), record), results  # eval.py prints both

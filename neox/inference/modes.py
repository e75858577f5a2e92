"""generate.py's three prompt sources (text_gen_type): unconditional, input-file, interactive."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from neox.config import ConfigError, NeoXConfig, derive
from neox.inference.decode_path import choose_decode_path, decode_steps
from neox.inference.generator import Completion, DecodeStats, Generator
from neox.inference.loading import build_generation_model, generation_dtype
from neox.inference.sampling import SamplingParams
from neox.parallel.topology import ProcessGroups
from neox.tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger(__name__)

INTERACTIVE_PROMPT = "Context prompt >>> "


class TextGenerator:
    """Text in, rows out: tokenises prompts, batches them and decodes the continuations."""

    def __init__(
        self,
        cfg: NeoXConfig,
        generator: Generator,
        tokenizer: Tokenizer,
        batch_size: int,
        replica: int = 0,
    ) -> None:
        g = cfg.generation
        self.cfg = cfg
        self.generator = generator
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.params = SamplingParams(g.temperature, g.top_k, g.top_p)
        # Data-parallel replicas sample different prompts' continuations from their own streams.
        seed = cfg.training.seed + replica
        self.rng = torch.Generator(device=generator.device).manual_seed(seed)
        self.max_positions = cfg.model.shape.max_positions

    def rows(self, contexts: list[str]) -> Iterator[dict[str, Any]]:
        """One output row per context, generated batch_size prompts at a time."""
        batches = -(-len(contexts) // self.batch_size)
        for index, start in enumerate(range(0, len(contexts), self.batch_size), 1):
            batch = contexts[start : start + self.batch_size]
            t0 = time.perf_counter()
            prompts = [self._encode(text) for text in batch]
            new = self._budget(max(len(p) for p in prompts))
            called = time.time()
            done = self.generator.generate(
                prompts, new, self.params, self.rng, self.cfg.generation.return_logits
            )
            speed = self._speed(done, time.perf_counter() - t0)
            log.info(
                "batch %d/%d: %d prompts, %d new tokens in %.3f s (%.1f tokens/s), prefill %.1f ms",
                index,
                batches,
                len(batch),
                sum(len(c.tokens) for c in done),
                speed["duration_seconds"],
                speed["tokens_per_second"],
                speed["prefill_seconds"] * 1e3,
            )
            if index == 1:
                log_first_token(called, self.generator.last_stats)
            for text, completion in zip(batch, done):
                yield self._row(text, completion, speed)

    def _speed(self, done: list[Completion], seconds: float) -> dict[str, float]:
        """The batch's timing fields of each row: wall clock of the batch (tokenising included),
        its prompts' forward pass, and its generated tokens (all rows) per second."""
        stats = self.generator.last_stats
        return {
            "duration_seconds": seconds,
            "prefill_seconds": stats.prefill_seconds if stats is not None else 0.0,
            "tokens_per_second": sum(len(c.tokens) for c in done) / max(seconds, 1e-9),
        }

    def _encode(self, text: str) -> list[int]:
        # No context: generation starts from a document boundary (gpt-neox's unconditional).
        ids = self.tokenizer.encode(text) if text else [self.tokenizer.eod]
        limit = self.max_positions - 1
        if len(ids) > limit:
            log.warning("prompt of %d tokens keeps its last %d (max_positions)", len(ids), limit)
            ids = ids[-limit:]
        return ids

    def _budget(self, prompt_len: int) -> int:
        new = self.cfg.generation.maximum_tokens
        room = self.max_positions - prompt_len
        if new > room:
            log.warning(
                "maximum_tokens=%d cut to %d: prompt (%d tokens) + continuation must fit "
                "max_position_embeddings=%d",
                new,
                room,
                prompt_len,
                self.max_positions,
            )
        return min(new, room)

    def _row(self, context: str, c: Completion, speed: dict[str, float]) -> dict[str, Any]:
        row = {
            "context": context,
            "text": self.tokenizer.decode(c.tokens),
            "length": len(c.tokens),
            "finished": c.finished,
            "tokens": c.tokens,
            **speed,
        }
        if c.logits is not None:
            row["logits"] = c.logits
        return row


def read_prompts(path: str, prompt_end: str) -> list[str]:
    """Prompts of sample_input_file, separated by prompt_end; blank ones are skipped."""
    text = Path(path).read_text(encoding="utf-8")
    return [p for p in text.split(prompt_end) if p.strip()]


def write_rows(rows: Iterator[dict[str, Any]], path: Optional[str]) -> int:
    """Rows as JSON lines; the file appears complete or not at all (written beside, renamed)."""
    lines = (json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    n = 0
    if path is None:
        for n, line in enumerate(lines, 1):  # noqa: B007 (n counts the rows)
            print(line, end="", flush=True)
        return n
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for n, line in enumerate(lines, 1):  # noqa: B007
            f.write(line)
            f.flush()
    tmp.replace(out)
    return n


def interactive(text_gen: TextGenerator, is_writer: bool) -> None:
    """Read a prompt on rank 0's terminal, generate on every rank, print; ends at EOF."""
    import torch.distributed as dist

    while True:
        box: list[Optional[str]] = [None]
        if is_writer:
            try:
                box[0] = input(INTERACTIVE_PROMPT)
            except EOFError:
                box[0] = None
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        for row in text_gen.rows([box[0]]):
            if is_writer:
                print(f"Generated Text: {row['text']}", flush=True)


def log_first_token(called: float, stats: Optional[DecodeStats]) -> None:
    """How long after this process started its first token was chosen (the time a user waits
    before anything is generated), and the first batch's setup within it."""
    import psutil

    if stats is None:
        return
    setup = stats.setup_seconds
    seconds = called - psutil.Process().create_time() + setup + stats.prefill_seconds
    log.info(
        "first token %.2f s after this process started (set-up of the first batch %.2f s, "
        "prefill %.1f ms)",
        seconds,
        setup,
        stats.prefill_seconds * 1e3,
    )


def fused_problem(cfg: NeoXConfig, padded_vocab: int) -> Optional[str]:
    """What of this model the fused decode step lacks (None: it takes it), read off the model's
    skeleton on the meta device before any weight is loaded."""
    from neox.inference.fused_step import FusedStep
    from neox.model import build_model

    try:
        return FusedStep.unsupported(build_model(cfg.model, padded_vocab, device="meta"))
    except ImportError as e:  # no Triton
        return f"this install ({e})"


def job_prompts(cfg: NeoXConfig) -> Optional[list[str]]:
    """The job's prompts (unconditional: empty contexts), None in interactive mode."""
    g = cfg.generation
    if g.text_gen_type == "interactive":
        return None
    if g.text_gen_type == "unconditional":
        return [""] * g.num_samples
    return read_prompts(g.sample_input_file, g.prompt_end)


def run_generation(cfg: NeoXConfig) -> None:
    """generate.py on one rank: load the trained model, then generate per text_gen_type."""
    import torch.distributed as dist

    from neox.parallel.distributed import init_distributed
    from neox.parallel.topology import Topology

    g = cfg.generation
    if g.text_gen_type == "input-file" and not g.sample_input_file:
        raise ConfigError("text_gen_type=input-file needs sample_input_file (one prompt per line)")
    device = init_distributed(cfg)
    world = dist.get_world_size()
    t = cfg.tokenizer
    tokenizer = build_tokenizer(t.tokenizer_type, t.vocab_file, t.merge_file)
    derived = derive(cfg, world, tokenizer.vocab_size)
    tp = derived.tensor_parallel
    # Pipeline stages run as one model here; data-parallel replicas split the prompts.
    groups = ProcessGroups(Topology(tp, 1, world // tp))
    dtype = generation_dtype(derived.precision, device)
    contexts = job_prompts(cfg)
    steps = None
    if contexts is not None:
        steps = decode_steps(len(contexts), world // tp, derived.micro_batch, g.maximum_tokens)
    path = choose_decode_path(
        device_type=device.type,
        tensor_parallel=tp,
        recompute=g.recompute,
        fused_decode=g.fused_decode,
        fused_problem=(
            fused_problem(cfg, derived.padded_vocab_size) if device.type == "cuda" else None
        ),
        torch_compile=cfg.training.torch_compile,
        batch=derived.micro_batch,
        steps=steps,
        moe=cfg.model.moe_num_experts > 1,
    )
    log.info(path.line)  # generate.py's first line: the step the job decodes through
    model, gather = build_generation_model(cfg, derived.padded_vocab_size, groups, device, dtype)
    # Batches of 1, 2 or 4 rows (a job's last, short batch too) take the fused step where the
    # model allows it; other batches the compiled step when path says so, else the eager one.
    fused_step = g.fused_decode and gather is None and device.type == "cuda"
    try:
        generator = Generator(
            model,
            tokenizer.vocab_size,
            tokenizer.eod,
            not g.recompute,
            gather_logits=gather,
            compile_step=path.compiled,
            fused_step=fused_step,
        )
    except ValueError as e:  # a model the KV cache cannot run
        raise ConfigError(str(e)) from None
    replica = groups.get_data_parallel_rank()
    text_gen = TextGenerator(cfg, generator, tokenizer, derived.micro_batch, replica)
    is_writer = dist.get_rank() == 0
    log.info(
        "generating (%s) on %s in %s, tp=%d, %s",
        g.text_gen_type,
        device,
        str(dtype).removeprefix("torch."),
        tp,
        "recompute" if g.recompute else "KV cache",
    )
    if contexts is None:
        interactive(text_gen, is_writer)
        return
    rows = generate_shared(text_gen, contexts, groups)
    if is_writer:
        n = write_rows(rows, g.sample_output_file)
        log.info("wrote %d samples to %s", n, g.sample_output_file or "stdout")
    else:
        for _ in rows:  # the other ranks take part in every forward
            pass
    sys.stdout.flush()


def generate_shared(
    text_gen: TextGenerator, contexts: list[str], groups: ProcessGroups
) -> Iterator[dict[str, Any]]:
    """Rows for all contexts, in order, on global rank 0; data-parallel replicas take every
    dp-th context and rank 0 gathers their rows at the end."""
    import torch.distributed as dist

    dp, dp_rank = groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()
    if dp == 1:
        yield from text_gen.rows(contexts)
        return
    mine = list(text_gen.rows(contexts[dp_rank::dp]))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return
    # Every tp rank of a replica holds the same rows: take the replica's tp rank 0.
    replicas = [gathered[groups.topo.rank(0, d, 0)] for d in range(dp)]
    for i in range(len(contexts)):
        yield replicas[i % dp][i // dp]

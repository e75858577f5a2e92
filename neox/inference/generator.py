"""Batched autoregressive generation: left-padded prompts, static KV cache or full recompute.

Decoding does not wait for the device token by token: the next token is chosen on the device and
written into a device buffer, and whether every row has ended is read only every
`stop_check_every` tokens. A row that ended keeps choosing the end-of-document id until then, and
the output is cut at each row's first one, so the tokens (and logits, and the sampling generator's
state after the call) are those of stopping at the first token where all rows had ended. With the
cache on a GPU each decode step replays as one CUDA graph (neox.inference.graphed), captured once
per batch shape and reused by later batches of the same shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import nn

from neox.inference.decode_compile import StepKernels, decode_backend
from neox.inference.fused_step import FusedStep
from neox.inference.graphed import CapturedStep
from neox.inference.sampling import SamplingParams, sample
from neox.model.kv_cache import KVCache
from neox.model.moe import MoE
from neox.model.rotary import RotaryEmbedding

log = logging.getLogger(__name__)

STOP_CHECK_EVERY = 16
"""Tokens between reads of "every row has ended": one host sync each; up to this many - 1
steps run past the end of the last row."""
SLOT_BUCKET = 64
"""Cache lengths are rounded up to a multiple of this, so batches whose prompt + budget differ a
little share one cache and one captured step."""


@dataclass
class Completion:
    """One prompt's continuation."""

    tokens: list[int]
    """Generated ids, without the end-of-document id that ended them."""
    finished: bool
    """True when the end-of-document token ended the sequence (not the token budget)."""
    logits: Optional[list[float]] = None
    """The raw logit of each generated token (return_logits)."""


@dataclass
class DecodeStats:
    """Where the last `generate` call's time went (seconds of wall clock, device work included)."""

    seconds: float
    """The whole call: setup (cache, graph capture), prefill, decode and the copy back."""
    prefill_seconds: float
    """The prompts' forward pass."""
    steps: int
    """Tokens chosen per row, including those past a row's end before the stop check saw it."""
    setup_seconds: float = 0.0
    """Before the prefill: the cache, and on a new batch shape the decode step's capture (and
    the fused step's tuning or the compiled step's compilation)."""


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, L), mask (B, L) True on real tokens): prompts right-aligned, so every row's next
    token goes to the same slot L."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use [eod] for no context)")
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, L - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, L - len(p) :] = True
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, L) counting real tokens only; left padding gets 0 (it is masked)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class DecodeState:
    """One batch's decode buffers for B rows and S cache slots. Shapes and addresses stay fixed
    for the life of the state, so a captured step can replay against them."""

    def __init__(self, batch: int, slots: int, device: torch.device) -> None:
        B, S = batch, slots
        self.tokens = torch.zeros((B, S), dtype=torch.long, device=device)
        """tokens[:, s]: the generated token that goes into cache slot s."""
        self.logits = torch.zeros((B, S), dtype=torch.float32, device=device)
        """Its raw logit (return_logits)."""
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.valid = torch.zeros((B, S), dtype=torch.bool, device=device)
        """Slots holding a real token's keys: the decode attention mask."""
        self.tok = torch.zeros(B, dtype=torch.long, device=device)
        """The newest token: the next step's input."""
        self.pos = torch.zeros((B, 1), dtype=torch.long, device=device)
        """Its position id."""
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        """Its cache slot."""

    def start(self, mask: torch.Tensor) -> None:
        """Ready for prompts with mask (B, L): the first generated token goes to slot L."""
        L = mask.shape[1]
        self.finished.zero_()
        self.valid.zero_()
        self.valid[:, :L] = mask
        self.pos.copy_(positions(mask)[:, -1:] + 1)
        self.slot.fill_(L)

    def scratch(self) -> None:
        """A state a captured step's warm-up may run from: it writes the cache at slot S - 2 and
        its token at S - 1, slots the caller masks until a step writes them for real."""
        self.finished.zero_()
        self.valid.zero_()
        self.tok.zero_()
        self.pos.zero_()
        self.slot.fill_(self.valid.shape[1] - 2)


@dataclass
class _Session:
    """A cache, its decode buffers and (on a GPU) the captured step, kept for the next batch."""

    key: tuple[Any, ...]
    cache: KVCache
    state: DecodeState
    step: Optional[CapturedStep]
    decode: Callable[..., Optional[torch.Tensor]]
    """The uncaptured step (cache, state, greedy): fused, compiled or eager."""


class Generator:
    """Generates continuations for batches of token-id prompts with one model.

    Args:
        gather_logits: maps this rank's last-position logits (B, V/tp) to the full (B, V);
            None without tensor parallelism (then decode steps may replay as CUDA graphs).
        use_cache: decode with the static KV cache; False recomputes the whole sequence each
            step (gpt-neox's `recompute`), which gives the same greedy tokens.
        cuda_graphs: replay each cached decode step as one CUDA graph (GPU, no tensor
            parallelism: its collectives stay outside graphs; no MoE layers).
        stop_check_every: tokens between host reads of "every row has ended" (1: every token).
        compile_step: run each cached decode step (the whole model, and the greedy choice)
            through torch.compile (inductor): fused kernels, ~10 per layer instead of ~30; each
            new batch shape compiles once (tens of seconds at 1B). The prefill and the
            recompute path stay eager.
        step_kernels: how the compiled step computes its one-row products
            (neox.inference.decode_compile): the library's kernels (cuBLAS, SDPA) by default.
        fused_step: batches of 1, 2 or 4 rows decode through neox.inference.fused_step (three
            Triton kernels a layer, no compilation) when the model allows it; other batches
            take the compiled or eager step.
    """

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        eod: int,
        use_cache: bool = True,
        gather_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        cuda_graphs: bool = True,
        stop_check_every: int = STOP_CHECK_EVERY,
        compile_step: bool = False,
        step_kernels: StepKernels = StepKernels(),
        fused_step: bool = False,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eod = eod
        unsupported = KVCache.supports(model) if use_cache else None
        if unsupported:
            raise ValueError(
                f"the KV cache does not support {unsupported}; set `recompute: true` to "
                "generate by recomputing the whole sequence each token"
            )
        if stop_check_every < 1:
            raise ValueError(f"stop_check_every={stop_check_every} must be >= 1")
        self.use_cache = use_cache
        self.gather_logits = gather_logits or (lambda x: x)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # MoE layers size their expert batches from the routing (a host read), which a CUDA
        # graph cannot capture: they decode uncaptured.
        moe = any(isinstance(m, MoE) for m in model.modules())
        self.cuda_graphs = (
            cuda_graphs and self.device.type == "cuda" and gather_logits is None and not moe
        )
        self.stop_check_every = stop_check_every
        self.last_stats: Optional[DecodeStats] = None
        """Timing of the last generate call."""
        self._session: Optional[_Session] = None
        self._compiled = None
        self._attention_reductions = False
        self._fused: Optional[FusedStep] = None
        if fused_step and use_cache:
            try:
                problem = FusedStep.unsupported(model)
            except ImportError as e:  # no Triton
                problem = f"this install ({e})"
            if problem:
                log.info("decode step not fused: the fused step does not support %s", problem)
            else:
                self._fused = FusedStep(model)
        if compile_step and use_cache:
            # The whole decode step (embedding, every block, head, greedy choice and the
            # bookkeeping) as one inductor graph: a few fused kernels per layer where eager runs
            # ~30, which is what bounds a captured step at batch 1. Shapes are static (one
            # compilation per batch shape and cache length, as for the captured graphs); the
            # prefill, a new length each batch, stays eager. Intermediates are rounded to the
            # model dtype where eager rounds them, so bf16 logits track the eager step's.
            options = {}
            if hasattr(torch._inductor.config, "emulate_precision_casts"):
                options["emulate_precision_casts"] = True
            self._compiled = torch.compile(
                self._decode, dynamic=False, backend=decode_backend(step_kernels, options)
            )
            self._attention_reductions = step_kernels.attention_reductions
            for module in model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.prepare(self.device)  # compiled steps read the table, not rebuild it

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        generator: Optional[torch.Generator] = None,
        return_logits: bool = False,
    ) -> list[Completion]:
        """Up to max_new_tokens for each prompt; a row stops at the end-of-document token."""
        t0 = time.perf_counter()
        ids, mask = left_pad(prompts, self.eod, self.device)
        B, L = ids.shape
        if max_new_tokens < 1:
            self.last_stats = DecodeStats(time.perf_counter() - t0, 0.0, 0)
            return [Completion([], False, [] if return_logits else None) for _ in prompts]
        if self.use_cache:
            padded = any(len(p) < L for p in prompts)
            state, prefill, step = self._cached(
                ids, mask, padded, max_new_tokens, params, generator
            )
        else:
            state, prefill, step = self._recomputed(ids, mask, max_new_tokens, params, generator)
        clock = _Clock(self.device)
        setup = clock.t0 - t0
        logits = prefill()
        clock.mark()
        self._choose(state, logits, params, generator)
        # The generator's state after each draw since the last stop check, to rewind to the
        # draw where every row had ended (later batches then sample as if stopped there).
        track = generator is not None and not params.greedy
        states = {1: generator.get_state()} if track else {}
        n = 1  # tokens chosen per row
        while n < max_new_tokens:
            if n % self.stop_check_every == 0:
                if bool(state.finished.all()):
                    break
                states.clear()
            step(n)
            n += 1
            if track:
                states[n] = generator.get_state()
        tokens = state.tokens[:, L : L + n]
        chosen = state.logits[:, L : L + n]
        out = self._completions(tokens, chosen, return_logits)  # the copy back syncs
        if track:
            ended = max(len(c.tokens) for c in out) + 1 if all(c.finished for c in out) else n
            if ended < n:
                generator.set_state(states[ended])
        self.last_stats = DecodeStats(time.perf_counter() - t0, clock.seconds(), n, setup)
        return out

    def _choose(
        self,
        state: DecodeState,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: Optional[torch.Generator],
    ) -> None:
        """The next token from last-position logits (B, V/tp) into state: at slot `state.slot`,
        the end-of-document id for rows that ended. Device work only (it may be captured)."""
        logits = self.gather_logits(logits)  # (B, V)
        tok = sample(logits, params, self.vocab_size, generator)
        tok = torch.where(state.finished, self.eod, tok)
        state.tokens.index_copy_(1, state.slot, tok[:, None])
        state.logits.index_copy_(1, state.slot, logits.gather(-1, tok[:, None]).float())
        state.finished |= tok == self.eod
        state.tok.copy_(tok)

    def _cached(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        padded: bool,
        max_new_tokens: int,
        params: SamplingParams,
        generator: Optional[torch.Generator],
    ) -> tuple[DecodeState, Callable[[], torch.Tensor], Callable[[int], None]]:
        """(state, prefill () -> last-position logits, step (n) choosing token n) with the cache."""
        B, L = ids.shape
        session = self._session_for(B, L + max_new_tokens, params.greedy)
        cache, state = session.cache, session.state
        state.start(mask)
        slots = torch.arange(L, device=self.device)

        def prefill() -> torch.Tensor:
            # Unpadded prompts attend as in training (causal SDPA); padding needs its mask.
            attn_mask = mask if padded else None
            kv = cache.at(slots, prefill=True)
            return self.model(ids, positions(mask), attn_mask, kv_cache=kv)[:, -1]

        captured = session.step
        if captured is not None and params.greedy:
            return state, prefill, lambda n: captured()
        if captured is not None:
            return state, prefill, lambda n: self._choose(state, captured(), params, generator)

        decode = session.decode

        def step(n: int) -> None:
            logits = decode(cache, state, params.greedy)
            if not params.greedy:
                self._choose(state, logits, params, generator)

        return state, prefill, step

    def _forward(self, cache: KVCache, state: DecodeState, fused: bool = False) -> torch.Tensor:
        """Feed state.tok at state.slot; advance position and slot; last-position logits."""
        state.valid.index_fill_(1, state.slot, True)
        if fused:
            logits = self._fused(state.tok, state.pos, cache, state.slot, state.valid)
        else:
            mask = state.valid[:, None, None, :]  # (B, 1, 1, S): the slots a query may see
            tok = state.tok[:, None]
            logits = self.model(tok, state.pos, mask, kv_cache=cache.at(state.slot))[:, -1]
        state.pos.add_(1)
        state.slot.add_(1)
        return logits

    def _decode(
        self, cache: KVCache, state: DecodeState, greedy: bool, fused: bool = False
    ) -> Optional[torch.Tensor]:
        """One cached decode step: greedy, the next token chosen into state (None returned);
        else the logits, for the caller to sample from its generator."""
        logits = self._forward(cache, state, fused)
        if not greedy:
            return logits
        if fused and self._fused.greedy_kernel:
            self._fused.choose_greedy(logits, state, self.vocab_size, self.eod)
        else:
            self._choose(state, logits, SamplingParams(), None)
        return None

    def fused_for(self, batch: int) -> bool:
        """Whether a batch of `batch` rows decodes through the fused step."""
        return self._fused is not None and FusedStep.takes(batch)

    def _session_for(self, batch: int, length: int, greedy: bool) -> _Session:
        """The cache and buffers for `batch` rows of `length` slots (rounded up to the bucket),
        with a captured step on a GPU: the last call's when its shape fits."""
        S = -(-length // SLOT_BUCKET) * SLOT_BUCKET
        key = (batch, S, greedy)
        if self._session is not None and self._session.key == key:
            return self._session
        self._session = None  # free the old cache (and graph memory) first
        cache = KVCache(self.model, batch, S, self.dtype, self.device)
        # At batch 1 only: there the written-out attention beat SDPA's kernel (0.93 against
        # 0.98 ms a 410M step on an H100), at batch 16 it lost (1.43 against 1.31 ms).
        reductions = self._compiled is not None and self._attention_reductions
        cache.attention_reductions = reductions and batch == 1
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                # Positions up to S - 1, past max_positions for a RoPE-scaled model; built
                # here, never inside a captured step.
                module.prepare(self.device, S, self.dtype)
        state = DecodeState(batch, S, self.device)
        fused = self.fused_for(batch)

        def chosen() -> Callable[..., Optional[torch.Tensor]]:
            return partial(self._decode, fused=True) if fused else self._compiled or self._decode

        captured = None
        if self.cuda_graphs:

            def capture() -> CapturedStep:
                decode = chosen()
                return CapturedStep(
                    lambda: decode(cache, state, greedy), state.scratch, self.device
                )

            while captured is None:
                try:
                    captured = capture()
                except Exception as e:  # noqa: BLE001 (fused and compiled steps are optimisations)
                    if fused:  # e.g. a Triton too old for a kernel: the other steps remain
                        log.warning("decode step not fused (%s: %s)", type(e).__name__, e)
                        self._fused, fused = None, False
                        continue
                    if self._compiled is None:
                        raise
                    log.warning(
                        "decode step not compiled (%s: %s); running it eagerly",
                        type(e).__name__,
                        e,
                    )
                    self._compiled = None
                    cache.attention_reductions = False
        self._session = _Session(key, cache, state, captured, chosen())
        return self._session

    def _recomputed(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        generator: Optional[torch.Generator],
    ) -> tuple[DecodeState, Callable[[], torch.Tensor], Callable[[int], None]]:
        """The whole sequence through the model each step: no cache, any position scheme."""
        B, L = ids.shape
        state = DecodeState(B, L + max_new_tokens, self.device)
        state.start(mask)

        def prefill() -> torch.Tensor:
            return self.model(ids, positions(mask), mask)[:, -1]

        def step(n: int) -> None:
            seq = torch.cat((ids, state.tokens[:, L : L + n]), dim=1)
            seq_mask = torch.cat((mask, mask.new_ones(B, n)), dim=1)
            logits = self.model(seq, positions(seq_mask), seq_mask)[:, -1]
            state.slot.add_(1)
            self._choose(state, logits, params, generator)

        return state, prefill, step

    def _completions(
        self, tokens: torch.Tensor, logits: torch.Tensor, return_logits: bool
    ) -> list[Completion]:
        out = []
        for row, row_logits in zip(tokens.tolist(), logits.tolist()):
            end = row.index(self.eod) if self.eod in row else len(row)
            out.append(
                Completion(
                    tokens=row[:end],
                    finished=end < len(row),
                    logits=row_logits[:end] if return_logits else None,
                )
            )
        return out


class _Clock:
    """Times the prefill without a host sync: CUDA events read after the call's final copy back
    (which waits for them); the host clock elsewhere, where work is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        self.t0 = self.t1 = time.perf_counter()

    def mark(self) -> None:
        if self.cuda:
            self.end.record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self.begin.elapsed_time(self.end) / 1e3
        return self.t1 - self.t0

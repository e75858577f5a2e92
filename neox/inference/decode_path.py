"""Which decode step generate.py runs, chosen from the device, the layout and the job's shape.

The measured order on a GPU without tensor parallelism (docs/benchmarks.md, "Generation"):
- batches of 1, 2 or 4 rows: the fused step (Triton kernels, a CUDA graph) is fastest and needs
  no compilation; its tile sizes are tuned once per shape and kept on disk (Triton's autotune
  cache), so only a machine's first process pays the tuning;
- larger batches: the compiled step is faster per token (1.9x the captured eager step at
  Pythia-410M, batch 16) but each batch shape compiles first. It is taken when the job's decode
  steps are enough to pay the compilation back; else the captured eager step.
`torch_compile: true` compiles whatever the job's size, `false` never; `fused_decode: false` turns
the fused step off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Decode steps (tokens per row, summed over a rank's batches) after which compiling the step
# pays for itself at a batch the fused step does not take: the compilation's cost with a cold
# inductor cache (31.5 s) over the time it saves a step (2.46 -> 1.11 ms), measured at
# Pythia-410M, batch 16, on an H200 (docs/benchmarks.md, "Generation: the first token and the
# default decode path"). Larger models save more a step, so for them this errs toward eager.
COMPILE_PAYS_AFTER_STEPS = 23_000


@dataclass(frozen=True)
class DecodePath:
    """The step each batch decodes through, and the line generate.py starts with."""

    fused: bool
    """Batches of 1, 2 or 4 rows through the fused step."""
    compiled: bool
    """Other batches through the compiled step (else the eager one, captured on a GPU)."""
    line: str


def decode_steps(prompts: int, replicas: int, batch: int, new_tokens: int) -> int:
    """Decode steps one replica runs for `prompts` prompts of up to `new_tokens` each."""
    mine = -(-prompts // replicas)
    return -(-mine // batch) * new_tokens


def choose_decode_path(
    *,
    device_type: str,
    tensor_parallel: int,
    recompute: bool,
    fused_decode: bool,
    fused_problem: Optional[str],
    torch_compile: Optional[bool],
    batch: int,
    steps: Optional[int],
    moe: bool = False,
) -> DecodePath:
    """The decode path of a generate.py job. steps: the decode steps this rank will run (None
    when unknown, as in interactive mode, where each prompt is a batch of one). moe: the model
    has mixture-of-experts layers."""
    from neox.inference.fused_step import FusedStep

    if recompute:
        return DecodePath(False, False, "decode path: the whole sequence each token (recompute)")
    if device_type != "cuda":
        return DecodePath(
            False, False, f"decode path: the eager step with a KV cache on {device_type}"
        )
    if tensor_parallel > 1:
        return DecodePath(
            False,
            False,
            f"decode path: the eager step (tp={tensor_parallel}: collectives stay outside CUDA "
            "graphs and compiled steps)",
        )
    if moe:
        return DecodePath(
            False,
            False,
            "decode path: the eager step, uncaptured (mixture-of-experts routing reads the host, "
            "which a CUDA graph cannot hold)",
        )
    why_not_fused = (
        "fused_decode: false"
        if not fused_decode
        else f"the fused step does not support {fused_problem}"
        if fused_problem
        else None
        if FusedStep.takes(batch)
        else f"the fused step takes batches of 1, 2 or 4, not {batch}"
    )
    fused = why_not_fused is None
    if fused:
        return DecodePath(
            True,
            False,
            f"decode path: the fused step (Triton kernels, a CUDA graph), batch {batch}",
        )
    if torch_compile is not None:
        compiled = torch_compile
        why = f"torch_compile: {str(torch_compile).lower()}"
    elif steps is None:
        compiled, why = False, "the job's length is unknown"
    else:
        compiled = steps >= COMPILE_PAYS_AFTER_STEPS
        relation = "past" if compiled else "under"
        why = (
            f"{steps} decode steps, {relation} the {COMPILE_PAYS_AFTER_STEPS} where compiling "
            "pays; torch_compile: true/false decides instead"
        )
    step = (
        "the compiled step (torch.compile, a CUDA graph)"
        if compiled
        else "the eager step, captured as a CUDA graph"
    )
    return DecodePath(
        False, compiled, f"decode path: {step}, batch {batch} ({why_not_fused}; {why})"
    )

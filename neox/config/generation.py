"""Text generation (generate.py)."""

from typing import Annotated, Literal, Optional

from pydantic import Field

from neox.config.base import MAX_COUNT, MAX_POSITIONS, MAX_VOCAB, ConfigGroup, Reads


class GenerationConfig(ConfigGroup):
    """Sampling settings of generate.py."""

    text_gen_type: Annotated[
        Literal["unconditional", "input-file", "interactive"], Reads("neox/inference/modes.py")
    ] = "unconditional"
    """Where generate.py's prompts come from: none (num_samples from a document boundary),
    sample_input_file, or a prompt loop on rank 0's terminal (ends at end of input)."""

    temperature: Annotated[float, Reads("neox/inference/modes.py")] = Field(0.0, ge=0.0)
    """Sampling temperature; with top_k and top_p also 0, greedy (the most likely token). 0 with
    top_k or top_p set samples from the filtered logits unscaled (gpt-neox's rule)."""

    top_p: Annotated[float, Reads("neox/inference/modes.py")] = Field(0.0, ge=0.0, le=1.0)
    """Nucleus sampling: sample among the most likely tokens whose probability reaches top_p
    (0: off)."""

    top_k: Annotated[int, Reads("neox/inference/modes.py")] = Field(0, ge=0, le=MAX_VOCAB)
    """Sample among the k most likely tokens (0: off)."""

    return_logits: Annotated[bool, Reads("neox/inference/modes.py")] = False
    """Add `logits` to each output row: the raw logit of each generated token."""

    maximum_tokens: Annotated[int, Reads("neox/inference/modes.py")] = Field(
        64, ge=1, le=MAX_POSITIONS
    )
    """Tokens to generate per prompt (fewer when prompt + continuation would pass
    max_position_embeddings)."""

    prompt_end: Annotated[str, Reads("neox/inference/modes.py")] = Field("\n", min_length=1)
    """Separator between prompts in sample_input_file."""

    sample_input_file: Annotated[Optional[str], Reads("neox/inference/modes.py")] = None
    """Prompts, for text_gen_type input-file (blank prompts are skipped)."""

    sample_output_file: Annotated[Optional[str], Reads("neox/inference/modes.py")] = "samples.txt"
    """JSON lines generate.py writes (unconditional, input-file), one row per sample: context,
    text, length, finished (ended by the end-of-document token), tokens, duration_seconds
    (null: print them). Interactive mode prints to the terminal instead."""

    num_samples: Annotated[int, Reads("neox/inference/modes.py")] = Field(1, ge=1, le=MAX_COUNT)
    """Unconditional samples to generate."""

    fused_decode: Annotated[bool, Reads("neox/inference/modes.py")] = True
    """On a GPU without tensor parallelism, decode batches of 1, 2 or 4 rows through the fused
    step (neox/inference/fused_step.py: three Triton kernels a layer, captured as a CUDA graph,
    no compilation) when the model allows it (not ALiBi, query/key norms or dynamic NTK);
    false, or other batches: the compiled step (torch_compile: true) or the captured eager one."""

    recompute: Annotated[bool, Reads("neox/inference/modes.py")] = False
    """Recompute the whole sequence each token instead of using the KV cache (slower, same
    greedy text; needed for ALiBi and sliding-window models)."""

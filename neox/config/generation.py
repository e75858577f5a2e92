"""Text generation (generate.py)."""

from typing import Literal, Optional

from neox.config.base import ConfigGroup


class GenerationConfig(ConfigGroup):
    """Sampling settings of generate.py."""

    text_gen_type: Literal["unconditional", "input-file", "interactive"] = "unconditional"
    """Where prompts come from."""

    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""

    top_p: float = 0.0
    """Nucleus sampling threshold (0: off)."""

    top_k: int = 0
    """Sample among the k most likely tokens (0: off)."""

    return_logits: bool = False
    """Also return logits of generated tokens."""

    maximum_tokens: int = 64
    """Tokens to generate per prompt."""

    prompt_end: str = "\n"
    """Separator between prompts in an input file."""

    sample_input_file: Optional[str] = None
    """Prompts, for text_gen_type input-file."""

    sample_output_file: Optional[str] = "samples.txt"
    """Where generated samples are written."""

    num_samples: int = 1
    """Unconditional samples to generate."""

    recompute: bool = False
    """Recompute the whole sequence each step instead of using the KV cache."""

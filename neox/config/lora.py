"""LoRA finetuning: low-rank adapters on named linears of a frozen base model."""

from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator

from neox.config.base import MAX_WIDTH, ConfigGroup, Reads, Restricted
from neox.config.deepspeed import DeepSpeedConfig
from neox.config.float8 import Float8Config
from neox.config.model import ModelConfig
from neox.config.parallel import ParallelConfig
from neox.config.preference import PreferenceConfig
from neox.config.training import TrainingConfig

# The module names users know (neox's/HF GPTNeoX's, Llama's, short forms) -> neox's module.
# Llama's q_proj/k_proj/v_proj have no neox module of their own: q, k and v are one fused
# linear, so only all three together can be targeted (as query_key_value).
LORA_TARGET_ALIASES: dict[str, str] = {
    "query_key_value": "query_key_value",
    "qkv": "query_key_value",
    "dense": "dense",
    "o_proj": "dense",
    "dense_h_to_4h": "dense_h_to_4h",
    "up_proj": "dense_h_to_4h",
    "gate": "gate",
    "gate_proj": "gate",
    "dense_4h_to_h": "dense_4h_to_h",
    "down_proj": "dense_4h_to_h",
}


class LoraConfig(ConfigGroup):
    """Low-rank adapters (LoRA): W x + (alpha / r) B A x on each target linear, W frozen."""

    lora_rank: Annotated[
        int,
        Reads("neox/training/setup.py", "neox/model/transforms/lora.py"),
        Restricted(
            "Above 0, not with pipe_parallel_size > 1, ZeRO stage 3, finetune: true, preference "
            "training (train_impl other than normal) or fp8.enabled.",
            example={"lora_rank": 8},
            broken_by=(
                {"pipe_parallel_size": 2, "gradient_clipping": 0},
                {"zero_optimization": {"stage": 3}},
                {"finetune": True},
                {
                    "train_impl": "dpo",
                    "pos_train_data_paths": ["p"],
                    "neg_train_data_paths": ["n"],
                    "do_valid": False,
                    "do_test": False,
                },
                {"fp8": {"enabled": True}, "bf16": {"enabled": True}},
            ),
        ),
    ] = Field(0, ge=0, le=MAX_WIDTH)
    """Rank r of the adapters; 0 (the default) trains the whole model without LoRA. With r > 0
    only the adapters train and live in the optimizer; checkpoints hold the adapters alone and
    name the base (`lora_base`)."""

    lora_alpha: Annotated[float, Reads("neox/model/transforms/lora.py")] = Field(
        16.0, gt=0, le=MAX_WIDTH
    )
    """The adapter's output is scaled by lora_alpha / lora_rank (PEFT's lora_alpha)."""

    lora_dropout: Annotated[
        float,
        Reads("neox/model/transforms/lora.py"),
        Restricted(
            "Above 0, not with attention_dropout above 0 at model_parallel_size > 1 (the "
            "replicated adapter input would be dropped differently on each tensor-parallel rank).",
            example={"lora_rank": 8, "lora_dropout": 0.1},
            broken_by=({"attention_dropout": 0.1, "model_parallel_size": 2},),
        ),
    ] = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (the base path sees no dropout)."""

    lora_target_modules: Annotated[
        list[str],
        Reads("neox/model/transforms/lora.py"),
        Restricted(
            "`gate` only with a gated activation (swiglu, geglu).",
            example={"lora_rank": 8, "lora_target_modules": ["gate"], "activation": "swiglu"},
            broken_by=({"activation": "gelu"},),
        ),
    ] = Field(["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], min_length=1)
    """Linears that get adapters, in every layer: `query_key_value` (or `qkv`), `dense`
    (`o_proj`), `dense_h_to_4h` (`up_proj`), `dense_4h_to_h` (`down_proj`) and, for gated MLPs
    (swiglu/geglu), `gate` (`gate_proj`). Llama's q_proj/k_proj/v_proj are one fused linear
    here: target `query_key_value`."""

    lora_base: Annotated[
        Optional[str], Reads("neox/checkpoint/consolidate.py", "neox/plan/preflight.py")
    ] = None
    """The base model: a neox checkpoint (a save directory, whose `latest` is used, or one
    global_stepN directory; an HF model imported with tools/convert_from_hf.py first), of any
    layout. Its weights are loaded before training and each adapter checkpoint records this
    directory and its manifest's sha256, which resuming, generate/eval and export check. None:
    the base is the model initialised from `seed` (tests and benchmarks)."""

    lora_base_dtype: Annotated[
        Optional[Literal["fp32", "bf16", "fp16"]], Reads("neox/model/transforms/lora.py")
    ] = None
    """dtype of the frozen weights of the target linears (most of the model); None: the
    training precision. bf16 under fp32 training halves their memory while the adapters,
    norms and embeddings stay fp32 (inputs are cast to the base's dtype and its outputs back)."""

    @field_validator("lora_target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        out = []
        for name in v:
            if name in ("q_proj", "k_proj", "v_proj"):
                raise ValueError(
                    f"lora_target_modules: {name!r} is part of neox's fused query_key_value "
                    "linear; target 'query_key_value' (q, k and v together)"
                )
            if name not in LORA_TARGET_ALIASES:
                raise ValueError(
                    f"lora_target_modules: unknown module {name!r}; use some of "
                    f"{', '.join(LORA_TARGET_ALIASES)}"
                )
            if LORA_TARGET_ALIASES[name] not in out:
                out.append(LORA_TARGET_ALIASES[name])
        return out

    def check_with(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        deepspeed: DeepSpeedConfig,
        training: TrainingConfig,
        preference: PreferenceConfig,
        float8: Float8Config,
    ) -> None:
        """LoRA's layouts and options: what neox/model/transforms/lora.py implements, the rest refused
        (run when a NeoXConfig is validated)."""
        if not self.lora_rank:
            return
        if parallel.pp > 1:
            raise ValueError(
                f"lora_rank={self.lora_rank} with pipe_parallel_size="
                f"{parallel.pipe_parallel_size}: LoRA is not implemented with pipeline "
                "parallelism; set pipe_parallel_size to 1 (tensor and data parallelism work)"
            )
        if deepspeed.stage == 3:
            raise ValueError(
                f"lora_rank={self.lora_rank} with zero_optimization.stage=3: LoRA is not "
                "implemented with ZeRO-3 (the optimizer holds only the adapters, so stage 1 or 2 "
                "saves the same memory); use stage 0-2"
            )
        if training.finetune:
            raise ValueError(
                "finetune: true with lora_rank > 0: LoRA reads its base from lora_base; set "
                "lora_base to the base checkpoint and leave finetune false (load/save hold the "
                "adapter, so a restart resumes it)"
            )
        if "gate" in self.lora_target_modules and not model.shape.gated_mlp:
            raise ValueError(
                f"lora_target_modules names 'gate', but activation={model.activation!r} has no "
                "gate linear (only swiglu/geglu do); remove it"
            )
        if preference.train_impl != "normal":
            raise ValueError(
                f"lora_rank={self.lora_rank} with train_impl={preference.train_impl!r}: LoRA is "
                "not implemented for preference training (its reference copy is the full model); "
                "set lora_rank to 0 or train_impl to normal"
            )
        if float8.fp8.enabled:
            raise ValueError(
                f"lora_rank={self.lora_rank} with fp8.enabled: LoRA adapters on float8 linears "
                "are not implemented; set fp8.enabled to false or lora_rank to 0"
            )
        tp = parallel.model_parallel_size
        if self.lora_dropout and model.attention_dropout and tp > 1:
            raise ValueError(
                f"lora_dropout={self.lora_dropout} with attention_dropout="
                f"{model.attention_dropout} at model_parallel_size={tp}: attention then runs "
                "on each tensor-parallel rank's own random stream, so the replicated adapter "
                "input of query_key_value would be dropped differently per rank; set one of them "
                "to 0"
            )

"""The whole run config: one typed group per concern, addressed by flat gpt-neox keys."""

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from neox.config.base import ConfigGroup
from neox.config.checkpoint import CheckpointConfig
from neox.config.data import DataConfig, TokenizerConfig
from neox.config.deepspeed import DeepSpeedConfig
from neox.config.evaluation import EvalConfig
from neox.config.float8 import Float8Config
from neox.config.generation import GenerationConfig
from neox.config.launcher import LauncherConfig
from neox.config.log import LoggingConfig
from neox.config.lora import LoraConfig
from neox.config.model import ModelConfig
from neox.config.optimizer import OptimizerConfig
from neox.config.parallel import ParallelConfig
from neox.config.precision import PrecisionConfig
from neox.config.preference import PreferenceConfig
from neox.config.training import TrainingConfig

# Attribute name of each group on NeoXConfig, in the order the docs list them.
GROUPS: dict[str, type[ConfigGroup]] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "float8": Float8Config,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "preference": PreferenceConfig,
    "checkpoint": CheckpointConfig,
    "lora": LoraConfig,
    "logging": LoggingConfig,
    "launcher": LauncherConfig,
    "generation": GenerationConfig,
    "eval": EvalConfig,
    "deepspeed": DeepSpeedConfig,
}


def _key_owners() -> dict[str, str]:
    owners: dict[str, str] = {}
    for group, cls in GROUPS.items():
        for key in cls.model_fields:
            if key in owners:
                raise RuntimeError(f"config key {key!r} is claimed by {owners[key]} and {group}")
            owners[key] = group
    return owners


# Flat key -> group. Every user-facing key lives in exactly one group.
KEY_OWNER: dict[str, str] = _key_owners()


class NeoXConfig(BaseModel):
    """A validated run config. Users write flat keys; code reads `cfg.model.hidden_size`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    precision: PrecisionConfig = PrecisionConfig()
    float8: Float8Config = Float8Config()
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    preference: PreferenceConfig = PreferenceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoraConfig = LoraConfig()
    logging: LoggingConfig = LoggingConfig()
    launcher: LauncherConfig = LauncherConfig()
    generation: GenerationConfig = GenerationConfig()
    eval: EvalConfig = EvalConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()

    @model_validator(mode="after")
    def _across_groups(self) -> "NeoXConfig":
        """The rules of a group's keys that read other groups' keys (each group's own rules ran
        when it was validated; the run's, which need its layout and batch, run in `derive`)."""
        self.preference.check_with(self.data, self.parallel.pp)
        self.parallel.check_with(self.preference.train_impl, self.model, self.lora.lora_rank)
        self.lora.check_with(
            self.model, self.parallel, self.deepspeed, self.training, self.preference, self.float8
        )
        return self

    def check_run(
        self, precision: str, lr: float, micro: int, samples: tuple[int, int, int]
    ) -> None:
        """The rules that need the run's derived values (precision, peak learning rate, micro
        batch, samples drawn); `derive` runs them once it has them."""
        tp, pp = self.parallel.model_parallel_size, self.parallel.pp
        zero_stage = self.deepspeed.stage
        self.precision.check_run(precision)
        self.float8.check_run(precision, pp, self.model.lm_loss_chunk_size)
        self.data.check_run(pp, samples)
        self.optimizer.check_run(lr)
        self.model.check_run(tp, pp)
        self.preference.check_run(micro, samples, zero_stage)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> "NeoXConfig":
        """Build from flat, already-normalised keys (the loader checks unknown keys first)."""
        grouped: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for key, value in flat.items():
            grouped[KEY_OWNER[key]][key] = value
        return cls(**grouped)

    def to_flat(self, *, explicit_only: bool = False) -> dict[str, Any]:
        """Flat key -> value, as a user would write it (all fields, or only those set)."""
        flat: dict[str, Any] = {}
        for group in GROUPS:
            section: BaseModel = getattr(self, group)
            flat.update(section.model_dump(mode="json", exclude_unset=explicit_only))
        return flat

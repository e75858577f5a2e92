"""Preference training (gpt-neox's post-training keys): DPO, KTO and reward models."""

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from neox.config.base import ConfigGroup, Reads, Restricted
from neox.config.data import DataConfig, evaluated_splits
from neox.config.errors import ConfigError

PREF = "neox/training/preference.py"
PAIRS = "neox/data/pairs.py"
Paths = Optional[list[str]]
PAIRED = ("dpo", "rm")  # the train_impls that read chosen/rejected pairs
SPLITS = ("train", "valid", "test")


class PreferenceConfig(ConfigGroup):
    """Which loss a run trains with, and the paired or rewarded data DPO, KTO and RM read."""

    train_impl: Annotated[
        Literal["normal", "dpo", "kto", "rm"],
        Reads(PREF, "neox/config/preference.py"),
        Restricted(
            "Other than normal: not with pipe_parallel_size > 1 nor data_path (per-split paths "
            "only); kto needs a micro batch of 2 or more; kto, and dpo with a reference model, "
            "not with ZeRO stage 3.",
            example={
                "train_impl": "kto",
                "train_data_paths": ["t"],
                "train_reward_data_paths": ["r"],
                "train_micro_batch_size_per_gpu": 2,
                "do_valid": False,
                "do_test": False,
            },
            broken_by=(
                {"pipe_parallel_size": 2, "gradient_clipping": 0},
                {"train_micro_batch_size_per_gpu": 1},
                {"zero_optimization": {"stage": 3}},
            ),
        ),
    ] = "normal"
    """normal: language modelling. dpo: Direct Preference Optimization on chosen/rejected pairs
    (pos_/neg_ data) against a frozen reference copy of the starting weights. kto: KTO on single
    answers rewarded desirable (reward > 0) or undesirable (< 0) (train_reward_data_paths). rm: a
    reward model, the output layer replaced by a scalar head read at the last trained token,
    pairwise loss -logsigmoid(r_chosen - r_rejected). gpt-neox's "reinforce" is not implemented."""

    dpo_fp32: Annotated[bool, Reads(PREF)] = True
    """Compute DPO's log-probabilities and loss in float32 (else in the logits' dtype)."""

    dpo_reference_free: Annotated[bool, Reads(PREF)] = False
    """DPO without a reference model (its log-probabilities taken as 0): no frozen copy is kept."""

    dpo_beta: Annotated[float, Reads(PREF)] = Field(0.1, gt=0, le=1e6)
    """DPO's beta: the strength of the implicit KL penalty; rewards are beta * log(pi/ref)."""

    kto_fp32: Annotated[bool, Reads(PREF)] = True
    """Compute KTO's log-probabilities and loss in float32 (else in the logits' dtype)."""

    kto_beta: Annotated[float, Reads(PREF)] = Field(0.1, gt=0, le=1e6)
    """KTO's beta."""

    kto_desirable_weight: Annotated[float, Reads(PREF)] = Field(1.0, ge=0, le=1e6)
    """Weight of desirable (reward > 0) samples in KTO's loss, for unbalanced data."""

    kto_undesirable_weight: Annotated[float, Reads(PREF)] = Field(1.0, ge=0, le=1e6)
    """Weight of undesirable (reward < 0) samples in KTO's loss, for unbalanced data."""

    pos_train_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Prefixes of the chosen (preferred) answers of DPO/RM training pairs: document i here and
    in neg_train_data_paths are one pair (`preprocess_data_with_chat_template.py --jsonl-keys
    chosen rejected` writes them so)."""

    neg_train_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Prefixes of the rejected answers of DPO/RM training pairs (one per pos_ path)."""

    pos_train_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of pos_train_data_paths (the token where trained, -100 where masked); without
    them every token of the sequence counts."""

    neg_train_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of neg_train_data_paths."""

    pos_valid_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Chosen answers of validation pairs."""

    neg_valid_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Rejected answers of validation pairs."""

    pos_valid_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of pos_valid_data_paths."""

    neg_valid_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of neg_valid_data_paths."""

    pos_test_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Chosen answers of test pairs."""

    neg_test_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Rejected answers of test pairs."""

    pos_test_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of pos_test_data_paths."""

    neg_test_label_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """Label files of neg_test_data_paths."""

    train_reward_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """KTO: per-document rewards of train_data_paths (one number per document, its sign says
    desirable or undesirable), as `preprocess_data_with_chat_template.py --reward-key` writes."""

    valid_reward_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """KTO: rewards of valid_data_paths."""

    test_reward_data_paths: Annotated[Paths, Reads(PAIRS)] = None
    """KTO: rewards of test_data_paths."""

    @model_validator(mode="after")
    def _keys_of_train_impl(self) -> "PreferenceConfig":
        """A key of another train_impl (DPO's, KTO's, the pairs) is a mistake, named with the
        fix."""
        impl = self.train_impl
        fields = type(self).model_fields
        for key in sorted(self.model_fields_set):
            value, default = getattr(self, key), fields[key].default
            owner = "dpo" if key.startswith("dpo_") else "kto" if key.startswith("kto_") else None
            if key.startswith(("pos_", "neg_")):
                owner = "dpo or rm"
            elif key.endswith("_reward_data_paths"):
                owner = "kto"
            if owner and value != default and impl not in owner.split(" or "):
                feature = {"dpo": "DPO", "kto": "KTO", "dpo or rm": "DPO/RM pairwise data"}[owner]
                raise ValueError(
                    f"{key}={value!r} asks for {feature} training but train_impl is {impl!r}; set "
                    f"train_impl: {owner.split(' or ')[0]} or remove {key}"
                )
        return self

    def check_with(self, d: DataConfig, pp: int) -> None:
        """train_impl against the data keys and the pipeline: DPO and RM read chosen/rejected
        pairs, KTO rewarded answers (run when a NeoXConfig is validated)."""
        impl = self.train_impl
        if d.dataset_impl == "pairwise" and impl not in PAIRED:
            raise ValueError(
                f"dataset_impl='pairwise' is the chosen/rejected data of train_impl dpo or rm, but "
                f"train_impl is {impl!r}; set dataset_impl: gpt2"
            )
        if impl == "normal":
            return
        if pp > 1:
            raise ValueError(
                f"train_impl={impl!r} cannot run with pipe_parallel_size={pp}: its "
                "loss reads whole sequences' log-probabilities (and a reference model) at the last "
                "stage; use pipe_parallel_size 1 (tensor and data parallelism both work)"
            )
        if d.data_path:
            raise ValueError(
                f"train_impl={impl!r} reads per-split data paths, not data_path; set "
                + ("pos_/neg_train_data_paths" if impl in PAIRED else "train_data_paths")
            )
        for split in SPLITS:
            if impl in PAIRED:
                self._check_paired(split, d.train_data_paths if split == "train" else None)
            else:
                self._check_rewarded(d, split)

    def check_run(self, micro: int, samples: tuple[int, int, int], zero_stage: int) -> None:
        """KTO estimates its KL term from the other half of each micro-batch; the reference copy
        needs whole weights; paired data covers every split the run evaluates on (run by
        `derive`)."""
        impl = self.train_impl
        if impl == "kto" and micro < 2:
            raise ConfigError(
                f"train_impl='kto' needs train_micro_batch_size_per_gpu >= 2 (got {micro}): each "
                "half of a micro-batch is the other's KL baseline"
            )
        reference = impl == "kto" or (impl == "dpo" and not self.dpo_reference_free)
        if reference and zero_stage == 3:
            raise ConfigError(
                f"train_impl={impl!r} with ZeRO stage 3: the frozen reference copy is taken from "
                "whole weights, which ZeRO-3 partitions; use ZeRO stage 1 or 2 (or "
                "dpo_reference_free: true)"
            )
        if impl not in PAIRED:
            return
        for name, n, off in evaluated_splits(samples):
            if not getattr(self, f"pos_{name}_data_paths"):
                raise ConfigError(
                    f"train_impl={impl!r} evaluates {n} {name} samples but pos_{name}_data_paths "
                    f"is not set; add pos_/neg_{name}_data_paths or set {off}"
                )

    def _check_paired(self, split: str, plain: Optional[list[str]]) -> None:
        impl = self.train_impl
        pos, neg = _paths(self, f"pos_{split}_data_paths"), _paths(self, f"neg_{split}_data_paths")
        if split == "train" and not pos:
            raise ValueError(
                f"train_impl={impl!r} trains on chosen/rejected pairs: set pos_train_data_paths "
                "and neg_train_data_paths (preprocess_data_with_chat_template.py --jsonl-keys "
                "chosen rejected writes them)"
                + ("; train_data_paths is not read by it" if plain else "")
            )
        if len(pos) != len(neg):
            raise ValueError(
                f"pos_{split}_data_paths has {len(pos)} entries and neg_{split}_data_paths "
                f"{len(neg)}; give one rejected dataset per chosen one"
            )
        for side, data in (("pos", pos), ("neg", neg)):
            labels = _paths(self, f"{side}_{split}_label_data_paths")
            if labels and len(labels) != len(data):
                raise ValueError(
                    f"{side}_{split}_label_data_paths has {len(labels)} entries and "
                    f"{side}_{split}_data_paths {len(data)}; give one label file per dataset"
                )

    def _check_rewarded(self, d: DataConfig, split: str) -> None:
        data = _paths(d, f"{split}_data_paths")
        rewards = _paths(self, f"{split}_reward_data_paths")
        labels = _paths(d, f"{split}_label_data_paths")
        if split == "train" and not (data and rewards):
            raise ValueError(
                "train_impl='kto' trains on rewarded answers: set train_data_paths and "
                "train_reward_data_paths (preprocess_data_with_chat_template.py --reward-key "
                "writes them)"
            )
        if data and len(rewards) != len(data):
            raise ValueError(
                f"{split}_reward_data_paths has {len(rewards)} entries and {split}_data_paths "
                f"{len(data)}; KTO needs one reward file per dataset"
            )
        if labels and len(labels) != len(data):
            raise ValueError(
                f"{split}_label_data_paths has {len(labels)} entries and {split}_data_paths "
                f"{len(data)}; give one label file per dataset"
            )


def _paths(group: object, key: str) -> list[str]:
    return list(getattr(group, key) or [])

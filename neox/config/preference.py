"""Preference training (gpt-neox's post-training keys): DPO, KTO and reward models."""

from typing import Annotated, Literal, Optional

from pydantic import Field

from neox.config.base import ConfigGroup, Reads

PREF = "neox/training/preference.py"
PAIRS = "neox/data/pairs.py"
Paths = Optional[list[str]]


class PreferenceConfig(ConfigGroup):
    """Which loss a run trains with, and the paired or rewarded data DPO, KTO and RM read."""

    train_impl: Annotated[
        Literal["normal", "dpo", "kto", "rm"], Reads(PREF, "neox/config/derived.py")
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

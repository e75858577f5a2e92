"""What eval.py scores: perplexity and bits per byte, LAMBADA, lm-evaluation-harness tasks."""

from typing import Literal, Optional

from pydantic import model_validator

from neox.config.base import ConfigGroup


class EvalConfig(ConfigGroup):
    """Settings of eval.py. It evaluates the checkpoint in `load` on every part that is set."""

    eval_split: Optional[Literal["valid", "test"]] = None
    """Score perplexity and bits per byte on this split of the config's data (data_path cut by
    `split`, or valid_data_paths / test_data_paths); bytes are those of the decoded tokens."""

    eval_input_file: Optional[str] = None
    """Score perplexity and bits per byte on these documents: a jsonl, jsonl.zst or txt file, a
    directory or a glob (comma-separated for several); a txt file is one document."""

    eval_text_key: str = "text"
    """Key of the document text in eval_input_file's and eval_lambada_file's jsonl lines."""

    eval_stride: Optional[int] = None
    """Sliding-window stride in tokens for documents longer than seq_length: each window scores
    `eval_stride` new tokens with at least seq_length - eval_stride tokens of context (None:
    seq_length, disjoint windows as lm-evaluation-harness scores rolling log-likelihoods)."""

    eval_lambada_file: Optional[str] = None
    """LAMBADA jsonl ({"text": ...} per line): last-word accuracy (greedy exact match of every
    token of the last word, with its leading space) and perplexity of that word."""

    eval_limit: Optional[int] = None
    """Evaluate only the first N documents of each part (lm-evaluation-harness's --limit)."""

    eval_batch_size: int = 8
    """Windows (sequences of up to seq_length tokens) per forward pass."""

    eval_tasks: Optional[list[str]] = None
    """lm-evaluation-harness task names (e.g. lambada_openai, piqa), run through its Python API
    on the neox model; needs the `eval` extra (pip install neox[eval])."""

    eval_include_path: Optional[str] = None
    """Directory of extra lm-evaluation-harness task YAML files (lm_eval's --include_path), e.g.
    a task on local data, named in eval_tasks."""

    eval_num_fewshot: int = 0
    """Few-shot examples per eval_tasks prompt."""

    eval_results_prefix: str = ""
    """Prefix of the results file, <log_dir>/<prefix>_eval_results_<time>.json (or the current
    directory without log_dir)."""

    @model_validator(mode="after")
    def _positive(self) -> "EvalConfig":
        for key in ("eval_stride", "eval_limit", "eval_batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key}={value} must be at least 1")
        return self

    @property
    def has_work(self) -> bool:
        return bool(
            self.eval_split or self.eval_input_file or self.eval_lambada_file or self.eval_tasks
        )

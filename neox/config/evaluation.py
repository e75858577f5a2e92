"""What eval.py scores: perplexity and bits per byte, LAMBADA, lm-evaluation-harness tasks."""

from typing import Annotated, Literal, Optional

from pydantic import Field

from neox.config.base import MAX_BATCH, MAX_COUNT, MAX_POSITIONS, ConfigGroup, Reads


class EvalConfig(ConfigGroup):
    """Settings of eval.py. It evaluates the checkpoint in `load` on every part that is set."""

    eval_split: Annotated[
        Optional[Literal["valid", "test"]], Reads("neox/inference/evaluation.py")
    ] = None
    """Score perplexity and bits per byte on this split of the config's data (data_path cut by
    `split`, or valid_data_paths / test_data_paths); bytes are those of the decoded tokens."""

    eval_input_file: Annotated[Optional[str], Reads("neox/inference/evaluation.py")] = None
    """Score perplexity and bits per byte on these documents: a jsonl, jsonl.zst or txt file, a
    directory or a glob (comma-separated for several); a txt file is one document."""

    eval_text_key: Annotated[str, Reads("neox/inference/evaluation.py")] = "text"
    """Key of the document text in eval_input_file's and eval_lambada_file's jsonl lines."""

    eval_stride: Annotated[Optional[int], Reads("neox/inference/evaluation.py")] = Field(
        None, ge=1, le=MAX_POSITIONS
    )
    """Sliding-window stride in tokens for documents longer than seq_length: each window scores
    `eval_stride` new tokens with at least seq_length - eval_stride tokens of context (None:
    seq_length, disjoint windows as lm-evaluation-harness scores rolling log-likelihoods)."""

    eval_lambada_file: Annotated[Optional[str], Reads("neox/inference/evaluation.py")] = None
    """LAMBADA jsonl ({"text": ...} per line): last-word accuracy (greedy exact match of every
    token of the last word, with its leading space) and perplexity of that word."""

    eval_limit: Annotated[
        Optional[int], Reads("neox/inference/evaluation.py", "neox/inference/lm_eval_adapter.py")
    ] = Field(None, ge=1, le=MAX_COUNT)
    """Evaluate only the first N documents of each part (lm-evaluation-harness's --limit)."""

    eval_batch_size: Annotated[
        int, Reads("neox/inference/evaluation.py", "neox/inference/lm_eval_adapter.py")
    ] = Field(8, ge=1, le=MAX_BATCH)
    """Windows (sequences of up to seq_length tokens) per forward pass."""

    eval_tasks: Annotated[
        Optional[list[str]],
        Reads("neox/inference/evaluation.py", "neox/inference/lm_eval_adapter.py"),
    ] = None
    """lm-evaluation-harness task names (e.g. lambada_openai, piqa), run through its Python API
    on the neox model; needs the `eval` extra (pip install neox[eval])."""

    eval_include_path: Annotated[Optional[str], Reads("neox/inference/lm_eval_adapter.py")] = None
    """Directory of extra lm-evaluation-harness task YAML files (lm_eval's --include_path), e.g.
    a task on local data, named in eval_tasks."""

    eval_num_fewshot: Annotated[int, Reads("neox/inference/lm_eval_adapter.py")] = Field(
        0, ge=0, le=1024
    )
    """Few-shot examples per eval_tasks prompt."""

    eval_results_prefix: Annotated[str, Reads("neox/inference/evaluation.py")] = ""
    """Prefix of the results file, <log_dir>/<prefix>_eval_results_<time>.json (or the current
    directory without log_dir)."""

    @property
    def has_work(self) -> bool:
        return bool(
            self.eval_split or self.eval_input_file or self.eval_lambada_file or self.eval_tasks
        )

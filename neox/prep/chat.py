"""Chat conversations to token and label datasets through the tokenizer's own chat template.

The flags and files of gpt-neox's tools/datasets/preprocess_data_with_chat_template.py: each
jsonl key (`messages`, or `chosen` / `rejected` for preference data) holds a list of
{"role", "content"} turns; it becomes <prefix>_<key>_document (the tokens) and
<prefix>_<key>_label_document (the token id where trained, -100 where not), int32 labels.

A conversation is rendered turn by turn with the Hugging Face tokenizer's `apply_chat_template`:
the tokens turn i adds are those of the first i + 1 turns beyond those of the first i, with the
generation prompt (e.g. "<|im_start|>assistant\\n") rendered as part of the turn before an
assistant turn, so it is context, never a target. Turns of the generation role are trained
(with `only_last`, the last turn only); the tokenizer's EOS is appended, trained when the last
turn is, unless the template already closed the last turn with it (Llama-3's `<|eot_id|>`,
Mistral's `</s>`, Qwen's `<|im_end|>` then a newline). A template whose rendering of a longer
conversation does not start with that of a shorter one (some rewrite earlier turns) cannot be
cut so: such a conversation is skipped and counted, as are malformed ones, ones the template
refuses (`raise_exception`, e.g. Mistral's and Gemma's role-alternation checks) and ones with
nothing to train.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from neox.data.indexed import IGNORE_INDEX, best_dtype
from neox.prep.preprocess import EncodedBatch, PreprocessConfig, output_prefix_for
from neox.prep.readers import Issues, RawBatch, fail_document, parse_records

LABEL_DTYPE = np.dtype(np.int32)  # gpt-neox's label dtype: it must hold -100
REWARD_DTYPE = np.dtype(np.float32)


@dataclass
class ChatOptions:
    """How conversations become labels (gpt-neox's flags of the same names)."""

    tokenizer_path: str
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json with a
    chat_template, or chat_template.jinja) or hub name."""
    generation_role: str = "assistant"
    """Turns of this role are trained; the rest are context."""
    only_last: bool = False
    """Train on the last turn only (it must be of the generation role)."""
    no_mask: bool = False
    """Train on every token: no label dataset is written."""
    for_rm: bool = False
    """Reward-model data: nothing trained but a final EOS, the token the reward is read at."""
    reward_key: Optional[str] = None
    """Also write <prefix>_<key>_reward_document: this record field, one float per conversation."""
    binary_reward: bool = False
    """Read the reward field as a boolean: 1 when true, -1 when false."""


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations (no transformers, no template)."""


def load_chat_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer at `path`, refusing one without a chat template."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ChatTemplateError(
            "chat templates need the transformers package: pip install 'neox[export]'"
        ) from None
    local = os.path.isdir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ChatTemplateError(
            f"--tokenizer-path {path} is not a Hugging Face tokenizer ({str(e)[:200]}); pass "
            "a directory holding tokenizer.json and tokenizer_config.json"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer at {path} has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja); use a chat model's tokenizer, add "
            "a template, or mark prompts with tools/preprocess_data_with_mask.py instead"
        )
    check_template_parses(tokenizer, path)
    return tokenizer


def check_template_parses(tokenizer: Any, path: str) -> None:
    """A template with a syntax error fails every record: one setup error instead."""
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template of {path} does not parse (template line {e.lineno}: "
            f"{e.message}); fix its chat_template"
        ) from None
    except TemplateError:
        pass  # it may refuse this probe conversation (a role check): records are judged alone


class ChatFormatError(ValueError):
    """One conversation that cannot be made into a training document (skipped and counted)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason + (f" ({detail})" if detail else ""))
        self.reason, self.detail = reason, detail


def render(tokenizer: Any, turns: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of `turns` under the tokenizer's chat template."""
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    try:
        ids = tokenizer.apply_chat_template(
            turns, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
    except TemplateError as e:
        # raise_exception(...) in the template, or a template bug: this record's problem.
        message = " ".join(str(e).split())[:300] or type(e).__name__
        raise ChatFormatError("chat template error", message) from None
    if isinstance(ids, Mapping):  # transformers versions differ in what they return
        ids = ids["input_ids"]
    return list(ids)


def closes_with_eos(tokenizer: Any, tokens: list[int], eos: int) -> bool:
    """Whether `tokens` (a rendered turn) end with the EOS, followed by whitespace at most: the
    template closed the turn itself, and another EOS would train a doubled end."""
    if eos not in tokens:
        return False
    after = tokens[len(tokens) - tokens[::-1].index(eos) :]
    return not after or not tokenizer.decode(after).strip()


def chat_labels(
    tokenizer: Any, turns: list[dict], options: ChatOptions
) -> tuple[list[int], list[int]]:
    """(tokens, labels) of one conversation: labels are the token where trained, -100 elsewhere."""
    eos = tokenizer.eos_token_id
    if options.for_rm:
        if eos is None:
            raise ChatTemplateError("--for-rm needs a tokenizer with an EOS token")
        tokens = render(tokenizer, turns, False)
        # Two EOS: the model sees the first and is scored where it predicts the second.
        return tokens + [eos, eos], [IGNORE_INDEX] * (len(tokens) + 1) + [eos]
    if options.no_mask:
        tokens = render(tokenizer, turns, False)
        if eos is not None and not closes_with_eos(tokenizer, tokens, eos):
            tokens.append(eos)
        return tokens, list(tokens)
    tokens: list[int] = []
    labels: list[int] = []
    new: list[int] = []
    for i, turn in enumerate(turns):
        last = i == len(turns) - 1
        prompt = not last and turns[i + 1]["role"] == options.generation_role
        rendered = render(tokenizer, turns[: i + 1], prompt)
        if rendered[: len(tokens)] != tokens:
            raise ChatFormatError("template not prefix-stable")
        new = rendered[len(tokens) :]
        trained = turn["role"] == options.generation_role and (last or not options.only_last)
        tokens += new
        labels += new if trained else [IGNORE_INDEX] * len(new)
    if eos is not None and not closes_with_eos(tokenizer, new, eos):
        tokens.append(eos)
        labels.append(eos if labels and labels[-1] != IGNORE_INDEX else IGNORE_INDEX)
    if all(label == IGNORE_INDEX for label in labels):
        raise ChatFormatError(f"no {options.generation_role} turn to train")
    return tokens, labels


def _turns(value: Any) -> list[dict]:
    ok = (
        type(value) is list
        and value
        and all(
            type(t) is dict and type(t.get("role")) is str and type(t.get("content")) is str
            for t in value
        )
    )
    if not ok:
        raise ChatFormatError("not a list of {role, content} turns")
    return value


def _reward(value: Any, binary: bool) -> float:
    if binary:
        if type(value) is not bool:
            raise ChatFormatError("reward not a boolean")
        return 1.0 if value else -1.0
    if type(value) not in (int, float) or not np.isfinite(value):
        raise ChatFormatError("reward not a number")
    return float(value)


class ChatEncoder:
    """neox.prep.preprocess's Encoder for conversations (built once, forked into the workers)."""

    def __init__(self, config: PreprocessConfig, options: ChatOptions, tokenizer: Any = None):
        self.config, self.options = config, options
        self.tokenizer = (
            tokenizer if tokenizer is not None else load_chat_tokenizer(options.tokenizer_path)
        )
        self.dtype = best_dtype(len(self.tokenizer))
        self.outputs: dict[str, tuple[str, np.dtype]] = {}
        for key in config.jsonl_keys:
            self.outputs[key] = (output_prefix_for(config.output_prefix, key), self.dtype)
            if not options.no_mask:
                label = f"{key}_label"
                self.outputs[label] = (output_prefix_for(config.output_prefix, label), LABEL_DTYPE)
            if options.reward_key is not None:
                reward = f"{key}_reward"
                self.outputs[reward] = (
                    output_prefix_for(config.output_prefix, reward),
                    REWARD_DTYPE,
                )
        if len(set(self.outputs)) != len(self.outputs) or len(self.outputs) != len(
            {p for p, _ in self.outputs.values()}
        ):
            raise ValueError(
                f"--jsonl-keys {' '.join(config.jsonl_keys)} name the same output twice; "
                "a key ending in _label or _reward collides with another key's labels"
            )

    def describe(self) -> str:
        return (
            f"the chat template of {self.options.tokenizer_path} (vocab {len(self.tokenizer)}, "
            f"{self.dtype}; labels {LABEL_DTYPE})"
        )

    def encode(self, batch: RawBatch) -> EncodedBatch:
        cfg, opt = self.config, self.options
        parsed = parse_records(batch, cfg.strict, cfg.max_examples)
        issues: Issues = parsed.issues
        out: dict[str, list] = {name: [] for name in self.outputs}
        for line, record in parsed.records:
            try:
                docs = {}
                for key in cfg.jsonl_keys:
                    if key not in record:
                        raise ChatFormatError(f"missing key {key!r}")
                    docs[key] = chat_labels(self.tokenizer, _turns(record[key]), opt)
                reward = None
                if opt.reward_key is not None:
                    if opt.reward_key not in record:
                        raise ChatFormatError(f"missing key {opt.reward_key!r}")
                    reward = _reward(record[opt.reward_key], opt.binary_reward)
            except ChatFormatError as e:
                # A record is written for every key or for none: the datasets stay aligned.
                fail_document(cfg.strict, issues, e.reason, batch.source, line, e.detail)
                continue
            for key, (tokens, labels) in docs.items():
                out[key].append(tokens)
                if not opt.no_mask:
                    out[f"{key}_label"].append(labels)
                if reward is not None:
                    out[f"{key}_reward"].append([reward])
        tokens = {name: _flatten(docs, self.outputs[name][1]) for name, docs in out.items()}
        return EncodedBatch(
            tokens, parsed.documents, issues, parsed.input_bytes, parsed.disk_bytes, Counter()
        )


def _flatten(docs: list[list], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    flat = np.fromiter((t for d in docs for t in d), dtype=dtype, count=int(sizes.sum()))
    return flat, sizes

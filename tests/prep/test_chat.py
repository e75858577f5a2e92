"""Chat-template preprocessing (neox/prep/chat.py, tools/preprocess_data_with_chat_template.py)
on local Hugging Face tokenizers: labels are -100 exactly on the tokens that are not the
assistant's. Besides a plain ChatML template, the real chat templates of Llama-3-Instruct,
Mistral-7B-Instruct-v0.1, Qwen2.5-Instruct and Gemma-it (tests/prep/chat_templates/, the
tokenizer_config.json strings of those models) render over a small BPE with their special tokens."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDataset
from neox.prep.chat import ChatEncoder, ChatOptions, ChatTemplateError, load_chat_tokenizer
from neox.prep.preprocess import PreprocessConfig, preprocess
from neox.prep.readers import InputError

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue"},
    ],
]


TEMPLATES = Path(__file__).parent / "chat_templates"
# family: (template file, special tokens, bos, eos); the specials and bos/eos are the model's.
FAMILIES = {
    "llama3": (
        "llama3_instruct.jinja",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
        + ["<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": ("mistral_instruct.jinja", ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    "qwen2.5": (
        "qwen2_5_instruct.jinja",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
    ),
    "gemma": (
        "gemma_it.jinja",
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
    ),
}


def make_tokenizer(
    directory: Path,
    template: str | None = TEMPLATE,
    special: list[str] = SPECIAL,
    bos: str | None = None,
    eos: str = "<|endoftext|>",
) -> Path:
    """A byte-level BPE with the given special tokens, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [t["content"] for chat in CHATS for t in chat] * 20 + ["user assistant system"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("chat_tok") / "tok")


def family_tokenizer(directory: Path, family: str) -> Path:
    """A tokenizer with `family`'s real chat template, special tokens, BOS and EOS."""
    template, special, bos, eos = FAMILIES[family]
    return make_tokenizer(directory, (TEMPLATES / template).read_text(), special, bos, eos)


def chat_config(src: Path, prefix: Path, strict: bool = False) -> PreprocessConfig:
    return PreprocessConfig(
        inputs=str(src),
        output_prefix=str(prefix),
        tokenizer_type="HFTokenizer",
        jsonl_keys=("messages",),
        workers=0,
        strict=strict,
        progress=False,
    )


def trained_runs(tokenizer, tokens, labels) -> list[str]:
    """The decoded text of each maximal run of trained positions."""
    tokens, labels = np.asarray(tokens), np.asarray(labels)
    trained = labels != -100
    assert np.array_equal(labels[trained], tokens[trained])  # the token id where trained
    runs, current = [], []
    for tok, t in zip(tokens.tolist(), trained.tolist()):
        if t:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("only_last", [False, True])
def test_labels_mask_exactly_the_tokens_that_are_not_the_assistants(
    tmp_path, tokenizer_dir, only_last
):
    records = [{"messages": c} for c in CHATS]
    records.insert(1, {"messages": "not a conversation"})
    records.insert(1, {"messages": [{"role": "user", "content": "no reply"}]})
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    config = PreprocessConfig(
        inputs=str(src),
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="HFTokenizer",
        jsonl_keys=("messages",),
        workers=0,
        progress=False,
    )
    options = ChatOptions(str(tokenizer_dir), only_last=only_last)
    report = preprocess(config, ChatEncoder(config, options))
    # The two bad records are skipped and counted, by reason.
    assert report.issues.counts == {
        "not a list of {role, content} turns": 1,
        "no assistant turn to train": 1,
    }
    text = IndexedDataset(str(tmp_path / "out_messages_document"))
    label = IndexedDataset(str(tmp_path / "out_messages_label_document"))
    assert label.dtype == np.int32 and len(text) == len(label) == 2
    assert np.array_equal(text.sizes, label.sizes)
    tokenizer = load_chat_tokenizer(str(tokenizer_dir))
    for i, chat in enumerate(CHATS):
        tokens, labels = text[i], label[i]
        whole = tokenizer.apply_chat_template(chat, tokenize=False)
        assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False) == (
            whole + "<|endoftext|>"
        )
        replies = [f"{t['content']}<|im_end|>\n" for t in chat if t["role"] == "assistant"]
        if only_last:
            replies = replies[-1:]
        replies[-1] += "<|endoftext|>"  # the EOS is trained after a trained last turn
        assert trained_runs(tokenizer, tokens, labels) == replies
        # Everything else is context: the prompts, and the "<|im_start|>assistant\n" headers.
        masked = tokenizer.decode(tokens[labels == -100].tolist(), skip_special_tokens=False)
        assert masked.count("<|im_start|>assistant\n") == len(
            [t for t in chat if t["role"] == "assistant"]
        )
        assert "What is two plus two?" in masked or i == 1


def test_reward_model_data_labels_only_the_final_eos(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "rm.jsonl", [{"chosen": CHATS[1], "score": 0.5}])
    config = PreprocessConfig(
        inputs=str(src),
        output_prefix=str(tmp_path / "rm"),
        tokenizer_type="HFTokenizer",
        jsonl_keys=("chosen",),
        workers=0,
        progress=False,
    )
    options = ChatOptions(str(tokenizer_dir), for_rm=True, reward_key="score")
    preprocess(config, ChatEncoder(config, options))
    tokens = IndexedDataset(str(tmp_path / "rm_chosen_document"))[0]
    labels = IndexedDataset(str(tmp_path / "rm_chosen_label_document"))[0]
    eos = load_chat_tokenizer(str(tokenizer_dir)).eos_token_id
    assert tokens[-2:].tolist() == [eos, eos]
    assert (labels[:-1] == -100).all() and labels[-1] == eos
    reward = IndexedDataset(str(tmp_path / "rm_chosen_reward_document"))
    assert reward.dtype == np.float32 and reward[0].tolist() == [0.5]


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    plain = make_tokenizer(tmp_path / "plain", template=None)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_chat_tokenizer(str(plain))


def test_a_template_that_does_not_parse_is_refused_before_any_record(tmp_path):
    broken = make_tokenizer(tmp_path / "broken", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ChatTemplateError, match=r"does not parse \(template line 1: unexpected"):
        load_chat_tokenizer(str(broken))


def test_cli_with_workers_writes_the_pair_and_reports_skips(tmp_path, tokenizer_dir, caplog):
    src = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 3] + [{"other": 1}]
    )
    out = tmp_path / "cli"
    args = ["--input", str(src), "--output-prefix", str(out), "--tokenizer-path"]
    args += [str(tokenizer_dir), "--jsonl-keys", "messages", "--workers", "2", "--no-progress"]
    r = subprocess.run(
        [sys.executable, "tools/preprocess_data_with_chat_template.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "missing key 'messages': 1" in r.stderr and "wrote 6 documents" in r.stderr
    assert len(IndexedDataset(f"{out}_messages_label_document")) == 6
    # A second run (its main, in this process) refuses to overwrite.
    from tools.preprocess_data_with_chat_template import main

    with caplog.at_level("ERROR"):
        assert main(args) == 1
    assert "already exists" in caplog.text


# Each template's own end of a turn, and whether it is the tokenizer's EOS (then not doubled).
TURN_END = {
    "llama3": ("<|eot_id|>", True),
    "mistral": ("</s>", True),
    "qwen2.5": ("<|im_end|>\n", True),
    "gemma": ("<end_of_turn>\n", False),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_real_templates_train_the_replies_and_end_with_one_eos(tmp_path, family):
    tok_dir = family_tokenizer(tmp_path / "tok", family)
    chat = CHATS[0][1:]  # user, assistant, user, assistant: every family's template takes it
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    preprocess(
        chat_config(src, tmp_path / "out"),
        ChatEncoder(chat_config(src, tmp_path / "out"), ChatOptions(str(tok_dir))),
    )
    tokens = IndexedDataset(str(tmp_path / "out_messages_document"))[0]
    labels = IndexedDataset(str(tmp_path / "out_messages_label_document"))[0]
    tokenizer = load_chat_tokenizer(str(tok_dir))
    whole = tokenizer.apply_chat_template(chat, tokenize=False)
    end, closed_by_eos = TURN_END[family]
    assert whole.endswith(end)
    eos = tokenizer.eos_token
    decoded = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    # An EOS the template wrote is not appended again; otherwise the EOS follows the turn.
    assert decoded == (whole if closed_by_eos else whole + eos)
    assert not decoded.rstrip().endswith(eos + eos)
    replies = [t["content"] + end for t in chat if t["role"] == "assistant"]
    replies[-1] += "" if closed_by_eos else eos
    assert [r.strip() for r in trained_runs(tokenizer, tokens, labels)] == [
        r.strip() for r in replies
    ]


@pytest.mark.parametrize("family", ["mistral", "gemma"])
def test_template_refusals_are_skipped_and_counted_or_stop_strict_with_file_line(tmp_path, family):
    tok_dir = family_tokenizer(tmp_path / "tok", family)
    records = [
        {"messages": CHATS[1]},
        {"messages": CHATS[0]},  # a system turn first: both templates raise_exception
        {"messages": [CHATS[1][0], CHATS[1][0], CHATS[1][1]]},  # user twice: not alternating
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    config = chat_config(src, tmp_path / "out")
    report = preprocess(config, ChatEncoder(config, ChatOptions(str(tok_dir))))
    assert report.issues.counts == {"chat template error": 2}
    alternate = "Conversation roles must alternate user/assistant/user/assistant/..."
    first = "System role not supported" if family == "gemma" else alternate
    assert report.issues.examples == [
        f"{src}:2: chat template error ({first})",
        f"{src}:3: chat template error ({alternate})",
    ]
    assert len(IndexedDataset(str(tmp_path / "out_messages_document"))) == 1
    # --strict: the first refusal stops the run in one line naming file:line and the message;
    # nothing is written.
    strict = chat_config(src, tmp_path / "strict", strict=True)
    with pytest.raises(InputError) as e:
        preprocess(strict, ChatEncoder(strict, ChatOptions(str(tok_dir))))
    assert str(e.value).startswith(f"{src}:2: chat template error ({first}); fix or remove")
    assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("strict*"))


def test_cli_strict_template_error_is_one_line_and_all_skipped_names_the_jsonl_key(
    tmp_path, caplog
):
    from tools.preprocess_data_with_chat_template import main

    tok_dir = family_tokenizer(tmp_path / "tok", "gemma")
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])
    args = ["--input", str(src), "--tokenizer-path", str(tok_dir), "--jsonl-keys", "messages"]
    args += ["--workers", "0", "--no-progress", "--output-prefix"]
    with caplog.at_level("ERROR"):
        assert main([*args, str(tmp_path / "strict"), "--strict"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[0] == (
        f"InputError: {src}:1: chat template error (System role not supported); fix or remove "
        "that document, or run without --strict to skip and count such documents"
    )
    caplog.clear()
    # Every record skipped: the error names the user's key, not the derived label dataset.
    with caplog.at_level("ERROR"):
        assert main([*args, str(tmp_path / "all")]) == 1
    error = caplog.records[0].getMessage()
    assert "no document yielded tokens for --jsonl-keys messages (" in error
    assert "messages_label" not in error
    assert not list(tmp_path.glob("strict*")) and not list(tmp_path.glob("all*"))

"""Chat-template preprocessing (neox/prep/chat.py, tools/preprocess_data_with_chat_template.py)
on a local Hugging Face tokenizer with a ChatML template: labels are -100 exactly on the
tokens that are not the assistant's."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDataset
from neox.prep.chat import ChatEncoder, ChatOptions, ChatTemplateError, load_chat_tokenizer
from neox.prep.preprocess import PreprocessConfig, preprocess

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


def make_tokenizer(directory: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE with ChatML special tokens, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [t["content"] for chat in CHATS for t in chat] * 20 + ["user assistant system"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("chat_tok") / "tok")


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


def test_cli_with_workers_writes_the_pair_and_reports_skips(tmp_path, tokenizer_dir):
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
    # A second run refuses to overwrite; a tokenizer without a template is a one-line error.
    again = subprocess.run(
        [sys.executable, "tools/preprocess_data_with_chat_template.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1 and "already exists" in again.stderr

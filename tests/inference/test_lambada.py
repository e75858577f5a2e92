"""LAMBADA: the last-word split, scores against a per-passage forward, a model that knows the
answers, and the real test set with the GPT-2 tokenizer."""

import json
import math

import pytest
import torch

from neox.inference.lambada import lambada_metrics, score_lambada, split_last_word
from neox.inference.scoring import encode_pair
from neox.model import build_model
from neox.prep.readers import iter_documents
from neox.tokenizer import build_tokenizer
from tests.inference.conftest import KNOWN, MEMORISED_CFG


def test_split_last_word():
    assert split_last_word("he said hello") == ("he said", " hello")
    assert split_last_word('"Go," said Harlin') == ('"Go," said', " Harlin")
    for bad in ("oneword", "ends with space "):
        with pytest.raises(ValueError, match="no last word"):
            split_last_word(bad)


def test_pair_encoding_moves_trailing_spaces_to_the_continuation(chars):
    ctx, cont = encode_pair(chars, "over the ", "dog")
    assert chars.decode(ctx) == "over the" and chars.decode(cont) == " dog"
    assert encode_pair(chars, "", "dog") == ([chars.eod], chars.encode("dog"))


def test_accuracy_and_perplexity_of_a_model_that_knows_the_answers(memorised, chars):
    wrong = "the quick brown fox jumps over the lazy cat"
    texts = [*KNOWN, wrong]
    m = lambada_metrics(
        score_lambada(memorised, chars, texts, max_len=48, batch_size=2, device="cpu")
    )
    assert m["passages"] == 3
    assert m["accuracy"] == pytest.approx(2 / 3)  # both memorised endings, not the cat
    # Independent per-passage forward: -log p(last word | context), averaged, exponentiated.
    nll = []
    with torch.no_grad():
        for t in texts:
            ctx, target = encode_pair(chars, *split_last_word(t))
            ids = torch.tensor([ctx + target])
            lp = torch.log_softmax(memorised(ids[:, :-1])[0].double(), -1)
            nll.append(-lp[-len(target) :].gather(-1, ids[0, -len(target) :, None]).sum().item())
    assert m["perplexity"] == pytest.approx(math.exp(sum(nll) / 3), rel=1e-5)
    assert nll[0] < 0.5 and nll[2] > 3  # a near-certain ending and a surprising one


def test_local_jsonl_slice(tmp_path, memorised, chars):
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in KNOWN))
    texts = [d["text"] for d in iter_documents(str(path))]
    m = lambada_metrics(
        score_lambada(memorised, chars, texts, max_len=48, batch_size=4, device="cpu")
    )
    assert m["accuracy"] == 1.0 and m["passages"] == 2


def test_real_lambada_with_the_gpt2_tokenizer(shared_data):
    tok = build_tokenizer(
        "GPT2BPETokenizer",
        str(shared_data / "gpt2-vocab.json"),
        str(shared_data / "gpt2-merges.txt"),
    )
    texts = [d["text"] for d in iter_documents(str(shared_data / "lambada_test.jsonl"))]
    assert len(texts) == 5153
    for t in texts:  # every passage splits, and the pair re-joins into the passage
        ctx, target = split_last_word(t)
        assert ctx + target == t
    ctx, cont = encode_pair(tok, *split_last_word(texts[0]))
    assert tok.decode(ctx + cont) == texts[0] and tok.decode(cont) == " signs"
    model = build_model(
        MEMORISED_CFG.model_copy(update={"seq_length": 128, "max_position_embeddings": 128}), 50304
    ).eval()
    m = lambada_metrics(
        score_lambada(model, tok, texts[:20], max_len=128, batch_size=8, device="cpu")
    )
    assert m["passages"] == 20 and 0 <= m["accuracy"] <= 1
    assert 1 < m["perplexity"] < math.inf

"""benchmarks/sft.py's dataset: what its tokens/s ratio is read against must be SFT data whose
prompts, and only those, are masked. The delimiter's ids are encoded apart from the text, so
this checks that BPE splits it the same way inside the documents (else nothing is masked)."""

from benchmarks.sft import DELIMITER, build_dataset, scenes
from neox.data.indexed import IGNORE_INDEX, IndexedDataset
from neox.tokenizer import build_tokenizer


def test_prompts_and_delimiter_are_masked_answers_and_eod_trained(tmp_path, shared_data):
    play = tmp_path / "play.txt"
    play.write_text((shared_data / "tinyshakespeare.txt").read_text()[:20_000])
    vocab = str(shared_data / "20B_tokenizer.json")
    text, labels, stats = build_dataset(play, vocab, tmp_path / "data")
    tok = build_tokenizer("HFTokenizer", vocab)
    docs = scenes(play.read_text())
    tokens_ds, labels_ds = IndexedDataset(str(text)), IndexedDataset(str(labels))
    assert len(tokens_ds.sizes) == len(docs) > 10
    total_masked = 0
    for i, doc in enumerate(docs):
        prompt, answer = doc.split(DELIMITER)
        tokens, label = tokens_ds.get(i), labels_ds.get(i)
        masked = int((label == IGNORE_INDEX).sum())
        total_masked += masked
        # A masked prefix holding exactly the prompt and the delimiter; then every token trained.
        assert (label[:masked] == IGNORE_INDEX).all() and (label[masked:] == tokens[masked:]).all()
        assert tok.decode(tokens[:masked].tolist()) == prompt + DELIMITER
        assert tok.decode(tokens[masked:-1].tolist()) == answer and tokens[-1] == tok.eod
    assert stats["documents_without_delimiter"] == 0
    assert stats["masked_fraction"] == total_masked / stats["tokens"]
    assert 0.3 < stats["masked_fraction"] < 0.7  # "about half the tokens masked"

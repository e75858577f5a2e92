"""TiktokenTokenizer: named encodings, with clear errors offline or for unknown names."""

import time

import pytest

from neox.tokenizer import build_tokenizer


def test_unknown_encoding_name_lists_valid_names():
    with pytest.raises(ValueError, match="cl100k_base"):
        build_tokenizer("TiktokenTokenizer", "not_an_encoding")


def test_offline_download_fails_fast_and_clearly(monkeypatch, tmp_path):
    # An empty cache and a proxy on a closed local port: the download is refused at once.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="r50k_base.*GPT2BPETokenizer"):
        build_tokenizer("TiktokenTokenizer", "r50k_base")
    assert time.monotonic() - start < 10

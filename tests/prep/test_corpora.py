"""Corpora: the offline pystdlib selection, downloads (from a local server), and local inputs."""

import functools
import http.server
import io
import json
import threading
import time
import zipfile

import pytest
import zstandard

from neox.prep.corpora import (
    REMOTE_CORPORA,
    CorpusDownloadError,
    prepare_corpus,
    pystdlib_files,
    write_jsonl_zst,
)

UNREACHABLE = "http://127.0.0.1:9/corpus"  # the discard port: nothing listens, refused at once


def read_corpus(path) -> list[str]:
    with zstandard.ZstdDecompressor().stream_reader(open(path, "rb")) as raw:
        return [json.loads(line)["text"] for line in io.TextIOWrapper(raw, encoding="utf-8")]


@pytest.fixture
def serve(tmp_path):
    """Serve files from a folder over real HTTP on localhost; yields the base URL."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_pystdlib_is_a_deterministic_prefix_of_real_sources(tmp_path):
    first = prepare_corpus("pystdlib", data_dir=tmp_path / "a", size_mb=0.3)
    second = prepare_corpus("pystdlib", data_dir=tmp_path / "b", size_mb=0.3)
    assert first.path == tmp_path / "a" / "pystdlib" / "pystdlib.jsonl.zst"
    assert read_corpus(first.path) == read_corpus(second.path)
    docs = read_corpus(first.path)
    sizes = [len(d.encode()) for d in docs]
    # Stops at the first document that reaches the budget, not before and not after.
    assert sum(sizes) >= 300_000 > sum(sizes[:-1]) and first.text_bytes == sum(sizes)
    sources = [p.read_text(encoding="utf-8") for p in pystdlib_files()[: len(docs) + 5]]
    assert docs == [s for s in sources if s.strip()][: len(docs)]
    assert any("def " in d for d in docs)


@pytest.mark.parametrize("name", sorted(REMOTE_CORPORA))
def test_unreachable_download_fails_fast_with_what_to_do(tmp_path, name):
    start = time.monotonic()
    with pytest.raises(CorpusDownloadError) as info:
        prepare_corpus(name, data_dir=tmp_path, url=UNREACHABLE, timeout=2)
    assert time.monotonic() - start < 5
    message = str(info.value)
    for needed in (repr(name), UNREACHABLE, "--url", "pystdlib", "local input"):
        assert needed in message
    assert not list(tmp_path.rglob("*.zst*")), "no partial output may be left behind"


def test_tinyshakespeare_downloads_once_and_splits_speeches(tmp_path, serve, shared_data):
    root, base = serve
    text = (shared_data / "tinyshakespeare.txt").read_text()
    (root / "input.txt").write_text(text)
    prepared = prepare_corpus("tinyshakespeare", data_dir=tmp_path, url=f"{base}/input.txt")
    docs = read_corpus(prepared.path)
    assert docs[0].startswith("First Citizen:\nBefore we proceed")
    assert len(docs) == len([b for b in text.split("\n\n") if b.strip()]) > 1000
    assert "".join(docs).replace("\n", "") == text.replace("\n", "")
    (root / "input.txt").unlink()  # the cached copy under data/tinyshakespeare/raw is reused
    again = prepare_corpus("tinyshakespeare", data_dir=tmp_path, url=f"{base}/input.txt")
    assert read_corpus(again.path) == docs


def test_pile_sample_streams_and_stops_at_the_size(tmp_path, serve, shared_data):
    root, base = serve
    lines = (shared_data / "lambada_test.jsonl").read_text().splitlines()
    (root / "val.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("\n".join(lines).encode())
    )
    prepared = prepare_corpus(
        "pile-sample", data_dir=tmp_path, url=f"{base}/val.jsonl.zst", size_mb=0.05
    )
    docs = read_corpus(prepared.path)
    assert docs == [json.loads(line)["text"] for line in lines[: len(docs)]]
    assert 50_000 <= prepared.text_bytes < 50_000 + len(docs[-1].encode()) + 1


def test_wikitext_and_enwik8_archives_split_into_articles(tmp_path, serve):
    root, base = serve
    wiki = " = First = \n text one\n = = Section = = \n more\n = Second = \n text two\n"
    with zipfile.ZipFile(root / "wikitext.zip", "w") as z:
        z.writestr("wikitext-103-raw/wiki.train.raw", wiki)
    docs = read_corpus(
        prepare_corpus("wikitext-103", data_dir=tmp_path, url=f"{base}/wikitext.zip").path
    )
    assert docs == [
        " = First = \n text one\n = = Section = = \n more\n",
        " = Second = \n text two\n",
    ]
    with zipfile.ZipFile(root / "enwik8.zip", "w") as z:
        z.writestr("enwik8", "<mediawiki>\n  <page>a</page>\n  <page>b</page>\n</mediawiki>")
    docs = read_corpus(prepare_corpus("enwik8", data_dir=tmp_path, url=f"{base}/enwik8.zip").path)
    assert docs == ["<mediawiki>\n  ", "<page>a</page>\n  ", "<page>b</page>\n</mediawiki>"]


def test_local_files_and_dirs_become_documents(tmp_path):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("whole file is one document\nwith two lines")
    (src / "sub" / "b.jsonl").write_text('{"body": "x ünïcode"}\n{"body": "y"}\n')
    prepared = prepare_corpus([str(src)], data_dir=tmp_path / "data", jsonl_key="body")
    assert prepared.path == tmp_path / "data" / "texts" / "texts.jsonl.zst"
    assert read_corpus(prepared.path)[1:] == ["x ünïcode", "y"]
    assert read_corpus(prepared.path)[0].startswith("whole file")


def test_missing_local_input_is_named_before_writing(tmp_path):
    with pytest.raises(Exception, match="nope.txt"):
        prepare_corpus([str(tmp_path / "nope.txt")], data_dir=tmp_path)
    assert not list(tmp_path.rglob("*.zst*"))


def test_writer_refuses_an_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match="no documents"):
        write_jsonl_zst([], tmp_path / "empty.jsonl.zst")
    assert not list(tmp_path.iterdir())

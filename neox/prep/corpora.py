"""Text corpora as documents: local files, the offline `pystdlib`, and downloadable corpora.

Every corpus ends up as jsonl.zst, one {"text": ...} per line, the input of
tools/preprocess_data.py and tools/train_tokenizer.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import sysconfig
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard

from neox.prep.readers import SUPPORTED_SUFFIXES, expand_inputs, iter_documents

logger = logging.getLogger(__name__)

MB = 1_000_000
DEFAULT_CORPUS = "pystdlib"
DEFAULT_PYSTDLIB_MB = 5.0
DOWNLOAD_TIMEOUT_S = 20.0
DOC_SUFFIXES = (".txt", ".rst")  # Python's docs, where installed, are .txt/.rst


class CorpusDownloadError(RuntimeError):
    """A corpus could not be fetched; the message says which, from where, and what to do."""


@dataclass(frozen=True)
class RemoteCorpus:
    """A public corpus: where it lives and how its file becomes documents."""

    name: str
    url: str
    about: str
    to_documents: Callable[[Path], Iterator[str]]
    default_mb: float | None = None  # None: the whole corpus
    stream: bool = False  # jsonl.zst read while downloading, so a sample needs no full copy


# ----------------------------------------------------------------------------- local files


def local_documents(inputs: list[str], jsonl_key: str = "text") -> Iterator[str]:
    """Documents of local files, dirs and globs, read as tools/preprocess_data.py reads them.

    Paths are checked here, so a bad one fails before any output is written.
    """
    files = expand_inputs(inputs)
    return (document[jsonl_key] for document in iter_documents(files, keys=(jsonl_key,)))


# ----------------------------------------------------------------------------- pystdlib

_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def pystdlib_files() -> list[Path]:
    """The running Python's standard-library sources (and docs if installed), in a fixed order.

    The order is the SHA-1 of each path relative to its root, so a size-limited prefix samples
    the whole library instead of its alphabetically first packages, the same on every machine
    with this Python version.
    """
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    docs = Path(sys.prefix) / "share" / "doc" / f"python{version}"
    roots += [docs] if docs.is_dir() else []
    keyed: list[tuple[str, Path]] = []
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP_DIRS and d[0] != ".")
            for name in names:
                if name.endswith((".py", *DOC_SUFFIXES)):
                    path = Path(folder) / name
                    rel = path.relative_to(root).as_posix()
                    keyed.append((hashlib.sha1(rel.encode()).hexdigest(), path))
    return [path for _, path in sorted(keyed)]


def pystdlib_documents() -> Iterator[str]:
    """One document per standard-library file that is valid UTF-8."""
    for path in pystdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are Latin-1 test fixtures or unreadable: not text we want
        if text.strip():
            yield text


# ----------------------------------------------------------------------------- remote corpora


def _split_paragraphs(path: Path) -> Iterator[str]:
    # Tiny Shakespeare: each speech (a blank-line separated block) is a document.
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        if block.strip():
            yield block + "\n"


def _enwik8_pages(path: Path) -> Iterator[str]:
    with zipfile.ZipFile(path) as archive:
        text = archive.read("enwik8").decode("utf-8", errors="replace")
    # Split before each <page>, keeping the tag; the dump's header is the first document.
    for page in re.split(r"(?=<page>)", text):
        if page.strip():
            yield page


_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def _wikitext_articles(path: Path) -> Iterator[str]:
    with zipfile.ZipFile(path) as archive:
        member = next(n for n in archive.namelist() if n.endswith("wiki.train.raw"))
        lines = io.TextIOWrapper(archive.open(member), encoding="utf-8")
        article: list[str] = []
        for line in lines:
            # Articles start at a top-level " = Title = " line.
            if _WIKITEXT_TITLE.match(line.rstrip("\n")) and any(s.strip() for s in article):
                yield "".join(article)
                article = []
            article.append(line)
        if any(s.strip() for s in article):
            yield "".join(article)


def _jsonl_zst_texts(stream) -> Iterator[str]:
    reader = zstandard.ZstdDecompressor().stream_reader(stream)
    for line in io.TextIOWrapper(reader, encoding="utf-8"):
        if line.strip():
            yield json.loads(line)["text"]


REMOTE_CORPORA: dict[str, RemoteCorpus] = {
    c.name: c
    for c in [
        RemoteCorpus(
            "tinyshakespeare",
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            "1.1 MB of Shakespeare plays, one speech per document",
            _split_paragraphs,
        ),
        RemoteCorpus(
            "enwik8",
            "http://mattmahoney.net/dc/enwik8.zip",
            "first 100 MB of an English Wikipedia XML dump, one page per document",
            _enwik8_pages,
        ),
        RemoteCorpus(
            "wikitext-103",
            "https://wikitext.smerity.com/wikitext-103-raw-v1.zip",
            "WikiText-103 raw training split (~540 MB), one article per document",
            _wikitext_articles,
        ),
        RemoteCorpus(
            "pile-sample",
            "https://huggingface.co/datasets/monology/pile-uncopyrighted/resolve/main/val.jsonl.zst",
            "the first documents of the Pile (uncopyrighted) validation split",
            lambda path: _jsonl_zst_texts(open(path, "rb")),
            default_mb=50.0,
            stream=True,
        ),
    ]
}
CORPUS_NAMES = (DEFAULT_CORPUS, *REMOTE_CORPORA)


def download(corpus: RemoteCorpus, dest: Path, url: str | None = None, timeout: float = 20.0):
    """Fetch `corpus` to `dest` (kept for the next run), or raise CorpusDownloadError."""
    from tqdm import tqdm

    url = url or corpus.url
    if dest.is_file():
        logger.info("using the copy of %s already at %s", corpus.name, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    logger.info("downloading %s from %s", corpus.name, url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=corpus.name) as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError, ValueError) as err:
        partial.unlink(missing_ok=True)
        raise _download_error(corpus, url, dest, err) from err
    partial.replace(dest)
    return dest


def stream_documents(corpus: RemoteCorpus, url: str | None, timeout: float) -> Iterator[str]:
    """Documents read while downloading, for corpora too large to fetch for a sample.

    The connection opens here, not on first iteration, so an unreachable URL fails at once.
    """
    url = url or corpus.url
    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise _download_error(corpus, url, None, err) from err
    return _closing_documents(response)


def _closing_documents(response) -> Iterator[str]:
    with response:
        yield from _jsonl_zst_texts(response)


def _download_error(corpus: RemoteCorpus, url: str, dest: Path | None, err: Exception):
    reason = getattr(err, "reason", None) or err
    where = f"save it as {dest} and rerun, or " if dest else ""
    return CorpusDownloadError(
        f"could not download corpus {corpus.name!r} from {url} ({reason}). The network may be "
        f"unreachable from this machine. To fix: fetch that URL elsewhere and {where}pass the "
        f"file to tools/prepare_data.py as a local input; or pass --url with a reachable mirror; "
        f"or use the offline corpus {DEFAULT_CORPUS!r}, which needs no download."
    )


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class PreparedCorpus:
    """What was written: the jsonl.zst path and how much text it holds."""

    path: Path
    documents: int
    text_bytes: int


def write_jsonl_zst(documents: Iterable[str], output: Path, max_bytes: float | None = None):
    """Write documents as zstd-compressed jsonl, stopping once `max_bytes` of text is written."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".part")
    count = size = 0
    try:
        with open(partial, "wb") as raw:
            with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as out:
                for text in documents:
                    out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
                    count += 1
                    size += len(text.encode("utf-8"))
                    if max_bytes is not None and size >= max_bytes:
                        break
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if count == 0:
        partial.unlink()
        raise ValueError(f"no documents to write to {output}: the inputs hold no text")
    partial.replace(output)  # a half-written corpus never sits under the final name
    return PreparedCorpus(output, count, size)


def prepare_corpus(
    source: str | list[str],
    output: str | Path | None = None,
    *,
    data_dir: str | Path = "data",
    name: str | None = None,
    size_mb: float | None = None,
    url: str | None = None,
    timeout: float = DOWNLOAD_TIMEOUT_S,
    jsonl_key: str = "text",
) -> PreparedCorpus:
    """Write a named corpus, or local files/dirs/globs, to `<data_dir>/<name>/<name>.jsonl.zst`.

    Args:
        source: a name in CORPUS_NAMES, or local inputs.
        size_mb: stop after this many MB of text (pystdlib defaults to 5, pile-sample to 50).
        url: a mirror to fetch a remote corpus from instead of its public URL.
    """
    inputs = [source] if isinstance(source, str) else list(source)
    known = len(inputs) == 1 and inputs[0] in CORPUS_NAMES
    if known:
        name = name or inputs[0]
    elif name is None:
        name = _name_of(inputs[0])
    output = Path(output) if output else Path(data_dir) / name / f"{name}.jsonl.zst"
    if known and inputs[0] == DEFAULT_CORPUS:
        documents = pystdlib_documents()
        size_mb = DEFAULT_PYSTDLIB_MB if size_mb is None else size_mb
    elif known:
        corpus = REMOTE_CORPORA[inputs[0]]
        size_mb = corpus.default_mb if size_mb is None else size_mb
        if corpus.stream:
            documents = stream_documents(corpus, url, timeout)
        else:
            raw = output.parent / "raw" / os.path.basename(corpus.url)
            documents = corpus.to_documents(download(corpus, raw, url, timeout))
    else:
        documents = local_documents(inputs, jsonl_key)
    max_bytes = None if size_mb is None else size_mb * MB
    prepared = write_jsonl_zst(documents, output, max_bytes)
    logger.info("wrote %d documents (%.1f MB of text) to %s", *_summary(prepared))
    return prepared


def _name_of(path: str) -> str:
    # A glob is named after the folder before its first wildcard: "docs/**/*.md" -> "docs".
    stem = Path(re.split(r"[*?\[]", path, maxsplit=1)[0].rstrip("/")).name or "corpus"
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def _summary(prepared: PreparedCorpus) -> tuple[int, float, Path]:
    return prepared.documents, prepared.text_bytes / MB, prepared.path

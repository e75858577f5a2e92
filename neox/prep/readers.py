"""Stream documents from jsonl (plain, .zst, .gz, .xz), lm-dataformat archives and text files.

Reading is split in two so it scales across processes: `iter_raw_batches` (one process) streams
and decompresses files into ~1 MiB batches of whole lines; `parse_batch` (any worker) turns a
batch into document texts. Bad input never vanishes: each malformed JSON line, invalid UTF-8,
missing key, non-text value or empty document is counted in `Issues` by reason with its
file:line, and `strict=True` makes the first one fatal.

Formats, chosen by file name:
- `.jsonl`, `.jsonl.zst`, `.jsonl.gz`, `.jsonl.xz`: one JSON object per line; the text is the value
  of each of `keys`. As lm-dataformat does, a list of strings is joined with blank lines and a
  line that is a bare JSON string is the text for every key.
- `.jsonl.zst.tar`: an lm-dataformat archive, a tar of `.jsonl.zst` members.
- `.txt`, `.txt.zst`, `.txt.gz`, `.txt.xz`: the whole file is ONE document (as lm-dataformat reads
  it), the same text for every key. Split a corpus into files, or convert it to jsonl, to get
  several documents.
Directories are walked recursively (supported files only, sorted); globs are expanded and sorted.
"""

from __future__ import annotations

import glob
import gzip
import logging
import lzma
import os
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import ujson
import zstandard

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".jsonl.xz")
TEXT_SUFFIXES = (".txt", ".txt.zst", ".txt.gz", ".txt.xz")
ARCHIVE_SUFFIXES = (".jsonl.zst.tar",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + TEXT_SUFFIXES + ARCHIVE_SUFFIXES

# lm-dataformat joins a list of paragraphs with a blank line; keep that for identical output.
PARAGRAPH_JOINER = "\n\n"
_READ_SIZE = 1 << 20


class InputError(ValueError):
    """An input file is missing, unsupported, corrupt, or (with strict) holds a bad document."""


def expand_inputs(inputs: str | Sequence[str]) -> list[str]:
    """Files named by a comma-separated string or list of files, directories and globs, in order."""
    specs = inputs.split(",") if isinstance(inputs, str) else list(inputs)
    files: list[str] = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        if glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise InputError(f"input glob {spec!r} matches no file")
            for m in matches:
                files.extend(_walk(m) if os.path.isdir(m) else [_check_supported(m, spec)])
        elif os.path.isdir(spec):
            found = _walk(spec)
            if not found:
                raise InputError(
                    f"input directory {spec} holds no supported file ({', '.join(SUPPORTED_SUFFIXES)})"
                )
            files.extend(found)
        elif os.path.isfile(spec):
            files.append(_check_supported(spec, spec))
        else:
            raise InputError(f"input {spec} does not exist (no such file, directory or glob match)")
    if not files:
        raise InputError(f"no input files given (--input {inputs!r})")
    # Naming a file twice (a dir and a glob over it) must not tokenize it twice.
    return list(dict.fromkeys(files))


def _check_supported(path: str, spec: str) -> str:
    if not path.endswith(SUPPORTED_SUFFIXES):
        raise InputError(
            f"input {path} (from {spec!r}) has an unsupported extension; "
            f"supported: {', '.join(SUPPORTED_SUFFIXES)}"
        )
    return path


def _walk(directory: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(SUPPORTED_SUFFIXES):
                found.append(path)
            else:
                logger.info("ignoring %s: not a supported input file", path)
    return found


@dataclass(slots=True)
class RawBatch:
    """Whole lines (or a whole text file) from one source, ready to parse in any process."""

    source: str
    first_line: int  # 1-based line number of the first line in `data`
    data: bytes
    whole_document: bool = False  # a text file: `data` is one document
    disk_bytes: int = 0  # on-disk (compressed) bytes consumed since the previous batch


def _decompressed_chunks(raw: BinaryIO, name: str, size: int = _READ_SIZE) -> Iterator[bytes]:
    """Decompressed bytes of `raw`; a truncated or corrupt stream raises InputError naming it."""
    try:
        if name.endswith(".zst"):
            # zstandard's stream_reader returns short data instead of failing on truncated input,
            # so drive decompressobj and check that the last frame ended.
            dctx = zstandard.ZstdDecompressor()
            dobj = dctx.decompressobj()
            pending = False
            while chunk := raw.read(size):
                while chunk:
                    out = dobj.decompress(chunk)
                    pending = not dobj.eof
                    if out:
                        yield out
                    chunk = dobj.unused_data if dobj.eof else b""
                    if dobj.eof:  # concatenated frames: start the next one
                        dobj = dctx.decompressobj()
            if pending:
                raise EOFError("zstd stream ends inside a frame")
        elif name.endswith((".gz", ".xz")):
            stream = gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else lzma.LZMAFile(raw)
            with stream as f:
                while chunk := f.read(size):
                    yield chunk
        else:
            while chunk := raw.read(size):
                yield chunk
    except (EOFError, OSError, zstandard.ZstdError, lzma.LZMAError) as e:
        raise InputError(
            f"{name} is truncated or corrupt ({type(e).__name__}: {e}); re-download or "
            "re-compress it, or leave it out of --input"
        ) from e


def _line_batches(
    chunks: Iterable[bytes], source: str, raw: BinaryIO, batch_bytes: int
) -> Iterator[RawBatch]:
    line, pending, consumed = 1, b"", raw.tell()
    for chunk in chunks:
        buf = pending + chunk if pending else chunk
        if len(buf) < batch_bytes:
            pending = buf
            continue
        cut = buf.rfind(b"\n") + 1
        if cut == 0:  # one line longer than a batch: keep reading until it ends
            pending = buf
            continue
        body, pending = buf[:cut], buf[cut:]
        pos = raw.tell()
        yield RawBatch(source, line, body, disk_bytes=pos - consumed)
        consumed = pos
        line += body.count(b"\n")
    if pending or raw.tell() > consumed:
        yield RawBatch(source, line, pending, disk_bytes=raw.tell() - consumed)


def iter_raw_batches(paths: Sequence[str], batch_bytes: int = _READ_SIZE) -> Iterator[RawBatch]:
    """Stream every file as batches of about `batch_bytes` decompressed bytes of whole lines."""
    for path in paths:
        with open(path, "rb") as raw:
            if path.endswith(ARCHIVE_SUFFIXES):
                yield from _archive_batches(path, raw, batch_bytes)
            elif path.endswith(TEXT_SUFFIXES):
                data = b"".join(_decompressed_chunks(raw, path))
                yield RawBatch(path, 1, data, whole_document=True, disk_bytes=raw.tell())
            else:
                chunks = _decompressed_chunks(raw, path, min(batch_bytes, _READ_SIZE))
                yield from _line_batches(chunks, path, raw, batch_bytes)


def _archive_batches(path: str, raw: BinaryIO, batch_bytes: int) -> Iterator[RawBatch]:
    try:
        tar = tarfile.open(fileobj=raw, mode="r|")
        for member in tar:
            if not member.isfile():
                continue
            source = f"{path}/{member.name}"
            fobj = tar.extractfile(member)
            if not member.name.endswith(".jsonl.zst"):
                logger.info("ignoring %s: not a .jsonl.zst member", source)
                continue
            yield from _line_batches(_decompressed_chunks(fobj, source), source, raw, batch_bytes)
    except tarfile.TarError as e:
        raise InputError(f"{path} is not a readable tar archive ({e}); re-create it") from e


@dataclass
class Issues:
    """Problems found in the input, counted by reason, with the first examples kept."""

    max_examples: int = 10
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, source: str, line: int, detail: str = "") -> None:
        """Count one problem (and keep it as an example while there is room)."""
        self.counts[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{source}:{line}: {reason}" + (f" ({detail})" if detail else ""))

    def merge(self, other: Issues) -> None:
        """Add another batch's counts and examples."""
        self.counts.update(other.counts)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])

    @property
    def total(self) -> int:
        """Problems of every reason."""
        return sum(self.counts.values())


@dataclass
class ParsedBatch:
    """Document texts of one RawBatch, one list per key, plus what was read and skipped."""

    texts: dict[str, list[str]]
    documents: int  # records read (a jsonl line or a text file), good or bad
    issues: Issues
    input_bytes: int
    disk_bytes: int


def fail_document(
    strict: bool, issues: Issues, reason: str, source: str, line: int, detail: str = ""
):
    """Count one bad document, or with strict raise InputError naming it."""
    if strict:
        raise InputError(
            f"{source}:{line}: {reason}" + (f" ({detail})" if detail else "") + "; fix or remove "
            "that document, or run without --strict to skip and count such documents"
        )
    issues.add(reason, source, line, detail)


def _valid_text(text: str) -> bool:
    # JSON "\ud800" escapes decode to lone surrogates, which no UTF-8 tokenizer accepts.
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _add_text(value, key, out, strict, issues, source, line) -> None:
    if type(value) is list and all(type(v) is str for v in value):
        value = PARAGRAPH_JOINER.join(value)
    if type(value) is not str:
        kind = "missing" if value is None else type(value).__name__
        if kind == "missing":
            fail_document(strict, issues, f"missing key {key!r}", source, line)
        else:
            fail_document(strict, issues, f"key {key!r} is not text", source, line, f"a {kind}")
    elif not value:
        fail_document(strict, issues, "empty document", source, line, f"key {key!r}")
    elif not _valid_text(value):
        fail_document(strict, issues, "invalid UTF-8", source, line, "lone surrogate escape")
    else:
        out.append(value)


def parse_batch(
    batch: RawBatch, keys: Sequence[str] = ("text",), strict: bool = False, max_examples: int = 10
) -> ParsedBatch:
    """Parse a RawBatch into texts per key, counting (or, if strict, raising on) bad documents."""
    issues = Issues(max_examples)
    texts: dict[str, list[str]] = {k: [] for k in keys}
    src = batch.source
    if batch.whole_document:
        try:
            text = batch.data.decode("utf-8")
        except UnicodeDecodeError as e:
            fail_document(strict, issues, "invalid UTF-8", src, 1, f"byte {e.start}")
        else:
            for k in keys:
                _add_text(text, k, texts[k], strict, issues, src, 1)
        return ParsedBatch(texts, 1, issues, len(batch.data), batch.disk_bytes)

    lines = batch.data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the newline ending the last line
    loads, documents, outs = ujson.loads, 0, [texts[k] for k in keys]
    for i, raw in enumerate(lines):
        try:
            obj = loads(raw)
        except ValueError as e:
            if not raw.strip():
                issues.add("blank line", src, batch.first_line + i)  # not a document
                continue
            documents += 1
            line = batch.first_line + i
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as u:
                fail_document(strict, issues, "invalid UTF-8", src, line, f"byte {u.start}")
            else:
                fail_document(strict, issues, "malformed JSON", src, line, str(e)[:80])
            continue
        documents += 1
        if type(obj) is dict:
            for key, out in zip(keys, outs):
                value = obj.get(key)
                if type(value) is str and value and value.isascii():
                    out.append(value)  # the common case, kept short
                else:
                    _add_text(value, key, out, strict, issues, src, batch.first_line + i)
        elif type(obj) is str:
            for key, out in zip(keys, outs):
                _add_text(obj, key, out, strict, issues, src, batch.first_line + i)
        else:
            kind = type(obj).__name__
            fail_document(
                strict, issues, "not a JSON object", src, batch.first_line + i, f"a {kind}"
            )
    return ParsedBatch(texts, documents, issues, len(batch.data), batch.disk_bytes)


@dataclass
class ParsedRecords:
    """The JSON objects of one RawBatch with their line numbers, plus what was read and skipped."""

    records: list[tuple[int, dict]]
    documents: int
    issues: Issues
    input_bytes: int
    disk_bytes: int


def parse_records(batch: RawBatch, strict: bool = False, max_examples: int = 10) -> ParsedRecords:
    """Parse a RawBatch of jsonl into whole objects (for structured fields such as chat
    messages), counting (or, if strict, raising on) lines that are not JSON objects."""
    issues = Issues(max_examples)
    src, records, documents = batch.source, [], 0
    if batch.whole_document:
        fail_document(strict, issues, "not jsonl", src, 1, "a text file holds no JSON records")
        return ParsedRecords(records, 1, issues, len(batch.data), batch.disk_bytes)
    lines = batch.data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    for i, raw in enumerate(lines):
        line = batch.first_line + i
        if not raw.strip():
            issues.add("blank line", src, line)
            continue
        documents += 1
        try:
            obj = ujson.loads(raw)
        except ValueError as e:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as u:
                fail_document(strict, issues, "invalid UTF-8", src, line, f"byte {u.start}")
            else:
                fail_document(strict, issues, "malformed JSON", src, line, str(e)[:80])
            continue
        if type(obj) is not dict:
            fail_document(strict, issues, "not a JSON object", src, line, f"a {type(obj).__name__}")
            continue
        records.append((line, obj))
    return ParsedRecords(records, documents, issues, len(batch.data), batch.disk_bytes)


def iter_documents(
    inputs: str | Sequence[str],
    keys: Sequence[str] = ("text",),
    strict: bool = False,
    issues: Issues | None = None,
) -> Iterator[dict[str, str]]:
    """Yield {key: text} per key found, document by document, in one process (for small jobs)."""
    issues = issues if issues is not None else Issues()
    for batch in iter_raw_batches(expand_inputs(inputs)):
        parsed = parse_batch(batch, keys, strict, issues.max_examples)
        issues.merge(parsed.issues)
        # Rebuild per-document dicts only for this convenience API; the pipeline keeps lists.
        if len(keys) == 1:
            yield from ({keys[0]: t} for t in parsed.texts[keys[0]])
        else:
            yield from _zip_by_document(batch, keys)


def _zip_by_document(batch: RawBatch, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    if batch.whole_document:
        parts = [batch]
    else:
        lines = batch.data.split(b"\n")
        parts = [RawBatch(batch.source, batch.first_line + n, raw) for n, raw in enumerate(lines)]
    for one in parts:
        parsed = parse_batch(one, keys, strict=False, max_examples=0)
        doc = {k: v[0] for k, v in parsed.texts.items() if v}
        if doc:
            yield doc

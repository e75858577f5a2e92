"""Tokenize documents into indexed datasets (<prefix>_<key>_document.bin/.idx), as gpt-neox does.

One reader process streams and decompresses input into ~1 MiB batches of lines; `workers`
processes parse JSON and tokenize whole batches (tokenizer built once per worker); the main
process writes each batch's tokens in one chunk, in input order. One batch per worker is in
flight, so memory stays bounded whatever the corpus size.

Output goes to temporary files beside the final ones and is renamed at the end (the .idx
last), so an interrupted run never leaves a dataset that looks complete, and an existing
dataset is replaced only by a complete one (and only with `overwrite=True`). A worker that dies
(the OOM killer) aborts the run the same way, with an error naming it, instead of hanging it.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from neox.data.indexed import IndexedDatasetBuilder, best_dtype, data_path, index_path
from neox.prep.readers import Issues, RawBatch, expand_inputs, iter_raw_batches, parse_batch

logger = logging.getLogger(__name__)


@dataclass
class PreprocessConfig:
    """What to tokenize, how, and where to write it (gpt-neox preprocess_data.py flags)."""

    inputs: str | Sequence[str]
    output_prefix: str
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    jsonl_keys: Sequence[str] = ("text",)
    append_eod: bool = False
    ftfy: bool = False
    workers: int = 1
    """Tokenizing processes; 0 tokenizes in the main process (no pool, for debugging)."""
    strict: bool = False
    """Stop at the first bad document instead of skipping and counting it."""
    log_interval: int = 100
    """Documents between progress log lines (the bar itself updates every batch)."""
    num_docs: int | None = None
    """Expected documents, if known: the progress bar then counts documents, not bytes."""
    max_shard_tokens: int | None = None
    """Start a new output shard (<name>_00000, _00001, ...) after this many tokens."""
    overwrite: bool = False
    """Replace existing output datasets (atomically) instead of refusing to start."""
    batch_bytes: int = 1 << 20
    max_examples: int = 10
    progress: bool = True


@dataclass
class PreprocessReport:
    """What one run read, wrote and skipped."""

    files: int = 0
    documents_read: int = 0
    documents_written: dict[str, int] = field(default_factory=dict)
    tokens_written: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0  # decompressed bytes parsed
    disk_bytes: int = 0  # bytes read from disk
    elapsed_s: float = 0.0
    issues: Issues = field(default_factory=Issues)
    outputs: dict[str, list[str]] = field(default_factory=dict)
    notes: Counter = field(default_factory=Counter)

    def format(self) -> str:
        """Multi-line human summary."""
        mb = self.input_bytes / 1e6
        rate = mb / self.elapsed_s if self.elapsed_s else 0.0
        lines = [
            f"read {self.documents_read} documents from {self.files} files "
            f"({mb:.1f} MB of text, {self.disk_bytes / 1e6:.1f} MB on disk) in "
            f"{self.elapsed_s:.1f} s ({rate:.2f} MB/s)"
        ]
        for key, n in self.documents_written.items():
            lines.append(
                f"key {key!r}: wrote {n} documents, {self.tokens_written[key]} tokens to "
                + ", ".join(self.outputs.get(key, []))
            )
        if self.issues.total:
            lines.append(f"skipped {self.issues.total} (bad input, by reason):")
            lines += [f"  {reason}: {n}" for reason, n in self.issues.counts.most_common()]
            lines.append("first examples:")
            lines += [f"  {e}" for e in self.issues.examples]
        else:
            lines.append("skipped nothing")
        lines += [f"note: {n} documents {what}" for what, n in self.notes.most_common()]
        return "\n".join(lines)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """gpt-neox's dataset name for one jsonl key: <output_prefix>_<key>_document."""
    return f"{output_prefix}_{key}_document"


@dataclass
class EncodedBatch:
    """Tokens of one RawBatch: per key, the concatenated ids and each document's size."""

    tokens: dict[str, tuple[np.ndarray, np.ndarray]]
    documents: int
    issues: Issues
    input_bytes: int
    disk_bytes: int
    notes: Counter = field(default_factory=Counter)
    """Documents written but worth a word in the report, by what is noted."""


class TextEncoder:
    """One dataset per jsonl key of tokenized text (the tokenizer is built once per process,
    then reused for every batch)."""

    def __init__(self, config: PreprocessConfig, dtype: np.dtype, tokenizer=None):
        from neox.tokenizer import build_tokenizer

        self.config = config
        self.dtype = dtype
        self.tokenizer = tokenizer or build_tokenizer(
            config.tokenizer_type, config.vocab_file, config.merge_file
        )
        if config.ftfy:
            import ftfy

            self.fix = ftfy.fix_text

    @property
    def outputs(self) -> dict[str, tuple[str, np.dtype]]:
        """Dataset name (a key of EncodedBatch.tokens) -> (output prefix, token dtype)."""
        return {
            key: (output_prefix_for(self.config.output_prefix, key), self.dtype)
            for key in self.config.jsonl_keys
        }

    def describe(self) -> str:
        """What tokenizes, for the log."""
        tok = self.tokenizer
        return f"{type(tok).__name__} (vocab {tok.vocab_size}, {self.dtype})"

    def encode(self, batch: RawBatch) -> EncodedBatch:
        cfg = self.config
        parsed = parse_batch(batch, cfg.jsonl_keys, cfg.strict, cfg.max_examples)
        eod = [self.tokenizer.eod]
        tokens = {}
        for key, texts in parsed.texts.items():
            if cfg.ftfy:
                texts = [self.fix(t) for t in texts]
            ids = self.tokenizer.encode_batch(texts) if texts else []
            if any(not x for x in ids):
                ids = self._drop_empty(ids, key, batch, parsed.issues)
            sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            if cfg.append_eod:
                sizes += 1
                pairs = itertools.chain.from_iterable(zip(ids, itertools.repeat(eod)))
                flat = itertools.chain.from_iterable(pairs)
            else:
                flat = itertools.chain.from_iterable(ids)
            total = int(sizes.sum())
            tokens[key] = (np.fromiter(flat, dtype=self.dtype, count=total), sizes)
        return EncodedBatch(
            tokens, parsed.documents, parsed.issues, parsed.input_bytes, parsed.disk_bytes
        )

    def _drop_empty(self, ids, key, batch, issues):
        # A document that yields no tokens would be an empty sequence (gpt-neox fails on it).
        for _ in range(sum(1 for x in ids if not x)):
            if self.config.strict:
                from neox.prep.readers import InputError

                raise InputError(f"{batch.source}: a document of key {key!r} yields no tokens")
            where = f"key {key!r}, in the batch from this line on"
            issues.add("no tokens", batch.source, batch.first_line, where)
        return [x for x in ids if x]


class Encoder(Protocol):
    """Turns a RawBatch into the tokens of each output dataset (run in forked workers)."""

    outputs: dict[str, tuple[str, np.dtype]]

    def encode(self, batch: RawBatch) -> EncodedBatch: ...

    def describe(self) -> str: ...


_WORKER: Encoder | None = None


def _init_worker() -> None:
    # Each worker tokenizes on one core; the pool provides the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # The parent turns SIGTERM and Ctrl-C into cleanup, which ends the workers.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked across the fork


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then reach the handler set by then.

    Recorded, not blocked: a thread's signal mask holds nothing back from a process with other
    threads (a tokenizer's), and any thread's signal runs Python's handlers in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # no handler interrupts this thread
        return
    arrived: list[int] = []

    def record(signum, frame) -> None:
        arrived.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # Unless the block set its own (`finished`); None: a handler not set from Python.
            if signal.getsignal(sig) is record and handler is not None:
                signal.signal(sig, handler)
        for sig in arrived:
            signal.raise_signal(sig)


class _ShardedWriter:
    """Writes one key's dataset (optionally in shards) to temp files; `commit` renames them."""

    def __init__(self, prefix: str, dtype: np.dtype, max_shard_tokens: int | None):
        self.prefix, self.dtype, self.max_tokens = prefix, dtype, max_shard_tokens
        self.done: list[str] = []  # final prefixes of finished shards
        self.tmp_suffix = f".tmp{os.getpid()}"
        self.documents = self.tokens = self._shard_tokens = 0
        self._builder: IndexedDatasetBuilder | None = None

    def _final_prefix(self, n: int) -> str:
        return self.prefix if self.max_tokens is None else f"{self.prefix}_{n:05d}"

    def _open(self) -> None:
        final = self._final_prefix(len(self.done))
        self._builder = IndexedDatasetBuilder(data_path(final) + self.tmp_suffix, self.dtype)
        self._shard_tokens = 0

    def write(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        if self._builder is None:
            self._open()
        if self.max_tokens is None or self._shard_tokens + tokens.size <= self.max_tokens:
            self._append(tokens, sizes)
            return
        # Split at document boundaries: fill this shard, then start the next one.
        ends = np.cumsum(sizes)
        start_doc = start_tok = 0
        while start_doc < len(sizes):
            room = self.max_tokens - self._shard_tokens
            take = int(np.searchsorted(ends - start_tok, room, side="right")) - start_doc
            if take <= 0 and self._shard_tokens == 0:
                take = 1  # a document bigger than a shard gets a shard of its own
            if take <= 0:
                self._finish_shard()
                self._open()
                continue
            stop_tok = int(ends[start_doc + take - 1])
            self._append(tokens[start_tok:stop_tok], sizes[start_doc : start_doc + take])
            start_doc, start_tok = start_doc + take, stop_tok

    def _append(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        self._builder.add_documents(tokens, sizes)
        self._shard_tokens += tokens.size
        self.tokens += tokens.size
        self.documents += len(sizes)

    def _finish_shard(self) -> None:
        final = self._final_prefix(len(self.done))
        self._builder.finalize(index_path(final) + self.tmp_suffix)
        self._builder = None
        self.done.append(final)

    def finish(self) -> None:
        """Write the last shard's index, still under its temp name."""
        if self._builder is None and not self.done:
            self._open()  # no documents: still write an empty, valid dataset
        if self._builder is not None:
            self._finish_shard()

    def commit(self) -> list[str]:
        """Move every finished shard to its final name (.bin, then .idx)."""
        self.finish()
        for final in self.done:
            if os.path.exists(index_path(final)):
                os.remove(index_path(final))  # never pair a new .bin with an old .idx
            os.replace(data_path(final) + self.tmp_suffix, data_path(final))
            os.replace(index_path(final) + self.tmp_suffix, index_path(final))
        return self.done

    def abort(self) -> None:
        """Delete this run's temp files; existing datasets are untouched."""
        if self._builder is not None:
            self._builder.close()
        names = [self._final_prefix(i) for i in range(len(self.done) + 1)]
        for final in names:
            for path in (data_path(final), index_path(final)):
                for tmp in (path + self.tmp_suffix, path + self.tmp_suffix + ".tmp"):
                    if os.path.exists(tmp):
                        os.remove(tmp)


def check_outputs(config: PreprocessConfig, prefixes: list[str] | None = None) -> list[str]:
    """Refuse, before any work, outputs that exist (unless overwrite) or cannot be written.

    Args:
        prefixes: the datasets to write (default: one per jsonl key).
    """
    directory = os.path.dirname(os.path.abspath(config.output_prefix))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"output directory {directory} does not exist (from --output-prefix "
            f"{config.output_prefix}); create it first"
        )
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"output directory {directory} is not writable")
    if prefixes is None:
        prefixes = [output_prefix_for(config.output_prefix, k) for k in config.jsonl_keys]
    remove_stale_temps(prefixes)
    if not config.overwrite:
        for prefix in prefixes:
            pattern = [prefix] if config.max_shard_tokens is None else [f"{prefix}_00000"]
            for p in pattern:
                if os.path.exists(data_path(p)) and not os.path.exists(index_path(p)):
                    # commit() moves the .bin first: a lone .bin is a run killed mid-commit.
                    logger.warning("replacing %s, left without its .idx", data_path(p))
                elif os.path.exists(data_path(p)) or os.path.exists(index_path(p)):
                    raise FileExistsError(
                        f"output dataset {p}.bin/.idx already exists; choose another "
                        "--output-prefix or pass --overwrite to replace it when the run succeeds"
                    )
    return prefixes


def _validate(config: PreprocessConfig) -> None:
    if config.workers < 0:
        raise ValueError(f"workers={config.workers} must be >= 0")
    if not config.jsonl_keys or len(set(config.jsonl_keys)) != len(config.jsonl_keys):
        raise ValueError(f"jsonl_keys={list(config.jsonl_keys)} must be non-empty and distinct")
    if config.max_shard_tokens is not None and config.max_shard_tokens <= 0:
        raise ValueError(f"max_shard_tokens={config.max_shard_tokens} must be positive")
    if config.ftfy:
        import ftfy  # noqa: F401  (fail now, not inside a worker)


def preprocess(
    config: PreprocessConfig,
    encoder: Encoder | None = None,
    finished: Callable[[], None] | None = None,
) -> PreprocessReport:
    """Tokenize `config.inputs` into indexed datasets; returns the report.

    A stop signal (SIGINT, SIGTERM) while the datasets are renamed into place waits until they
    are: the run is aborted whole or finished whole.

    Args:
        encoder: what turns input into datasets (neox.prep.chat, neox.prep.masking); default:
            one dataset per jsonl key with `config`'s tokenizer.
        finished: called once the datasets are in place, before a held stop signal is let
            through (the tools ignore stop signals from then on).
    """
    _validate(config)
    files = expand_inputs(config.inputs)
    if encoder is None:
        # Build the tokenizer here too: a bad vocab file fails now, and dtype needs vocab_size.
        from neox.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(config.tokenizer_type, config.vocab_file, config.merge_file)
        encoder = TextEncoder(config, best_dtype(tokenizer.vocab_size), tokenizer)
    outputs = encoder.outputs
    prefixes = check_outputs(config, [prefix for prefix, _ in outputs.values()])
    logger.info(
        "tokenizing %d files with %s on %d workers into %s",
        len(files),
        encoder.describe(),
        config.workers,
        ", ".join(prefixes),
    )
    report = PreprocessReport(files=len(files), issues=Issues(config.max_examples))
    writers = {
        name: _ShardedWriter(prefix, dtype, config.max_shard_tokens)
        for name, (prefix, dtype) in outputs.items()
    }
    start = time.perf_counter()
    pool = None
    try:
        batches = iter_raw_batches(files, config.batch_bytes)
        if config.workers == 0:
            results = (encoder.encode(b) for b in batches)
        else:
            # Forked workers inherit the encoder built here: no tokenizer is loaded twice.
            global _WORKER
            _WORKER = encoder
            pool = _WorkerPool(config.workers)
            results = pool.ordered(batches)
        _consume(results, writers, report, config, files, start)
        _check_not_empty(writers, report, config.jsonl_keys)
        for w in writers.values():
            w.finish()
        with _stop_signals_held():
            for key, w in writers.items():
                report.outputs[key] = w.commit()
            if finished is not None:
                finished()
    except BaseException:
        with _stop_signals_held():  # a second signal must not cut the cleanup short
            for w in writers.values():
                w.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
    report.elapsed_s = time.perf_counter() - start
    return report


def _check_not_empty(
    writers: dict[str, _ShardedWriter], report: PreprocessReport, keys: Sequence[str]
) -> None:
    """A dataset without documents trains nothing: say why instead of writing it."""
    from neox.prep.readers import InputError

    empty = [name for name, w in writers.items() if w.documents == 0]
    if not empty:
        return
    # Name the user's --jsonl-keys, not the label or reward datasets derived from them.
    empty = [key for key in keys if key in empty] or empty
    reasons = ", ".join(f"{r}: {n}" for r, n in report.issues.counts.most_common()) or "none"
    examples = "".join(f"\n  {e}" for e in report.issues.examples[:3])
    raise InputError(
        f"no document yielded tokens for --jsonl-keys {' '.join(empty)} "
        f"({report.documents_read} documents read; skipped by reason: {reasons}){examples}\n"
        "check that --jsonl-keys names the documents' text field and that the input is "
        "jsonl/text of the expected format"
    )


def remove_stale_temps(prefixes: list[str]) -> list[str]:
    """Delete temp files of earlier runs at these prefixes whose process is gone (kill -9)."""
    removed = []
    for prefix in prefixes:
        for path in glob.glob(glob.escape(prefix) + "*.tmp*"):
            match = re.search(r"\.(?:bin|idx)\.tmp(\d+)(?:\.tmp)?$", path)
            if match and not _process_alive(int(match.group(1))):
                os.remove(path)
                removed.append(path)
    for path in removed:
        logger.warning("removed %s, left by an interrupted run", path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class WorkerDiedError(ChildProcessError):
    """A tokenizing worker process ended in the middle of the run (killed, e.g. out of memory)."""


class _WorkerPool:
    """Forked tokenizing workers, one pipe each; a worker that dies aborts the run.

    Not concurrent.futures' ProcessPoolExecutor: its workers share one result pipe, and a worker
    killed halfway through writing a result (results are megabytes) leaves the executor reading
    the rest forever (seen in CI). A worker that owns its pipe can only end it: its death is
    end-of-file there. Each worker holds one batch at a time, so a full pipe never blocks both
    sides; batches are collected round-robin, which is input order.
    """

    def __init__(self, workers: int):
        ctx = multiprocessing.get_context("fork")
        self._conns: list = []
        self._procs: list = []
        for i in range(workers):
            mine, theirs = ctx.Pipe()
            # The child closes every parent end it inherits: else a dead parent is no EOF to it.
            parent_ends = [*self._conns, mine]
            proc = ctx.Process(
                target=_worker_main, args=(theirs, parent_ends), name=f"tokenize-{i}", daemon=True
            )
            # Blocked while a worker forks (it inherits this thread's mask): one arriving before
            # the worker has set its own handlers would run the parent's there (a
            # KeyboardInterrupt traceback on Ctrl-C).
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()  # only the worker may hold its end: its death is then our EOF
            self._conns.append(mine)
            self._procs.append(proc)

    def ordered(self, batches):
        """Results in input order."""
        batches = iter(batches)
        turn: deque[int] = deque()
        for i in range(len(self._procs)):
            batch = next(batches, None)
            if batch is None:
                break
            self._send(i, batch)
            turn.append(i)
        upcoming = next(batches, None)  # read ahead: a worker that hands back gets it at once
        while turn:
            i = turn.popleft()
            result = self._receive(i)
            if upcoming is not None:
                self._send(i, upcoming)
                turn.append(i)
                upcoming = next(batches, None)
            yield result

    def _send(self, i: int, batch: RawBatch) -> None:
        try:
            self._conns[i].send(batch)
        except OSError:  # BrokenPipeError, ConnectionResetError: the worker is gone
            raise self._died(i) from None

    def _receive(self, i: int) -> EncodedBatch:
        try:
            ok, result = self._conns[i].recv()
        except (EOFError, OSError):
            raise self._died(i) from None
        if not ok:
            raise result  # the worker's own error (bad input), as if raised here
        return result

    def _died(self, i: int) -> WorkerDiedError:
        proc = self._procs[i]
        proc.join(timeout=10)  # its pipe ended: it is dead or exiting
        return WorkerDiedError(
            f"tokenizing worker pid {proc.pid} ({_exit_reason(proc.exitcode)}) died mid-run, as "
            "when the out-of-memory killer ends it; rerun with fewer --workers or more memory"
        )

    def close(self) -> None:
        """Stop now: in-flight batches are dropped (the run succeeded or is being aborted)."""
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()


def _worker_main(conn, parent_ends) -> None:
    for end in parent_ends:
        end.close()
    _init_worker()
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return  # the parent closed the pool or died
        try:
            reply = (True, _WORKER.encode(batch))
        except Exception as e:
            reply = (False, e)
        try:
            conn.send(reply)
        except OSError:
            return  # the parent is gone
        except Exception as err:  # the reply does not pickle: send what went wrong, in words
            what = err if reply[0] else reply[1]
            conn.send((False, RuntimeError(f"{type(what).__name__}: {what}")))


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _consume(results, writers, report: PreprocessReport, config, files, start) -> None:
    from tqdm import tqdm

    by_docs = config.num_docs is not None
    total = config.num_docs if by_docs else sum(os.path.getsize(f) for f in files)
    bar = tqdm(
        total=total,
        unit="doc" if by_docs else "B",
        unit_scale=True,
        disable=not config.progress,
        desc="preprocess",
        dynamic_ncols=True,
    )
    next_log = config.log_interval
    with bar:
        for enc in results:
            for key, (tokens, sizes) in enc.tokens.items():
                writers[key].write(tokens, sizes)
            report.documents_read += enc.documents
            report.input_bytes += enc.input_bytes
            report.disk_bytes += enc.disk_bytes
            report.issues.merge(enc.issues)
            report.notes.update(enc.notes)
            bar.update(enc.documents if by_docs else enc.disk_bytes)
            elapsed = max(time.perf_counter() - start, 1e-9)
            docs_s, mb_s = report.documents_read / elapsed, report.input_bytes / elapsed / 1e6
            bar.set_postfix_str(f"{docs_s:.0f} docs/s, {mb_s:.2f} MB/s", refresh=False)
            if not config.progress and report.documents_read >= next_log:
                logger.info(
                    "processed %d documents (%.0f docs/s, %.2f MB/s)",
                    report.documents_read,
                    docs_s,
                    mb_s,
                )
                next_log = (report.documents_read // config.log_interval + 1) * config.log_interval
    for key, w in writers.items():
        report.documents_written[key] = w.documents
        report.tokens_written[key] = w.tokens

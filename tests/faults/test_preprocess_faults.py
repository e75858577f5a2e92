"""tools/preprocess_data.py under bad input and sudden death: an error and no dataset rather than
an empty one; no temp files that outlive the run that can clean them; a rerun always succeeds."""

import fcntl
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from neox.data.indexed import IndexedDataset
from neox.prep.preprocess import PreprocessConfig, TextEncoder, WorkerDiedError
from neox.prep.preprocess import preprocess as run_preprocess
from neox.prep.tool import run_preprocess as run_tool
from tests.process_helpers import alive, child_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each case starts deepy.py or preprocess_data.py


def preprocess(inp: Path, prefix: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(ROOT / "tools/preprocess_data.py"),
        "--input",
        str(inp),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "CharLevelTokenizer",
        "--append-eod",
        "--workers",
        "1",
        "--no-progress",
        *extra,
    ]
    env = child_env()
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, env=env, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + (err or "")


def outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix != ".jsonl")


def write_jsonl(path: Path, docs: int, key: str = "text") -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(docs):
            words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.randrange(20, 200)))
            f.write(json.dumps({key: f"doc {i}: {words}"}) + "\n")


def test_every_line_bad_is_an_error_and_writes_nothing(tmp_path):
    """Fault: no line of the input is valid JSON. Promise: exit 1 naming why, no dataset."""
    inp = tmp_path / "bad.jsonl"
    inp.write_text("not json\n{also not\n" * 50)
    code, log = finish(preprocess(inp, tmp_path / "out"))
    assert code == 1, log
    assert "no document yielded tokens for --jsonl-keys text" in log and "100 documents read" in log
    assert outputs(tmp_path) == []


def test_jsonl_key_no_document_has_is_an_error(tmp_path):
    """Fault: --jsonl-keys names a key absent from every document. Promise: exit 1, no dataset."""
    inp = tmp_path / "docs.jsonl"
    write_jsonl(inp, 30, key="content")
    code, log = finish(preprocess(inp, tmp_path / "out", "--jsonl-keys", "text"))
    assert code == 1, log
    assert "no document yielded tokens for --jsonl-keys text" in log
    assert outputs(tmp_path) == []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, bytes, bytes]:
    """A corpus that takes a few seconds to tokenize, and its dataset from an undisturbed run."""
    folder = tmp_path_factory.mktemp("corpus")
    inp = folder / "corpus.jsonl"
    write_jsonl(inp, 12_000)
    code, log = finish(preprocess(inp, folder / "ref"))
    assert code == 0, log
    prefix = folder / "ref_text_document"
    return inp, prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes()


class HeldRun:
    """preprocess_data.py held mid-run by its own log: a line per input file (--log-interval 1),
    more than its stderr pipe (one page) and our read buffer hold, so it cannot end while we do
    not read. Started, it has logged its first progress line; `finish` lets it go on."""

    def __init__(self, tmp_path: Path, *extra: str, **popen):
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1)  # rounded up to the smallest pipe, a page
        held = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) + io.DEFAULT_BUFFER_SIZE
        shortest = "2026-11-28 01:00:00,000 INFO processed 2 documents (0 docs/s, 0.00 MB/s)\n"
        folder = tmp_path / "corpus"
        folder.mkdir()
        write_jsonl(folder / "0.jsonl", 2)
        for i in range(1, 2 * held // len(shortest)):
            (folder / f"{i}.jsonl").write_bytes((folder / "0.jsonl").read_bytes())
        args = (folder, tmp_path / "out", "--log-interval", "1", *extra)
        self.proc = preprocess(*args, stderr=write_end, **popen)
        os.close(write_end)
        self._stderr = open(read_end)
        self.lines = [self._stderr.readline()]
        while "processed" not in self.lines[-1]:
            assert self.lines[-1], "".join(self.lines)  # it ended before its first progress line
            self.lines.append(self._stderr.readline())

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """Read its log to the end; its exit status and whole log (stdout, then stderr)."""
        reader = threading.Thread(target=lambda: self.lines.append(self._stderr.read()))
        reader.start()
        out, _ = self.proc.communicate(timeout=timeout)
        reader.join()
        self._stderr.close()
        return self.proc.returncode, out + "".join(self.lines)


def test_sigterm_leaves_no_temp_files(tmp_path):
    """Fault: SIGTERM mid-run. Promise: the run deletes its temp files and exits 143."""
    run = HeldRun(tmp_path)
    run.proc.send_signal(signal.SIGTERM)
    code, log = run.finish()
    assert code == 143, log
    assert outputs(tmp_path) == ["corpus"], log


@pytest.fixture
def own_stop_handlers():
    """The tool sets SIGTERM's and SIGINT's handlers: this test process gets its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
@pytest.mark.parametrize("moment", ["rename", "done"])
def test_a_stop_signal_once_the_dataset_is_written_finishes_the_run(
    tmp_path, monkeypatch, own_stop_handlers, sig, moment
):
    """Fault: SIGTERM or Ctrl-C while the dataset is renamed into place, or after "done" (CI
    saw one kill the tool at its exit: Python restores the default handlers there). Promise:
    the run finishes, 0 with the whole dataset; cut short, a rename would leave a .bin without
    its .idx. (The tool runs in process: the signal comes at a known point.)"""
    inp = tmp_path / "docs.jsonl"
    write_jsonl(inp, 200)
    if moment == "rename":
        rename = os.replace

        def replace_after_a_signal(src, dst):
            if str(dst).endswith(".bin"):
                os.kill(os.getpid(), sig)
            rename(src, dst)

        monkeypatch.setattr(os, "replace", replace_after_a_signal)
    log = logging.getLogger("test_preprocess_faults")

    class SignalOnDone(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if moment == "done" and record.getMessage().startswith("done"):
                os.kill(os.getpid(), sig)

    log.addHandler(SignalOnDone())
    config = PreprocessConfig(
        inputs=str(inp),
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="CharLevelTokenizer",
        workers=0,
        progress=False,
    )
    assert run_tool(log, lambda: config) == 0
    assert signal.getsignal(sig) == signal.SIG_IGN  # Python leaves SIG_IGN in place at exit
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    ds.validate()
    assert len(ds) == 200
    ds.close()
    assert outputs(tmp_path) == ["out_text_document.bin", "out_text_document.idx"]


def test_ctrl_c_stops_the_run_and_its_workers_in_one_line(tmp_path):
    """Fault: Ctrl-C in the terminal (SIGINT to the whole process group). Promise: exit 130 with
    one line saying nothing was written, no traceback, no files, no worker left."""

    def terminal_like() -> None:  # a shell's background job would ignore SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    run, workers = start_two_workers(tmp_path, start_new_session=True, preexec_fn=terminal_like)
    os.killpg(run.proc.pid, signal.SIGINT)
    code, log = run.finish()
    assert code == 130, log
    assert "interrupted" in log and "nothing was written" in log, log
    assert "Traceback" not in log, log
    assert outputs(tmp_path) == ["corpus"], log
    assert not any(alive(pid) for pid in workers), "a worker outlived the run"


def test_kill_9_at_random_points_then_rerun(corpus, tmp_path):
    """Fault: kill -9 at random points. Promise: never a half-written dataset under the final
    name, and the same command run again succeeds with the undisturbed run's bytes."""
    inp, ref_bin, ref_idx = corpus
    prefix = tmp_path / "out_text_document"
    rng = random.Random(int(os.environ.get("NEOX_FAULT_SEED", "12")))
    for _ in range(3):
        proc = preprocess(inp, tmp_path / "out", "--overwrite")
        time.sleep(rng.uniform(0.3, 2.5))  # an undisturbed run takes ~2.5 s here
        proc.kill()
        proc.wait()
        if prefix.with_suffix(".idx").exists():
            ds = IndexedDataset(str(prefix))  # a dataset under its final name is complete
            ds.validate()
            ds.close()
        code, log = finish(preprocess(inp, tmp_path / "out", "--overwrite"))
        assert code == 0, log
        assert prefix.with_suffix(".bin").read_bytes() == ref_bin
        assert prefix.with_suffix(".idx").read_bytes() == ref_idx
        assert [n for n in outputs(tmp_path) if ".tmp" in n] == [], outputs(tmp_path)


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def start_two_workers(tmp_path: Path, **popen) -> tuple[HeldRun, list[int]]:
    """preprocess_data.py on 2 workers, held mid-run; its workers."""
    run = HeldRun(tmp_path, "--workers", "2", **popen)
    workers = children(run.proc.pid)  # started before the first batch
    assert len(workers) == 2, f"workers not seen: {workers}"
    return run, workers


def test_worker_killed_by_oom_killer_aborts_the_run(tmp_path):
    """Fault: SIGKILL of one tokenizing worker mid-run (what the OOM killer does). Promise: the
    run stops within seconds, exits 1 naming the dead worker and the fix, and leaves no files."""
    run, workers = start_two_workers(tmp_path)
    os.kill(workers[0], signal.SIGKILL)
    try:
        code, log = run.finish(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in [run.proc.pid, *children(run.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        run.finish()
        pytest.fail("preprocess_data.py hung after a worker was killed")
    assert code == 1, log
    assert f"worker pid {workers[0]} (killed by SIGKILL) died mid-run" in log, log
    assert "fewer --workers or more memory" in log, log
    assert "Traceback" not in log, log
    assert outputs(tmp_path) == ["corpus"], log


class _SecondBatchDiesWhileSending:
    """Encoder whose second batch's worker is SIGKILLed while it writes a result far larger
    than a pipe holds, and whose first batch ends only once that worker is dead: the parent
    waits on the first batch meanwhile, so that write cannot have finished.
    (ProcessPoolExecutor hung forever on this.)"""

    def __init__(self, config, pid_file: Path):
        self.inner = TextEncoder(config, np.dtype(np.int32))
        self.outputs = self.inner.outputs
        self.pid_file = pid_file

    def describe(self) -> str:
        return "a test encoder"

    def encode(self, batch):
        enc = self.inner.encode(batch)
        if batch.first_line == 1:
            while not self.pid_file.exists() or alive(int(self.pid_file.read_text())):
                time.sleep(0.01)
        elif not self.pid_file.exists():  # the second batch; a later one (taken by the first
            # batch's worker before the run stops) is encoded as usual
            written = self.pid_file.with_suffix(".tmp")
            written.write_text(str(os.getpid()))
            written.rename(self.pid_file)  # whole, never an empty file
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            key = next(iter(enc.tokens))
            enc.tokens[key] = (np.zeros(16 << 20, np.int32), np.array([16 << 20]))
        return enc


@pytest.mark.timeout(60, method="thread")  # the old pool hung past a signal
def test_worker_killed_while_sending_its_result_aborts_the_run(tmp_path):
    """Fault: a worker dies halfway through handing back a (64 MB) result. Promise: the run
    stops with the dead worker's error, writes nothing, and leaves no worker behind."""
    inp = tmp_path / "corpus.jsonl"
    write_jsonl(inp, 400)
    cfg = PreprocessConfig(
        inputs=str(inp),
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="CharLevelTokenizer",
        workers=2,
        batch_bytes=4096,
        progress=False,
    )
    before = set(children(os.getpid()))
    with pytest.raises(WorkerDiedError, match=r"pid \d+ \(killed by SIGKILL\) died mid-run"):
        run_preprocess(cfg, _SecondBatchDiesWhileSending(cfg, tmp_path / "pid"))
    assert set(children(os.getpid())) <= before
    assert outputs(tmp_path) == ["pid"]


def test_workers_end_with_a_killed_parent(tmp_path):
    """Fault: kill -9 of preprocess_data.py itself. Promise: its workers end too (each sees its
    pipe close) instead of tokenizing on as orphans."""
    run, workers = start_two_workers(tmp_path)
    run.proc.kill()
    run.finish()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a worker outlived its parent"

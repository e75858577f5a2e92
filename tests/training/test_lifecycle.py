"""A run you can trust, on 2 CPU ranks: metrics, checkpoints, crashes, resume.

One uninterrupted 6-step run (ZeRO 0: the gradient norm is neox's own there) is the reference;
the other runs crash, fall back, resume or finetune from it and are compared with it. Runs about
the loop and checkpoints start their ranks from this process (`run_here`); crashes, stop signals
and kill -9 go through deepy.py (`run_train`, BackgroundRun), whose handling they test.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.process_helpers import child_env, wait_until_none
from tests.train_helpers import (
    ROOT,
    losses,
    make_dataset,
    records,
    run_here,
    run_train,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 6
GLOBAL_BATCH = 2 * 2 * 2  # micro batch x accumulation x 2 data-parallel ranks
SEQ = 32
BASE = dict(zero_optimization={"stage": 0})
WANDB_HOST = "http://wandb.example.invalid:8080"


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A directory for this module's runs, with their dataset in data/."""
    tmp = tmp_path_factory.mktemp("life")
    make_dataset(tmp / "data" / "chars")
    return tmp


@pytest.fixture(scope="module")
def ref(runs):
    """The reference run, logged to metrics.jsonl, tensorboard and W&B (offline, a run on each
    rank, for a self-hosted server)."""
    tmp = runs
    wandb = dict(use_wandb=True, wandb_project="neox-tests", wandb_init_all_ranks=True)
    cfg = write_config(tmp, "ref", wandb_host=WANDB_HOST, **wandb, **BASE)
    r = run_here("train.py", cfg, WANDB_MODE="offline", WANDB_SILENT="true")
    return tmp, r


def same(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_metrics_line_file_and_tensorboard(ref):
    tmp, r = ref
    recs = records(tmp / "ref" / "logs")
    train = {x["step"]: x for x in recs if x["split"] == "train"}
    assert sorted(train) == list(range(1, STEPS + 1))
    for step, x in train.items():
        assert x["consumed_samples"] == step * GLOBAL_BATCH
        assert x["consumed_tokens"] == step * GLOBAL_BATCH * SEQ
        assert 0 < x["grad_norm"] < 100 and x["lr"] > 0
        assert x["skipped_steps"] == 0 and x["nonfinite_steps"] == 0
        assert x["step_time_s"] > 0 and x["rss_gb"] > 0.05
        assert x["tokens_per_s"] == pytest.approx(x["samples_per_s"] * SEQ)
        assert x["tokens_per_s_per_gpu"] == pytest.approx(x["tokens_per_s"] / 2)
        assert x["samples_per_s"] == pytest.approx(GLOBAL_BATCH / x["step_time_s"])
    assert train[STEPS]["eta_s"] == 0 and train[1]["eta_s"] > 0
    # The cosine decay after one warmup step.
    assert train[2]["lr"] > train[4]["lr"] > train[6]["lr"]
    valid = {x["step"]: x for x in recs if x["split"] == "valid"}
    assert sorted(valid) == [3, 6] and all(v["eval_time_s"] > 0 for v in valid.values())
    assert sorted(x["step"] for x in recs if x["split"] == "save") == [3, 6]
    # The same numbers on rank 0's line...
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if "iter 6/6" in ln)
    assert f"loss {train[6]['loss']:.4f}" in line and "samples 48 tokens 1.54k" in line
    assert f"gnorm {train[6]['grad_norm']:.3g}" in line and "rss" in line and "eta 0:00:00" in line
    # ...and in tensorboard.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "ref" / "tb"))
    events.Reload()
    for tag in ("loss", "grad_norm", "consumed_tokens", "lr"):
        scalars = {e.step: e.value for e in events.Scalars(f"train/{tag}")}
        assert scalars.keys() == train.keys()
        assert all(same(scalars[s], train[s][tag]) for s in train), tag


def test_wandb_offline_runs_hold_the_metrics_and_the_host(ref):
    tmp, _ = ref
    run_files = sorted((tmp / "ref" / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    # W&B's offline record file stores each logged value as its JSON text.
    runs = [f.read_bytes() for f in run_files]
    assert len(runs) == 2  # wandb_init_all_ranks: one per rank; rank 0's holds the metrics
    [data] = [r for r in runs if b"train/grad_norm" in r]
    assert all(WANDB_HOST.encode() in r for r in runs)  # the server `wandb sync` sends them to
    assert b"valid/loss" in data
    for step, loss in losses(tmp / "ref" / "logs").items():
        assert json.dumps(loss).encode() in data, step
    assert json.dumps(losses(tmp / "ref" / "logs", "valid")[STEPS]).encode() in data


def test_plot_metrics_writes_a_png(ref, tmp_path):
    tmp, _ = ref
    out = tmp_path / "plot.png"
    logs = str(tmp / "ref" / "logs")
    r = subprocess.run(
        [sys.executable, "tools/plot_metrics.py", logs, logs, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 500 and len(data) > 20_000


def test_checkpoint_is_complete_and_self_describing(ref):
    tmp, _ = ref
    ckpt = tmp / "ref" / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step6"
    assert not list(ckpt.glob("*.partial")) and not list(ckpt.glob(".*tmp"))
    step = ckpt / "global_step6"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["iteration"] == STEPS and manifest["padded_vocab_size"] == 512
    for name, size in manifest["files"].items():
        assert (step / name).stat().st_size == size
    assert {"state/meta.json", "state/rank_00000.safetensors"} <= set(manifest["files"])
    assert yaml.safe_load((step / "config.yml").read_text())["hidden_size"] == 32


def test_mismatched_config_is_refused_before_launch(ref):
    tmp, _ = ref
    cfg = write_config(
        tmp,
        "wide",
        hidden_size=64,
        make_vocab_size_divisible_by=1024,
        load=str(tmp / "ref" / "ckpt"),
        **BASE,
    )
    start = time.monotonic()
    r = run_train(cfg)
    assert r.returncode == 2 and time.monotonic() - start < 60
    assert "hidden_size 32 (checkpoint) vs 64 (config)" in r.stderr
    assert "padded vocab 512 (checkpoint) vs 1024 (config)" in r.stderr
    assert "Traceback" not in r.stderr and "launching" not in r.stderr + r.stdout


def corrupt_pickle(path) -> None:
    """Garble the start of a torch file's pickle, leaving its size and zip directory intact."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(b"\xff" * 8)  # no pickle opcode


def test_broken_checkpoints_fall_back_and_resume_exactly(ref):
    tmp, _ = ref
    ckpt = tmp / "fallback" / "ckpt"
    shutil.copytree(tmp / "ref" / "ckpt", ckpt)
    # The newest looks complete but fails to unpickle; the next is truncated.
    shutil.copytree(ckpt / "global_step6", ckpt / "global_step9")
    corrupt_pickle(ckpt / "global_step9" / "state" / "client_state.pt")
    (ckpt / "latest").write_text("global_step9")
    shard = ckpt / "global_step6" / "state" / "client_state.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = run_here("train.py", write_config(tmp, "fallback", **BASE))
    out = r.stdout + r.stderr
    # The manifest's checksum catches it before anything is unpickled.
    bad = ckpt / "global_step9" / "state" / "client_state.pt"
    assert f"skipping checkpoint global_step9: {bad} is corrupt" in out, out[-3000:]
    assert f"skipping checkpoint global_step6: {shard} is " in out and "truncated" in out
    resumed_line = next(ln for ln in out.splitlines() if "resumed from" in ln)
    assert f"{ckpt / 'global_step3'}/" in resumed_line and resumed_line.endswith("iteration 3")
    ref_logs, logs = tmp / "ref" / "logs", tmp / "fallback" / "logs"
    resumed = losses(logs)
    assert sorted(resumed) == [4, 5, 6]
    assert all(same(resumed[s], losses(ref_logs)[s]) for s in resumed)
    # The validation stream went on from where it was at step 3.
    assert same(losses(logs, "valid")[6], losses(ref_logs, "valid")[6])
    assert (ckpt / "latest").read_text() == "global_step6"  # saved again, complete this time


def test_kill_during_save_leaves_latest_loadable_and_resume_is_exact(ref):
    tmp, _ = ref
    cfg = write_config(tmp, "crash", **BASE)
    # Rank 1 dies once its shards of step 6 are written, before anything is renamed.
    start = time.monotonic()
    r = run_train(cfg, NEOX_SAVE_KILL_AT="shards@1:6")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and time.monotonic() - start < 300
    summary = [ln for ln in out.splitlines() if "rank 1 on" in ln]
    assert summary and "killed by SIGKILL" in summary[0], out[-2000:]
    ckpt = tmp / "crash" / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step3"
    assert (ckpt / "global_step6.partial").is_dir() and not (ckpt / "global_step6").exists()

    r = run_here("train.py", cfg)
    assert "(checkpoint global_step3)" in r.stdout
    recs = records(tmp / "crash" / "logs")
    steps = [x["step"] for x in recs if x["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 4-6 of the crashed attempt were dropped
    ref_recs = {(x["split"], x["step"]): x for x in records(tmp / "ref" / "logs")}
    for x in recs:
        if x["split"] in ("train", "valid"):
            want = ref_recs[x["split"], x["step"]]
            for key in ("loss", "lr", "grad_norm", "consumed_tokens"):
                if key in want:
                    assert same(x[key], want[key]), (x["split"], x["step"], key)
    assert (ckpt / "latest").read_text() == "global_step6"
    assert not (ckpt / "global_step6.partial").exists()


def test_kill_after_rename_keeps_latest_on_a_complete_checkpoint(runs):
    """One rank, started from here (deepy.py's report of a killed rank: the test above)."""
    tmp = runs
    cfg = write_config(tmp, "renamed", num_gpus=1, **BASE)
    r = run_here("train.py", cfg, check=False, NEOX_SAVE_KILL_AT="renamed@0:6")
    out = r.stdout + r.stderr
    assert r.returncode == -9 and "saved checkpoint" in out, out[-3000:]
    ckpt = tmp / "renamed" / "ckpt"
    assert (ckpt / "global_step6").is_dir()  # renamed, then killed before `latest` moved
    assert (ckpt / "latest").read_text() == "global_step3"
    dry = subprocess.run(
        [sys.executable, "deepy.py", "train.py", str(cfg), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert dry.returncode == 0 and "(checkpoint global_step3)" in dry.stdout


def test_finetune_loads_weights_only_and_restarts_at_zero(ref):
    tmp, _ = ref
    cfg = write_config(
        tmp,
        "tune",
        finetune=True,
        load=str(tmp / "ref" / "ckpt"),
        train_iters=3,
        checkpoint_factor=None,
        eval_interval=100,
        do_test=False,
        **BASE,
    )
    r = run_here("train.py", cfg)
    assert "finetuning from" in r.stdout
    # Weights only: the log says so, never that the run "resumed".
    assert "to finetune from iteration 0" in r.stdout + r.stderr
    assert "resumed from" not in r.stdout + r.stderr
    tune = {x["step"]: x for x in records(tmp / "tune" / "logs") if x["split"] == "train"}
    first = {x["step"]: x for x in records(tmp / "ref" / "logs") if x["split"] == "train"}[1]
    assert sorted(tune) == [1, 2, 3] and tune[1]["consumed_samples"] == GLOBAL_BATCH
    # Trained weights: the first loss is below a fresh model's; a fresh schedule's first lr.
    assert tune[1]["loss"] < first["loss"] - 0.01
    assert tune[1]["lr"] == first["lr"]
    assert (tmp / "tune" / "ckpt" / "latest").read_text() == "global_step3"


def test_nonfinite_steps_are_skipped_then_the_run_stops_unsaved(runs):
    tmp = runs
    cfg = write_config(
        tmp,
        "nan",
        optimizer={"type": "Adam", "params": {"lr": 1.0e30}},
        max_nonfinite_steps=2,
        **BASE,
    )
    r = run_here("train.py", cfg, check=False)
    assert r.returncode != 0
    assert "2 steps in a row with a non-finite loss or gradient (iterations" in r.stderr
    assert "Traceback" not in r.stderr
    recs = [x for x in records(tmp / "nan" / "logs") if x["split"] == "train"]
    assert recs[-1]["nonfinite_steps"] == 1 and recs[-1]["skipped_steps"] == 1
    assert not (tmp / "nan" / "ckpt" / "latest").exists()


def test_stop_signals_ask_once_then_abort():
    """deepy.py's handler (neox/launcher/signals.py), called as the signal would call it: the
    first SIGTERM or SIGINT forwards the stop once, a second of either kind aborts; a clean
    stop exits 0 after SIGTERM, 130 after Ctrl-C. Each signal's way through deepy.py: SIGINT
    and a rank's SIGTERM below, a second SIGTERM in the test after them."""
    from functools import partial

    from neox.launcher.signals import AbortLaunch, StopRequest

    for first, code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
        for second in (signal.SIGTERM, signal.SIGINT):
            forwarded = []
            stop = StopRequest(partial(forwarded.append, True))
            stop._handle(first, None)
            assert forwarded == [True] and stop.signum == first and stop.exit_code == code
            with pytest.raises(AbortLaunch, match=f"second stop signal \\({second.name}\\)"):
                stop._handle(second, None)
            assert forwarded == [True]  # the second is not forwarded: the ranks are killed


@pytest.mark.parametrize(
    "target,sig,code",
    [
        # deepy.py's SIGTERM takes the same path (StopRequest, above), its clean stop through
        # deepy.py in tests/faults/test_checkpoint_faults.py (a stop during non-finite steps).
        ("deepy", signal.SIGINT, 130),
        ("rank1", signal.SIGTERM, 0),  # as a cluster scheduler sends it
    ],
)
def test_stop_signal_saves_once_and_leaves_no_process(runs, target, sig, code):
    from tests.training.lifecycle_helpers import BackgroundRun

    tmp = runs
    name = f"{target}-{sig.name}"
    cfg = write_config(
        tmp, name, train_iters=1000, checkpoint_factor=None, eval_interval=1000, **BASE
    )
    run = BackgroundRun(cfg, tmp / f"{name}.out")
    try:
        run.wait_for("iter 2/1000")
        pid = run.proc.pid if target == "deepy" else run.rank_pid(1)
        os.kill(pid, sig)
        assert run.wait() == code, run.text()[-3000:]
        assert run.pids() == []
    finally:
        run.kill_all()
    out = run.text()
    stopped = [
        int(ln.rsplit(" ", 1)[1])
        for ln in out.splitlines()
        if "stopped by" in ln and "at iteration" in ln
    ]
    assert stopped, out[-2000:]
    tag = f"global_step{stopped[0]}"
    ckpt = tmp / name / "ckpt"
    assert (ckpt / "latest").read_text() == tag
    assert [p.name for p in ckpt.glob("global_step*")] == [tag]
    if target == "deepy":
        assert f"deepy: stopped by {sig.name}; checkpoint saved in {ckpt / tag}" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    # Output to a file: plain log lines, no progress bar (tests/training/test_progress.py has it).
    assert "neox.training.progress: iter 2/1000 | samples" in out
    assert "step/s" not in out and "%|" not in out and "\r" not in out


# SIGTERM twice: SIGINT's way through deepy.py is the test above; either second signal aborts
# (test_stop_signals_ask_once_then_abort).
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_second_signal_stops_at_once_and_claims_no_checkpoint(runs, sig):
    """Two stop signals (a double Ctrl-C): the ranks are killed unsaved; deepy.py says so, names
    the checkpoint saved before (where the run resumes) and exits 137, not a clean stop's 0/130."""
    from neox.launcher.run import KILLED_EXIT
    from tests.training.lifecycle_helpers import BackgroundRun

    tmp = runs
    name = f"twice-{sig.name}"
    cfg = write_config(
        tmp,
        name,
        train_iters=1000,
        checkpoint_factor=None,
        extra_save_iters=[2],
        eval_interval=1000,
        **BASE,
    )
    run = BackgroundRun(cfg, tmp / f"{name}.out")
    try:
        run.wait_for("iter 3/1000")  # step 2 is saved
        os.kill(run.proc.pid, sig)
        # The second only once deepy.py has taken the first (two pending signals of one kind
        # are delivered as one; on a loaded machine a fixed pause may not be enough), and
        # before the ranks could save: the output is polled every 5 ms.
        deadline = time.monotonic() + 30
        while "received: every rank finishes its step" not in run.text():
            assert time.monotonic() < deadline, run.text()[-3000:]
            time.sleep(0.005)
        os.kill(run.proc.pid, sig)
        assert run.wait(timeout=30) == KILLED_EXIT == 137, run.text()[-3000:]
        assert wait_until_none(run.pids) == []
    finally:
        run.kill_all()
    out = run.text()
    assert "second stop signal" in out
    assert "checkpoint saved in" not in out, out[-3000:]
    ckpt = tmp / name / "ckpt"
    last = ckpt / (ckpt / "latest").read_text()
    assert last.name == "global_step2"  # killed within 50 ms: the stop saved nothing
    assert (
        f"deepy: stopped by {sig.name}; the ranks were killed before saving (exit status 137); "
        f"the run can resume from the last checkpoint, {last}"
    ) in out, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out


def shm_buffers(out: str) -> list[Path]:
    """DeepSpeed's /dev/shm buffers of the rendezvous port named in deepy.py's launch line."""
    ports = {
        ln.split("(master port ")[1].split(")")[0]
        for ln in out.splitlines()
        if "(master port " in ln
    }
    [port] = ports
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_kill_9_of_deepy_saves_the_last_step_and_leaves_no_process(runs):
    from tests.training.lifecycle_helpers import BackgroundRun

    tmp = runs
    long_run = dict(checkpoint_factor=None, eval_interval=1000, do_test=False, **BASE)
    cfg = write_config(tmp, "orphan", train_iters=1000, **long_run)
    run = BackgroundRun(cfg, tmp / "orphan.out")
    try:
        run.wait_for("iter 2/1000")
        assert shm_buffers(run.text()) == []  # DeepSpeed's shared-memory op is never built
        # The agent, deepy.py's child, sees it gone (PR_SET_PDEATHSIG, and its control channel
        # closing) and sends SIGTERM to the ranks: they finish the step, save and exit.
        gone = run.kill_9_deepy()
        print(f"every process gone {gone:.1f} s after kill -9 of deepy.py")
    finally:
        run.kill_all()
    out = run.text()
    assert "neox agent: deepy.py is gone" in out and "SIGTERM to 2 rank(s)" in out, out[-3000:]
    assert "Traceback" not in out
    assert shm_buffers(out) == []
    [last] = [ln for ln in out.splitlines() if "stopped by SIGTERM at iteration" in ln]
    step = int(last.rsplit(" ", 1)[1])
    ckpt = tmp / "orphan" / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{step}"
    # It resumes from there (its ranks started from here: deepy.py's part is tested above).
    r = run_here("train.py", write_config(tmp, "orphan", train_iters=step + 1, **long_run))
    resumed = next(ln for ln in (r.stdout + r.stderr).splitlines() if "resumed from" in ln)
    assert resumed.endswith(f"iteration {step}")
    assert sorted(losses(tmp / "orphan" / "logs")) == list(range(1, step + 2))


def test_stop_signal_while_the_ranks_start_still_reaches_them(runs):
    from tests.training.lifecycle_helpers import BackgroundRun

    tmp = runs
    long_run = dict(checkpoint_factor=None, eval_interval=1000, do_test=False, **BASE)
    run = BackgroundRun(write_config(tmp, "early", train_iters=1000, **long_run), tmp / "early.out")
    try:
        run.wait_for("launching 2 rank(s)")  # the ranks do not exist yet
        os.kill(run.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        code = run.wait()
        assert time.monotonic() - start < 60  # not the whole run
        assert run.pids() == []
    finally:
        run.kill_all()
    out = run.text()
    # A rank signalled before it could save dies of it; one that could saves (at step 1).
    assert "deepy: stopped by SIGTERM" in out, out[-3000:]
    assert "iter 3/1000" not in out
    print(f"exit {code}:", [ln for ln in out.splitlines() if ln.startswith("deepy: stopped")])

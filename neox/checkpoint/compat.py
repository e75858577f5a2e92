"""Before launch: the checkpoint to resume is found, and its saved config must describe the same
model as the run's, or deepy.py stops with every differing field (no torch, no ranks started)."""

import hashlib
import signal
from pathlib import Path
from typing import Optional

from neox.checkpoint.ds_files import has_model_states
from neox.checkpoint.find import (
    WEIGHTS_ONLY,
    Resume,
    find_checkpoint,
    has_plain_state,
    read_latest,
    step_of,
    tag_for,
)
from neox.checkpoint.manifest import read_manifest
from neox.config import ConfigError, Derived, NeoXConfig
from neox.config.data import TokenizerConfig
from neox.config.transport import read_saved_config

# Model fields that change parameter shapes or what the weights mean.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "mlp_multiple_of",
    "expansion_factor",
    "norm",
    "use_bias_in_norms",
    "use_qk_layernorm",
    "pos_emb",
    "rotary_pct",
    "no_weight_tying",
    "gpt_j_residual",
    "gpt_j_tied",
    "activation",
    "use_bias_in_attn_linear",
    "use_bias_in_mlp",
)


def architecture_differences(
    saved: NeoXConfig,
    cfg: NeoXConfig,
    saved_vocab: Optional[int],
    vocab: Optional[int],
    any_layout: bool = False,
) -> list[str]:
    """`field checkpoint-value (checkpoint) vs config-value (config)` for each difference;
    `any_layout`: the checkpoint carries its state by plain name, so TP/PP may differ."""
    diffs = [
        f"{name} {getattr(saved.model, name)} (checkpoint) vs {getattr(cfg.model, name)} (config)"
        for name in ARCHITECTURE_FIELDS
        if getattr(saved.model, name) != getattr(cfg.model, name)
    ]
    if saved.model.pos_emb == cfg.model.pos_emb == "learned":
        a, b = saved.model.max_position_embeddings, cfg.model.max_position_embeddings
        if a != b:
            diffs.append(f"max_position_embeddings {a} (checkpoint) vs {b} (config)")
    if saved_vocab is not None and vocab is not None and saved_vocab != vocab:
        diffs.append(f"padded vocab {saved_vocab} (checkpoint) vs {vocab} (config)")
    if not cfg.training.finetune and not any_layout:
        for name, key in (
            ("model_parallel_size", "model_parallel_size"),
            ("pipe_parallel_size", "pp"),
        ):
            a, b = getattr(saved.parallel, key), getattr(cfg.parallel, key)
            if a != b:
                diffs.append(f"{name} {a} (checkpoint) vs {b} (config)")
    if not cfg.training.finetune:
        # A finetune may change the rotary base on purpose (longer context); a resume may not.
        a, b = saved.model.rotary_emb_base, cfg.model.rotary_emb_base
        if saved.model.pos_emb == "rotary" and a != b:
            diffs.append(f"rotary_emb_base {a} (checkpoint) vs {b} (config)")
    return diffs


def read_checkpoint_config_file(path: Path) -> NeoXConfig:
    """The config.yml a checkpoint holds; ConfigError (never a traceback) when it is damaged."""
    try:
        return read_saved_config(path)
    except ConfigError:
        raise
    except Exception as e:  # YAML, decoding and schema errors of a damaged file
        raise ConfigError(
            f"{path} is not a readable neox config ({type(e).__name__}: {str(e)[:200]}); the "
            "checkpoint is damaged: restore the file, or pass another checkpoint"
        ) from None


# The keys each tokenizer_type reads (CharLevelTokenizer ignores a vocab_file left in a config;
# TiktokenTokenizer's vocab_file is an encoding name, compared as such).
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HFGPT2Tokenizer": ("vocab_file", "merge_file"),
    "HFTokenizer": ("vocab_file",),
    "SPMTokenizer": ("vocab_file",),
    "TiktokenTokenizer": ("vocab_file",),
    "CharLevelTokenizer": (),
}


def _fingerprint(path: Optional[Path]) -> Optional[str]:
    if path is None or not path.is_file():
        return None
    data = path.read_bytes()
    return f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}"


def tokenizer_differences(saved: NeoXConfig, step_dir: Path, cfg: NeoXConfig) -> list[str]:
    """How cfg's tokenizer differs from the one the checkpoint in step_dir was trained with.

    The checkpoint's files are the copies neox saves in step_dir/tokenizer/ (else the paths its
    config.yml names); files are compared by content, so a moved copy is the same tokenizer.
    A file missing on either side is compared by name only (preflight reports missing ones).
    """
    a, b = saved.tokenizer, cfg.tokenizer
    if a.tokenizer_type != b.tokenizer_type:
        return [f"tokenizer_type {a.tokenizer_type} (checkpoint) vs {b.tokenizer_type} (config)"]
    diffs = []
    for key in TOKENIZER_FILES[a.tokenizer_type]:
        theirs, mine = getattr(a, key), getattr(b, key)
        if theirs is None or mine is None:
            if theirs != mine:
                diffs.append(f"{key} {theirs} (checkpoint) vs {mine} (config)")
            continue
        copy = step_dir / "tokenizer" / Path(theirs).name
        their_print = _fingerprint(copy if copy.is_file() else Path(theirs))
        my_print = _fingerprint(Path(mine))
        if their_print is None or my_print is None:
            if Path(theirs).name != Path(mine).name:
                diffs.append(f"{key} {theirs} (checkpoint) vs {mine} (config)")
        elif their_print != my_print:
            diffs.append(f"{key} {theirs} ({their_print}, checkpoint) vs {mine} ({my_print})")
    return diffs


def tokenizer_mismatch(saved: NeoXConfig, step_dir: Path, cfg: NeoXConfig) -> Optional[str]:
    """The refusal when cfg's tokenizer is not the checkpoint's (token ids would mean other
    text: training goes on from garbage, generation and perplexity are wrong), else None."""
    if cfg.checkpoint.allow_tokenizer_mismatch:
        return None
    diffs = tokenizer_differences(saved, step_dir, cfg)
    if not diffs:
        return None
    copies = step_dir / "tokenizer"
    where = f"the copies in {copies}" if copies.is_dir() else f"those in {step_dir}/config.yml"
    return (
        f"the checkpoint {step_dir} was trained with another tokenizer than this config's:"
        + "".join(f"\n  {d}" for d in diffs)
        + f"\nuse the checkpoint's tokenizer ({where}), or set allow_tokenizer_mismatch: true "
        "if the token ids mean the same text"
    )


def saved_padded_vocab(resume: Resume) -> Optional[int]:
    manifest, _ = read_manifest(resume.path)  # find_checkpoint skipped an unreadable one
    vocab = (manifest or {}).get("padded_vocab_size")
    return vocab if isinstance(vocab, int) else None


def saved_iteration(resume: Resume) -> Optional[int]:
    """The iteration the checkpoint holds: its manifest's (what a resume starts from), else the
    step in its name."""
    manifest, _ = read_manifest(resume.path)
    n = (manifest or {}).get("iteration")
    return n if isinstance(n, int) else step_of(resume.tag)


def checkpoint_dir(load: str, iteration: Optional[int] = None) -> Optional[Path]:
    """The global_stepN directory generate.py and eval.py read from `load` (a save directory or
    one global_stepN in it), or None when there is none to read."""
    root = Path(load)
    if has_plain_state(root) or has_model_states(root):
        return root
    if iteration is not None:
        tag_dir = root / tag_for(iteration)
        return tag_dir if tag_dir.is_dir() else None
    return find_checkpoint(load).path


def checkpoint_tokenizer(cfg: NeoXConfig) -> Optional[TokenizerConfig]:
    """The tokenizer keys the checkpoint cfg reads was trained with, its files pointed at the
    copies saved in the checkpoint; None without a checkpoint or its config.yml."""
    step_dir = checkpoint_dir(cfg.checkpoint.load, cfg.training.iteration)
    if step_dir is None or not (step_dir / "config.yml").is_file():
        return None
    saved = read_checkpoint_config_file(step_dir / "config.yml").tokenizer
    copies = {}
    for key in TOKENIZER_FILES[saved.tokenizer_type]:
        name = getattr(saved, key)
        if name and (copy := step_dir / "tokenizer" / Path(name).name).is_file():
            copies[key] = str(copy)
    return saved.model_copy(update=copies)


def checkpoint_tokenizer_problem(cfg: NeoXConfig) -> Optional[str]:
    """generate.py, eval.py: the refusal when cfg's tokenizer is not its checkpoint's."""
    if cfg.checkpoint.load is None:
        return None
    step_dir = checkpoint_dir(cfg.checkpoint.load, cfg.training.iteration)
    if step_dir is None or not (step_dir / "config.yml").is_file():
        return None
    return tokenizer_mismatch(read_checkpoint_config_file(step_dir / "config.yml"), step_dir, cfg)


def finetune_restart(saved: NeoXConfig, cfg: NeoXConfig, step: Optional[int]) -> Optional[str]:
    """The converse of resuming weights only: a finetune run relaunched as it was (save = load,
    finetune: true) would load its own checkpoint as new weights and start over at iteration 0,
    repeating its schedule and overwriting its checkpoints."""
    c = cfg.checkpoint
    if not (cfg.training.finetune and saved.training.finetune and step and c.save):
        return None
    if Path(c.save).resolve() != Path(c.load).resolve():
        return None
    return (
        f"this finetune run's own step {step} (saved with finetune: true into save = load = "
        f"{c.load}); finetune: true would start it over at iteration 0 on those weights. To "
        "resume it, set finetune: false (it then resumes the optimizer and the iteration); to "
        "finetune again, point `load` at the checkpoint to start from and `save` elsewhere"
    )


def lora_differences(saved: NeoXConfig, cfg: NeoXConfig) -> list[str]:
    """A LoRA run resumes only an adapter of its own shape, and a full run no adapter."""
    a, b = saved.lora, cfg.lora
    if bool(a.lora_rank) != bool(b.lora_rank):
        what = "a LoRA adapter" if a.lora_rank else "a full model"
        fix = (
            "set its lora_* keys and lora_base to resume it"
            if a.lora_rank
            else "to train an adapter on it, set lora_base to it and point load/save at a new "
            "directory"
        )
        return [f"the checkpoint holds {what}: {fix}"]
    keys = ("lora_rank", "lora_alpha", "lora_target_modules")
    return [
        f"{k} {getattr(a, k)} (checkpoint) vs {getattr(b, k)} (config)"
        for k in keys
        if a.lora_rank and getattr(a, k) != getattr(b, k)
    ]


def check_resume(cfg: NeoXConfig, derived: Derived) -> str:
    """One line on what the run resumes from; ConfigError when it cannot resume from it."""
    c = cfg.checkpoint
    if c.load is None:
        return "no `load` directory: training starts from scratch"
    resume = find_checkpoint(c.load, c.allow_unverified_checkpoint)
    skipped = "".join(f"\nwarning: {line}" for line in resume.report())
    if resume.tag is None:
        if resume.skipped:
            raise ConfigError(
                f"no checkpoint in load={c.load} can be loaded:{skipped}\n"
                "point `load` at another directory, or remove the broken ones to start over"
            )
        return f"load={c.load} holds no checkpoint yet: training starts from scratch"
    step = saved_iteration(resume)
    if (resume.path / WEIGHTS_ONLY).is_file() and not cfg.training.finetune:
        raise ConfigError(
            f"checkpoint {resume.path} holds weights only (written by a conversion tool, no "
            "optimizer state or iteration to resume); set `finetune: true` to start a run from "
            "these weights"
        )
    if step is not None and not cfg.training.finetune and step > cfg.training.train_iters:
        raise ConfigError(
            f"train_iters={cfg.training.train_iters} is below the step of the checkpoint it "
            f"resumes, {step} ({resume.path}): nothing would be trained and step {step} saved "
            f"again; set train_iters above {step} to train on, or point `load` elsewhere"
        )
    saved_config = resume.path / "config.yml"
    if saved_config.is_file():
        saved = read_checkpoint_config_file(saved_config)
        if problem := tokenizer_mismatch(saved, resume.path, cfg):
            raise ConfigError(problem)
        if problem := finetune_restart(saved, cfg, step):
            raise ConfigError(f"checkpoint {resume.path}: {problem}")
        diffs = architecture_differences(
            saved,
            cfg,
            saved_padded_vocab(resume),
            derived.padded_vocab_size,
            any_layout=has_plain_state(resume.path),
        )
        if not cfg.training.finetune:
            diffs += lora_differences(saved, cfg)
        if diffs:
            listed = "".join(f"\n  {d}" for d in diffs)
            raise ConfigError(
                f"checkpoint {resume.path} was saved by a different model than this config "
                f"describes:{listed}\nto resume it, use the checkpoint's values (its config is "
                f"{saved_config}); to train this model instead, point `save` and `load` at a "
                "new directory. finetune: true reloads weights only, so the model must match too"
                "; a different model_parallel_size or pipe_parallel_size needs the checkpoint "
                "reshaped first"
            )
    what = "finetuning from" if cfg.training.finetune else "resuming from"
    return f"{what} {c.load} (checkpoint {resume.tag}){skipped}"


def latest_state(save: Optional[str]) -> Optional[tuple[str, int, int]]:
    """(tag, inode, mtime) of `latest` in `save`, or None: each save replaces the file by
    rename, so a save that completed changes it, even one that saves the same step again."""
    tag = None if save is None else read_latest(Path(save))
    if tag is None:
        return None
    try:
        st = (Path(save) / "latest").stat()
    except OSError:
        return None
    return tag, st.st_ino, st.st_mtime_ns


def describe_stop(cfg: NeoXConfig, result, latest_at_stop: Optional[tuple] = None) -> str:
    """The line deepy.py prints after a stop signal (`result` is launch()'s LaunchResult):
    where the run can resume from. A checkpoint is claimed only after a clean stop, and only
    if a save completed after the signal: `latest` differs from `latest_at_stop` (its
    latest_state when the signal came)."""
    name = signal.Signals(result.signal).name
    save = None if cfg.checkpoint.save is None else Path(cfg.checkpoint.save)
    if result.killed:
        # The stop saved nothing: `latest` names the last checkpoint saved before it.
        tag = None if save is None else read_latest(save)
        if save is None:
            where = "no `save` directory is configured"
        elif tag is None:
            where = f"no checkpoint in {save} to resume from"
        else:
            where = f"the run can resume from the last checkpoint, {save / tag}"
        return (
            f"stopped by {name}; the ranks were killed before saving (exit status "
            f"{result.code}); {where}"
        )
    if result.code not in (0, 130):
        return f"stopped by {name}; the ranks did not exit cleanly (exit status {result.code})"
    if save is None:
        return f"stopped by {name}; nothing saved (no `save` directory is configured)"
    now = latest_state(str(save))
    if now is not None and now != latest_at_stop:
        return f"stopped by {name}; checkpoint saved in {save / now[0]}"
    where = (
        f"no checkpoint in {save} to resume from"
        if now is None
        else f"the run can resume from the last checkpoint, {save / now[0]}, saved before it"
    )
    return (
        f"stopped by {name}; no checkpoint was saved at this stop (the ranks' output above "
        f"says why); {where}"
    )

"""Before launch: the checkpoint to resume is found, and its saved config must describe the same
model as the run's, or deepy.py stops with every differing field (no torch, no ranks started)."""

import signal
from pathlib import Path
from typing import Optional

from neox.checkpoint.find import Resume, find_checkpoint, read_latest
from neox.checkpoint.manifest import read_manifest
from neox.config import ConfigError, Derived, NeoXConfig
from neox.config.transport import read_saved_config

# Model fields that change parameter shapes or what the weights mean.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
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
    saved: NeoXConfig, cfg: NeoXConfig, saved_vocab: Optional[int], vocab: Optional[int]
) -> list[str]:
    """`field checkpoint-value (checkpoint) vs config-value (config)` for each difference."""
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
    if not cfg.training.finetune:
        for name, key in (
            ("model_parallel_size", "model_parallel_size"),
            ("pipe_parallel_size", "pp"),
        ):
            a, b = getattr(saved.parallel, key), getattr(cfg.parallel, key)
            if a != b:
                diffs.append(f"{name} {a} (checkpoint) vs {b} (config)")
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


def saved_padded_vocab(resume: Resume) -> Optional[int]:
    manifest, _ = read_manifest(resume.path)  # find_checkpoint skipped an unreadable one
    vocab = (manifest or {}).get("padded_vocab_size")
    return vocab if isinstance(vocab, int) else None


def check_resume(cfg: NeoXConfig, derived: Derived) -> str:
    """One line on what the run resumes from; ConfigError when it cannot resume from it."""
    c = cfg.checkpoint
    if c.load is None:
        return "no `load` directory: training starts from scratch"
    resume = find_checkpoint(c.load)
    skipped = "".join(f"\nwarning: {line}" for line in resume.report())
    if resume.tag is None:
        if resume.skipped:
            raise ConfigError(
                f"no checkpoint in load={c.load} can be loaded:{skipped}\n"
                "point `load` at another directory, or remove the broken ones to start over"
            )
        return f"load={c.load} holds no checkpoint yet: training starts from scratch"
    saved_config = resume.path / "config.yml"
    if saved_config.is_file():
        saved = read_checkpoint_config_file(saved_config)
        diffs = architecture_differences(
            saved, cfg, saved_padded_vocab(resume), derived.padded_vocab_size
        )
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


def describe_stop(cfg: NeoXConfig, result) -> str:
    """The line deepy.py prints after a stop signal: where the run can resume from."""
    name = signal.Signals(result.signal).name
    if result.code not in (0, 130):
        return f"stopped by {name}; the ranks did not exit cleanly (exit status {result.code})"
    if cfg.checkpoint.save is None:
        return f"stopped by {name}; nothing saved (no `save` directory is configured)"
    tag = read_latest(Path(cfg.checkpoint.save))
    return f"stopped by {name}; checkpoint saved in {Path(cfg.checkpoint.save) / str(tag)}"

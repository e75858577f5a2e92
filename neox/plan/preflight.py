"""Checks against the filesystem before launch: data, vocab files, the checkpoint to resume."""

import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Optional

from neox.checkpoint.ds_files import has_model_states
from neox.checkpoint.find import has_plain_state
from neox.config.errors import ConfigError
from neox.config.loader import LoadedConfig

log = logging.getLogger(__name__)


def data_prefixes(cfg) -> list[tuple[str, str]]:
    """(config key, dataset prefix) for every dataset the config names."""
    d = cfg.data
    out = [("data_path", d.data_path)] if d.data_path else []
    out += [("label_data_paths", p) for p in d.label_data_paths or []]
    for split in ("train", "valid", "test"):
        out += [(f"{split}_data_paths", p) for p in getattr(d, f"{split}_data_paths") or []]
        out += [
            (f"{split}_label_data_paths", p) for p in getattr(d, f"{split}_label_data_paths") or []
        ]
    # Preference training's pairs, their labels and KTO's rewards (neox/data/pairs.py).
    pref = cfg.preference
    for key in type(pref).model_fields:
        if key.endswith("_data_paths"):
            out += [(key, p) for p in getattr(pref, key) or []]
    return out


def label_pairs(cfg) -> list[tuple[str, str, str, str]]:
    """(text key, text prefix, label key, label prefix) for every label dataset named."""
    d = cfg.data
    out = []
    if d.data_path and d.label_data_paths:
        out.append(("data_path", d.data_path, "label_data_paths", d.label_data_paths[0]))
    for split in ("train", "valid", "test"):
        texts = getattr(d, f"{split}_data_paths") or []
        labels = getattr(d, f"{split}_label_data_paths") or []
        key, label_key = f"{split}_data_paths", f"{split}_label_data_paths"
        out += [(key, t, label_key, lab) for t, lab in zip(texts, labels)]
    return out


def label_problems(loaded: LoadedConfig) -> list[str]:
    """Each label dataset holds one label per token of its text dataset, document by document,
    in a dtype that can hold -100 (reads the .idx files only)."""
    from neox.data.indexed import IndexedDataset, IndexedDatasetError, check_label_dataset

    problems = []
    for key, text, label_key, label in label_pairs(loaded.config):
        try:
            text_ds, label_ds = IndexedDataset(text), IndexedDataset(label)
        except (IndexedDatasetError, OSError):
            continue  # check_data names the file
        try:
            check_label_dataset(text_ds, label_ds)
            if label_ds.dtype.kind == "u":
                raise ValueError(
                    f"label dataset {label}.bin holds unsigned {label_ds.dtype} values, which "
                    "cannot be -100, so nothing in it is masked; write it with "
                    "tools/preprocess_data_with_chat_template.py (int32 labels)"
                )
        except ValueError as e:
            where = f"{loaded.source_of(label_key)}: {label_key} (of {key}={text!r})"
            problems.append(f"{where}: {e}")
        finally:
            text_ds.close()
            label_ds.close()
    return problems


CHAT_TOOL = "tools/preprocess_data_with_chat_template.py"


def writer_of(key: str, train_impl: str) -> str:
    """The tool that writes the dataset a data key names: preference data (DPO, KTO, RM) and
    label files come from conversations, plain text from tools/preprocess_data.py."""
    if key.startswith(("pos_", "neg_")):
        return f"{CHAT_TOOL} --jsonl-keys chosen rejected"
    if "reward" in key:
        return f"{CHAT_TOOL} --reward-key <its field>"
    if "label" in key or train_impl != "normal":
        return f"{CHAT_TOOL} (or _with_mask.py)"
    return "tools/preprocess_data.py"


def check_data(loaded: LoadedConfig) -> None:
    """Every dataset prefix has a readable .idx header and a .bin of the size it promises."""
    cfg = loaded.config
    prefixes = data_prefixes(cfg)
    train_impl = cfg.preference.train_impl
    if not prefixes:  # DPO, KTO and RM configs without their data are refused on load
        raise ConfigError(
            "no training data: set data_path (one .bin/.idx prefix, split by `split`) or "
            "train_data_paths; make one with tools/prepare_data.py and tools/preprocess_data.py"
        )
    missing = []
    for key, prefix in prefixes:
        absent = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if absent:
            tool = writer_of(key, train_impl)
            missing.append(
                f"{loaded.source_of(key)}: {key}={prefix!r}: {' and '.join(prefix + s for s in absent)} "
                f"not found; run {tool} (it writes <prefix>.bin/.idx) or fix the path"
            )
        elif (problem := dataset_problem(prefix)) is not None:
            missing.append(f"{loaded.source_of(key)}: {key}={prefix!r}: {problem}")
    missing += label_problems(loaded)
    if missing:
        raise ConfigError("\n".join(missing))


def dataset_problem(prefix: str) -> Optional[str]:
    """What is wrong with a .bin/.idx pair, from its header and file sizes only (no data read)."""
    from neox.data.indexed import IndexedDataset, IndexedDatasetError

    try:
        IndexedDataset(prefix).close()
    except (IndexedDatasetError, OSError) as e:
        return str(e)
    return None


def split_problems(loaded: LoadedConfig, needed: dict[str, str]) -> list[str]:
    """A `split` of data_path that gives no documents to a split the run reads (`needed`: split
    name -> why it is read), cut as the data loader cuts it; the dataset's own problems are
    check_data's."""
    from neox.config.data import split_ranges
    from neox.data.indexed import IndexedDataset, IndexedDatasetError

    d = loaded.config.data
    if not d.data_path or not needed:
        return []
    try:
        dataset = IndexedDataset(d.data_path)
    except (IndexedDatasetError, OSError):
        return []
    documents = len(dataset.sizes)
    dataset.close()
    fixes = {
        "train": "use more data",
        "valid": "set eval_iters: 0 or do_valid: false to evaluate nothing",
        "test": "set do_test: false (or eval_iters: 0)",
    }
    counts = [b - a for a, b in split_ranges(d.split, documents)]
    return [
        f"{loaded.source_of('split')}: split={d.split!r} gives the {name} split no documents "
        f"(train/valid/test get {'/'.join(map(str, counts))} of the {documents} in "
        f"data_path={d.data_path!r}), but {needed[name]}; raise the {name} part of split, or "
        f"{fixes[name]}"
        for name, docs in zip(("train", "valid", "test"), counts)
        if name in needed and docs == 0
    ]


def drawn_splits(samples: tuple[int, int, int]) -> dict[str, str]:
    """The splits a training run draws samples from, and how many."""
    names = ("train", "valid", "test")
    return {name: f"the run draws {n} {name} samples" for name, n in zip(names, samples) if n}


def check_script(script: str) -> None:
    """The per-rank entry script exists (DeepSpeed's runner would only fail on the ranks)."""
    if not Path(script).is_file():
        raise ConfigError(
            f"entry script {script!r} does not exist; use train.py (or another script of this "
            "checkout) and run deepy.py from the repository root"
        )


def check_tokenizer_files(loaded: LoadedConfig) -> None:
    """The vocab and merge files the tokenizer type needs exist."""
    t = loaded.config.tokenizer
    needs = {
        "GPT2BPETokenizer": ("vocab_file", "merge_file"),
        "HFTokenizer": ("vocab_file",),
        "HFGPT2Tokenizer": (),
        "SPMTokenizer": ("vocab_file",),
        "CharLevelTokenizer": (),
        "TiktokenTokenizer": (),
    }[t.tokenizer_type]
    problems = []
    for key in needs:
        value = getattr(t, key)
        if value is None:
            problems.append(f"tokenizer_type={t.tokenizer_type} needs {key}; set it in a config")
        elif not Path(value).is_file():
            problems.append(
                f"{loaded.source_of(key)}: {key}={value!r} does not exist; fix the path"
            )
    if problems:
        raise ConfigError("\n".join(problems))


# What each tokenizer_type reads, for the message when a file is of the wrong kind.
TOKENIZER_FILES = {
    "GPT2BPETokenizer": "vocab_file = GPT-2 vocab.json and merge_file = merges.txt",
    "HFTokenizer": "vocab_file = a Hugging Face tokenizers JSON (tokenizer.json)",
    "SPMTokenizer": "vocab_file = a SentencePiece .model file",
}


def tokenizer_vocab_size(loaded: LoadedConfig) -> Optional[int]:
    """The tokenizer's vocabulary size (loads the tokenizer files; no torch)."""
    t = loaded.config.tokenizer
    files = (t.vocab_file, t.merge_file)
    try:
        return _vocab_size(t.tokenizer_type, *files, *map(_file_stamp, files))
    except Exception as e:  # each tokenizer library raises its own types for a foreign file
        files = ", ".join(
            f"{k}={getattr(t, k)!r} ({loaded.source_of(k)})"
            for k in ("vocab_file", "merge_file")
            if getattr(t, k)
        )
        wants = TOKENIZER_FILES.get(t.tokenizer_type, "no files")
        raise ConfigError(
            f"tokenizer_type={t.tokenizer_type} cannot read {files or 'its files'}: "
            f"{type(e).__name__}: {str(e)[:200]}; {t.tokenizer_type} needs {wants}; fix "
            "tokenizer_type or the file"
        ) from None


@functools.lru_cache(maxsize=8)
def _vocab_size(kind: str, vocab_file, merge_file, *stamps) -> Optional[int]:
    """Built once per process for the same unchanged files (the stamps): a process that checks
    many configs (tools/gpt_neox_compat.py, tests) reads the 20B tokenizer once, not per file."""
    from neox.tokenizer import build_tokenizer

    return build_tokenizer(kind, vocab_file, merge_file).vocab_size


def _file_stamp(path: Optional[str]) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except (OSError, TypeError):  # no file (the build names it) or none configured
        return None
    return st.st_mtime_ns, st.st_size


def check_eval(loaded: LoadedConfig) -> None:
    """eval.py has a checkpoint to read, something to evaluate, and the files it names."""
    cfg = loaded.config
    e = cfg.eval
    problem = checkpoint_problem(cfg.checkpoint.load, cfg.training.iteration)
    problems = [problem] if problem else tokenizer_problems(cfg)
    if not e.has_work:
        problems.append(
            "eval.py has nothing to evaluate: set eval_input_file, eval_split, eval_lambada_file "
            "or eval_tasks"
        )
    if e.eval_stride and e.eval_stride > cfg.model.seq_length:
        problems.append(
            f"{loaded.source_of('eval_stride')}: eval_stride={e.eval_stride} exceeds "
            f"seq_length={cfg.model.seq_length}; use at most seq_length"
        )
    if e.eval_input_file:
        from neox.prep.readers import InputError, expand_inputs

        try:
            expand_inputs(e.eval_input_file)
        except InputError as err:
            problems.append(f"{loaded.source_of('eval_input_file')}: eval_input_file: {err}")
    if e.eval_lambada_file and not Path(e.eval_lambada_file).is_file():
        problems.append(
            f"{loaded.source_of('eval_lambada_file')}: eval_lambada_file="
            f"{e.eval_lambada_file!r} does not exist; fix the path"
        )
    include = e.eval_include_path
    if include and not Path(include).is_dir():
        problems.append(
            f"{loaded.source_of('eval_include_path')}: eval_include_path={include!r} is not a "
            "directory; fix the path"
        )
        include = None
    if e.eval_tasks:
        problems += unknown_lm_eval_tasks(e.eval_tasks, include)
    if e.eval_split:
        try:
            check_data(loaded)
        except ConfigError as err:
            problems.append(f"eval_split={e.eval_split!r} reads the config's data: {err}")
        else:
            why = f"eval_split={e.eval_split!r} evaluates it"
            problems += split_problems(loaded, {e.eval_split: why})
    if problems:
        raise ConfigError("\n".join(problems))


def unknown_lm_eval_tasks(tasks: list[str], include_path: Optional[str]) -> list[str]:
    """Problems with eval_tasks: lm-evaluation-harness missing, or names it does not know (its
    task index is torch-free, so this runs before launch)."""
    if importlib.util.find_spec("lm_eval") is None:
        return [f"eval_tasks={tasks} needs lm-evaluation-harness: pip install 'neox[eval]'"]
    manager = lm_eval_task_manager(tasks, include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if not unknown:
        return []
    return [
        f"eval_tasks: lm-evaluation-harness has no task {', '.join(map(repr, unknown))}; see "
        "`lm_eval ls tasks`, or put a task YAML in a directory named by eval_include_path"
    ]


def lm_eval_task_manager(tasks: list[str], include_path: Optional[str]) -> Any:
    """lm-evaluation-harness's TaskManager for `tasks`: of eval_include_path alone when every
    task is a plain task there, since indexing the harness's own ~15k task files takes 10 s or
    more in each process (deepy.py's check and every rank)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):  # a group may name the harness's tasks
            return local
    return TaskManager(include_path=include_path)


def has_checkpoint(directory: Optional[str]) -> bool:
    """A DeepSpeed checkpoint directory has a `latest` tag file."""
    return directory is not None and (Path(directory) / "latest").is_file()


def checkpoint_problem(load: Optional[str], iteration: Optional[int] = None) -> Optional[str]:
    """Why `load` (and `iteration`) name no checkpoint to read, or None (a quick look before
    launch; neox.checkpoint.consolidate reads and checks the files)."""
    fix = "set `load` to the `save` directory of a training run (or one global_stepN in it)"
    if load is None:
        return f"no trained weights: {fix}"
    root = Path(load)
    if has_plain_state(root) or has_model_states(root):
        return None  # one global_stepN directory itself
    if iteration is not None:
        if (root / f"global_step{iteration}").is_dir():
            return None
        have = sorted(p.name for p in root.glob("global_step*") if p.is_dir())
        return (
            f"load={load!r} has no checkpoint for iteration={iteration} (it has "
            f"{', '.join(have) or 'none'}); set `iteration` to one of them or remove it"
        )
    if not (root / "latest").is_file():
        return f"load={load!r} holds no checkpoint (no `latest` file); {fix}"
    return None


def tokenizer_problems(cfg) -> list[str]:
    """The config's tokenizer against the one the checkpoint to read was trained with."""
    from neox.checkpoint.compat import checkpoint_tokenizer_problem

    problem = checkpoint_tokenizer_problem(cfg)
    return [problem] if problem else []


TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file", "padded_vocab_size")


def adopt_checkpoint_tokenizer(loaded: LoadedConfig) -> Optional[str]:
    """generate.py, eval.py: with no tokenizer key in the configs, use the checkpoint's own
    tokenizer (its saved copy); returns the line saying so, or None."""
    from neox.checkpoint.compat import TOKENIZER_FILES, checkpoint_tokenizer

    cfg = loaded.config
    if cfg.checkpoint.load is None or any(loaded.source_of(k) != "default" for k in TOKENIZER_KEYS):
        return None
    tokenizer = checkpoint_tokenizer(cfg)
    if tokenizer is None:
        return None
    cfg.tokenizer = tokenizer
    read = TOKENIZER_FILES[tokenizer.tokenizer_type]
    files = ", ".join(getattr(tokenizer, k) for k in read if getattr(tokenizer, k))
    return (
        f"tokenizer: the checkpoint's own, {tokenizer.tokenizer_type}{' ' + files if files else ''}"
    )


def check_generation(loaded: LoadedConfig) -> None:
    """generate.py: the checkpoint to read exists, and so does the prompt file it needs."""
    cfg = loaded.config
    problem = checkpoint_problem(cfg.checkpoint.load, cfg.training.iteration)
    problems = [problem] if problem else tokenizer_problems(cfg)
    g, m = cfg.generation, cfg.model
    if not g.recompute and m.pos_emb == "alibi":
        problems.append(
            "generate.py's KV cache does not support pos_emb=alibi; set `recompute: true` (the "
            "whole sequence is recomputed each token)"
        )
    if g.text_gen_type == "input-file":
        if g.sample_input_file is None:
            problems.append("text_gen_type=input-file needs sample_input_file (the prompts)")
        elif not Path(g.sample_input_file).is_file():
            problems.append(
                f"{loaded.source_of('sample_input_file')}: sample_input_file="
                f"{g.sample_input_file!r} does not exist; fix the path"
            )
    if problems:
        raise ConfigError("\n".join(problems))


# Optional packages (pyproject extras) a config needs on the ranks: module -> extra.
EXTRAS = {"wandb": "wandb", "sentencepiece": "spm", "transformers": "export", "lm_eval": "eval"}


def missing_packages(cfg, script: str) -> list[tuple[str, str, object, str]]:
    """(module, key, value, what else to set) for each optional package a key needs on the
    ranks that this machine lacks."""
    t = cfg.tokenizer.tokenizer_type
    needs = []
    if cfg.logging.use_wandb and Path(script).name in NEEDS_DATA:
        needs.append(("wandb", "use_wandb", True, "set use_wandb: false"))
    if t == "SPMTokenizer":
        needs.append(("sentencepiece", "tokenizer_type", t, "use another tokenizer_type"))
    if t == "HFGPT2Tokenizer":
        needs.append(("transformers", "tokenizer_type", t, "use HFTokenizer with a JSON file"))
    return [need for need in needs if importlib.util.find_spec(need[0]) is None]


def optional_package_problems(loaded: LoadedConfig, script: str) -> list[str]:
    """Each optional package a key needs that this machine lacks (the ranks would fail on
    import), naming the key and the install or the setting that avoids it."""
    return [
        f"{loaded.source_of(key)}: {key}={value} needs the {module} package, not installed "
        f"here: pip install 'neox[{EXTRAS[module]}]' (or {fix})"
        for module, key, value, fix in missing_packages(loaded.config, script)
    ]


def precision_problem(loaded: LoadedConfig, precision: str, cpu_ranks: bool) -> Optional[str]:
    """Why the ranks cannot compute in `precision`, or None. DeepSpeed's CPU accelerator has
    fp16 only where oneDNN has it (AMX-FP16 CPUs): elsewhere every rank stops at engine build
    with "Type fp16 is not supported on your device". Imports torch only for fp16 on CPU."""
    if not cpu_ranks or precision != "fp16":
        return None
    import torch

    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # the op DeepSpeed asks is absent from this torch
        supported = False
    if supported:
        return None
    keys = ("fp16", "precision")
    where = next((w for k in keys if (w := loaded.source_of(k)) != "default"), "default")
    return (
        f"{where}: precision fp16 is not supported by DeepSpeed on this machine's CPU ranks; "
        "layer configs/cpu.yml last (fp32), or set fp16: {enabled: false} with "
        "bf16: {enabled: true}, or run on GPUs"
    )


def fp8_problem(loaded: LoadedConfig, cpu_ranks: bool) -> Optional[str]:
    """Why the ranks cannot train with fp8.enabled, or None: float8 matmuls need compute
    capability 8.9+ (neox/model/transforms/float8.py checks each rank's GPU again). Imports torch only
    when fp8 is on and the ranks use this machine's GPUs."""
    if not loaded.config.float8.fp8.enabled:
        return None
    where = loaded.source_of("fp8")
    fix = "set fp8: {enabled: false}, or run on H100/H200/L40S-class GPUs"
    if cpu_ranks:
        return f"{where}: fp8.enabled needs GPUs with float8 tensor cores; these ranks run on CPU; {fix}"
    import torch

    if not torch.cuda.is_available():
        return None  # launching for other machines' GPUs: each rank checks its own
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) >= (8, 9):
        return None
    return (
        f"{where}: fp8.enabled needs compute capability 8.9 or newer; this machine's "
        f"{torch.cuda.get_device_name(0)} is {major}.{minor}; {fix}"
    )


# Entry scripts that read training data.
NEEDS_DATA = {"train.py"}
# Entry scripts that read a trained checkpoint, with the check of what each one reads.
NEEDS_CHECKPOINT = {"generate.py": check_generation, "eval.py": check_eval}


def preflight(loaded: LoadedConfig, script: str) -> tuple[Optional[int], list[str]]:
    """Every check that needs files: (tokenizer vocabulary size or None, problems found).

    A missing entry script raises at once; the other problems are returned, since a dry run
    may plan for another machine where the files exist.
    """
    check_script(script)
    problems = optional_package_problems(loaded, script)
    vocab_size = None
    try:
        check_tokenizer_files(loaded)
        missing = missing_packages(loaded.config, script)
        if not any(key == "tokenizer_type" for _, key, _, _ in missing):
            vocab_size = tokenizer_vocab_size(loaded)
    except ConfigError as e:
        problems.append(str(e))
    name = Path(script).name
    if name in NEEDS_CHECKPOINT and loaded.config.preference.train_impl == "rm":
        problems.append(
            f"{loaded.source_of('train_impl')}: train_impl='rm' is a reward model: its output "
            f"layer is a scalar head, so {name} (which reads a language model's logits) cannot "
            "use it; point it at a language model's config and checkpoint"
        )
    checks = ([check_data, check_save_lock, check_lora_base] if name in NEEDS_DATA else []) + (
        [NEEDS_CHECKPOINT[name]] if name in NEEDS_CHECKPOINT else []
    )
    for check in checks:
        try:
            check(loaded)
        except ConfigError as e:
            problems.append(str(e))
    problems += output_dir_problems(loaded, OUTPUT_DIRS if name in NEEDS_DATA else ("log_dir",))
    if name in NEEDS_DATA:
        problems += packing_problems(loaded)
        if vocab_size is not None:
            problems += token_id_problems(loaded, vocab_size)
    return vocab_size, problems


# Directories the ranks write: config key of each (check_save_dir adds the room for `save`).
OUTPUT_DIRS = ("save", "log_dir", "tensorboard_dir", "data_cache_dir")


def output_dir_problems(loaded: LoadedConfig, keys: tuple[str, ...] = OUTPUT_DIRS) -> list[str]:
    """Each directory the ranks will write that cannot be: a file, inside a file, or not
    writable (probed with a temporary directory in the nearest existing folder, removed at
    once, since permission bits do not bind root: a read-only mount or sysfs still refuse)."""
    import tempfile

    cfg = loaded.config
    values = {
        "save": cfg.checkpoint.save,
        "log_dir": cfg.logging.log_dir,
        "tensorboard_dir": cfg.logging.tensorboard_dir,
        "data_cache_dir": cfg.data.data_cache_dir,
    }
    problems = []
    for key in keys:
        value = values[key]
        if not value:
            continue
        where = f"{loaded.source_of(key)}: {key}={value!r}"
        path = Path(value)
        try:
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as e:  # a folder on the way that cannot be searched
            problems.append(f"{where} cannot be reached ({e.strerror}); point {key} elsewhere")
            continue
        if existing == path and not path.is_dir():
            problems.append(f"{where} is a file, not a directory; point {key} at a directory")
            continue
        if not existing.is_dir():
            problems.append(
                f"{where} is inside {existing}, a file; point {key} at a directory elsewhere"
            )
            continue
        try:
            Path(tempfile.mkdtemp(prefix=".neox_write_probe_", dir=existing)).rmdir()
        except OSError as e:
            what = "the checkpoint directory" if key == "save" else "the directory"
            problems.append(
                f"{where}: {what} cannot be written ({e.strerror}); make it "
                f"writable or point {key} elsewhere"
            )
    return problems


def text_prefixes(cfg) -> list[tuple[str, str]]:
    """(config key, prefix) of the token datasets (not labels or rewards), each prefix once."""
    seen: dict[str, str] = {}
    for key, prefix in data_prefixes(cfg):
        if "label" not in key and "reward" not in key:
            seen.setdefault(prefix, key)
    return [(key, prefix) for prefix, key in seen.items()]


def token_id_problems(loaded: LoadedConfig, vocab_size: int) -> list[str]:
    """Datasets holding a token id the tokenizer does not have (tokenized with another one):
    the whole .bin when small, evenly spaced windows of a large one (IndexedDataset.
    largest_token), so this costs well under a second."""
    from neox.data.indexed import IndexedDataset, IndexedDatasetError

    problems = []
    t = loaded.config.tokenizer.tokenizer_type
    for key, prefix in text_prefixes(loaded.config):
        try:
            dataset = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError):
            continue  # check_data names the file
        try:
            largest, _ = dataset.largest_token()
        finally:
            dataset.close()
        if largest >= vocab_size:
            problems.append(
                f"{loaded.source_of(key)}: {key}={prefix!r}: {prefix}.bin holds token id "
                f"{largest}, but tokenizer_type={t} has {vocab_size} tokens (ids 0.."
                f"{vocab_size - 1}): it was tokenized with another tokenizer; re-run "
                "tools/preprocess_data.py with this one, or set the tokenizer it was made with"
            )
    return problems


def packing_problems(loaded: LoadedConfig) -> list[str]:
    """pack_impl unpacked / pack_until_overflow with allow_chopped false draws only documents
    that fit seq_length + 1 tokens: a dataset with none could draw no sample (reads .idx)."""
    from neox.data.indexed import IndexedDataset, IndexedDatasetError

    cfg = loaded.config
    d, limit = cfg.data, cfg.model.seq_length + 1
    if d.pack_impl == "packed" or d.allow_chopped:
        return []
    problems = []
    for key, prefix in text_prefixes(cfg):
        if key not in ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths"):
            continue  # preference pairs are drawn by neox/data/pairs.py
        try:
            dataset = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError):
            continue  # check_data names the file
        sizes = dataset.sizes
        dataset.close()
        if len(sizes) and int(sizes.min()) > limit:
            problems.append(
                f"{loaded.source_of(key)}: {key}={prefix!r}: none of its {len(sizes)} documents "
                f"fits seq_length + 1 = {limit} tokens (the shortest has {int(sizes.min())}), so "
                f"pack_impl={d.pack_impl} with allow_chopped: false can draw no sample; set "
                "allow_chopped: true, raise seq_length, or use pack_impl: packed"
            )
    return problems


# DeepSpeed config sections with a pydantic model of DeepSpeed's own: section -> (module, class).
DEEPSPEED_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
}
# Keys neox itself checks in these sections (the rest is DeepSpeed's to judge).
OWN_KEYS = {"stage", "enabled"}


def deepspeed_section_problems(loaded: LoadedConfig, ds_config: dict) -> list[str]:
    """The DeepSpeed sections the configs fill in, checked by DeepSpeed's own config models
    (its rules, not a copy of them), one line per bad key, before any rank would meet them.
    DeepSpeed's models import torch (about 2 s), so they run only for sections the configs give
    keys beyond `stage`/`enabled` (gpt-neox's stock configs do; neox's defaults need no check)."""
    import importlib

    cfg = loaded.config
    given = {
        name: getattr(cfg.deepspeed, name, None) or getattr(cfg.precision, name, None)
        for name in DEEPSPEED_MODELS
    }
    problems = []
    for name, (module, cls) in DEEPSPEED_MODELS.items():
        if not isinstance(given[name], dict) or not set(given[name]) - OWN_KEYS:
            continue
        from pydantic import ValidationError

        model = getattr(importlib.import_module(module), cls)
        try:
            model(**ds_config.get(name, {}))
        except ValidationError as e:
            where = loaded.source_of(name)
            problems += [
                f"{where}: {name}.{'.'.join(map(str, err['loc']))}={err.get('input')!r}: "
                f"{err['msg']} (DeepSpeed's {cls}); fix or remove the key"
                for err in e.errors()
            ]
    return problems


# DeepSpeed ops an optimizer type steps with (neox/training/optim.py), by op builder name.
OPTIMIZER_OPS = {"lion": ("FusedLionBuilder", "DeepSpeed's FusedLion")}


def optimizer_problems(loaded: LoadedConfig, derived, cpu_ranks: bool) -> list[str]:
    """The optimizer the ranks would build (neox.plan.engine_choice) against what it takes and
    where it runs: optimizer.params against DeepSpeed's CPU Adam when ZeRO-Offload swaps it in,
    and an optimizer whose DeepSpeed op has no CPU implementation on CPU ranks."""
    from neox.config.optimizer import unknown_params
    from neox.plan.engine_choice import engine_for

    cfg = loaded.config
    where = loaded.source_of("optimizer")
    try:
        choice = engine_for(cfg, derived)
    except ConfigError:
        return []  # the engine's own refusal is reported where the estimate meets it
    problems = []
    if choice.optimizer != derived.optimizer_type:
        shown = "DeepSpeed's CPU Adam (zero_optimization.offload_optimizer)"
        problem = unknown_params(choice.optimizer, cfg.optimizer.optimizer.params, shown)
        if problem:
            problems.append(f"{where}: {problem}")
    op = OPTIMIZER_OPS.get(choice.optimizer)
    if cpu_ranks and op is not None:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        builder, name = op
        if CPU_Accelerator().get_op_builder(builder).__name__ == "NotImplementedBuilder":
            problems.append(
                f"{where}: optimizer type {derived.optimizer_type} steps with {name}, "
                "which has no CPU implementation, and these ranks run on CPU; use Adam, AdamW "
                "or SGD, or run on GPUs"
            )
    return problems


def derived_problems(loaded: LoadedConfig, derived, script: str, cpu_ranks: bool) -> list[str]:
    """The checks that need the derived values: precision on CPU ranks, empty paths, the save
    directory (looked at only: it is created once the launch is accepted), empty splits."""
    problems = [
        p
        for p in [
            precision_problem(loaded, derived.precision, cpu_ranks),
            fp8_problem(loaded, cpu_ranks),
        ]
        if p
    ]
    problems += empty_path_problems(loaded)
    try:
        check_save_dir(loaded, derived, create=False)
    except ConfigError as e:
        problems.append(str(e))
    if Path(script).name in NEEDS_DATA:
        problems += split_problems(loaded, drawn_splits(derived.samples))
        problems += optimizer_problems(loaded, derived, cpu_ranks)
    return problems


def git_hash() -> Optional[str]:
    """The commit of the neox checkout this code runs from (None outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def checkpoint_bytes(cfg, derived) -> int:
    """One checkpoint's size, summed over every rank's files (tests/faults/test_checkpoint_faults.py
    measures it): state/ (neox/checkpoint/plain_state.py), the fp32 weights and the optimizer's
    moments by plain name (Adam two, SGD none), and what is not tensors, 32 KiB for its index
    and client state and 32 KiB for config.yml and the manifest."""
    from neox.plan.engine_choice import engine_for
    from neox.plan.estimate import count_parameters
    from neox.plan.memory import OPTIMIZER_STATES

    params = count_parameters(cfg.model, derived.padded_vocab_size or 0)
    states = OPTIMIZER_STATES.get(engine_for(cfg, derived).optimizer.lower(), 1)
    return params * 4 * (1 + min(states, 2)) + 2 * 32 * 1024


def check_lora_base(loaded: LoadedConfig) -> None:
    """train.py with LoRA: lora_base names a checkpoint to read the base from."""
    lo = loaded.config.lora
    if not lo.lora_rank or lo.lora_base is None:
        return
    problem = checkpoint_problem(lo.lora_base)
    if problem is not None:
        problem = problem.replace("load=", "lora_base=").replace("set `load`", "set lora_base")
        raise ConfigError(f"{loaded.source_of('lora_base')}: {problem}")


def check_save_lock(loaded: LoadedConfig) -> None:
    """No other run holds the `save` directory (neox.checkpoint.lock)."""
    from neox.checkpoint.lock import lock_problem

    save = loaded.config.checkpoint.save
    if save is not None and (problem := lock_problem(Path(save))) is not None:
        raise ConfigError(f"{loaded.source_of('save')}: {problem}")


def empty_path_problems(loaded: LoadedConfig) -> list[str]:
    """`save: ""` or `load: ""`: gpt-neox reads an empty path as unset, so a run would never
    save (or never resume) without a word; neox asks for null or a directory instead."""
    c = loaded.config.checkpoint
    return [
        f"{loaded.source_of(key)}: {key}={value!r} is an empty path, which would silently "
        f"{what}; set {key}: null (or remove it) to {what}, or name a directory"
        for key, value, what in (
            ("save", c.save, "save no checkpoint"),
            ("load", c.load, "start from scratch"),
        )
        if value is not None and not value.strip()
    ]


def check_save_dir(loaded: LoadedConfig, derived, create: bool) -> None:
    """The `save` directory can be written and has room for at least one checkpoint.

    Args:
        create: make the directory and write a probe file (a real launch); otherwise only look
            at the nearest existing ancestor (a dry run creates nothing).
    """
    import shutil

    from neox.checkpoint.lock import reclaimable_bytes

    save = loaded.config.checkpoint.save
    if save is None:
        return
    where = f"{loaded.source_of('save')}: save={save!r}"
    path = Path(save)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".neox_write_probe_{os.getpid()}"
            try:
                probe.write_bytes(b"0" * 4096)
            finally:
                probe.unlink(missing_ok=True)
        existing = next(p for p in (path, *path.parents) if p.exists())
        # Partial saves of a run that died are removed when the next run takes the save lock.
        free = shutil.disk_usage(existing).free + reclaimable_bytes(path)
    except OSError as e:
        raise ConfigError(
            f"{where}: the checkpoint directory cannot be written ({e.strerror}); make it "
            "writable or point `save` elsewhere"
        ) from None
    need = checkpoint_bytes(loaded.config, derived)
    if free < need:
        raise ConfigError(
            f"{where}: {free / 1e6:.1f} MB free, but one checkpoint needs at least "
            f"{need / 1e6:.1f} MB (weights, fp32 master weights and optimizer states); free "
            "space or point `save` elsewhere"
        )

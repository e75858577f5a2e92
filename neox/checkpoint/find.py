"""Which checkpoint a `load` directory resumes from: the one `latest` names if it is complete,
else the newest complete one. Torch-free, so deepy.py can check before it launches anything."""

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from neox.checkpoint.ds_files import MP_FILES, is_model_file
from neox.checkpoint.manifest import MANIFEST, manifest_problem, safe_name

TAG_PREFIX = "global_step"
# A save in progress writes here, and renames to the tag once every rank's shards are complete.
STAGING_SUFFIX = ".partial"
# Marks a directory of model weights only (tools that convert or re-lay-out weights write it):
# a run starts from it with `finetune: true`, never resumes it.
WEIGHTS_ONLY = "weights_only.txt"
# The training state by plain parameter name (neox/checkpoint/plain_state.py), its metadata file.
PLAIN_STATE = "state"
PLAIN_STATE_META = "meta.json"


def tag_for(iteration: int) -> str:
    return f"{TAG_PREFIX}{iteration}"


def step_of(tag: str) -> Optional[int]:
    rest = tag[len(TAG_PREFIX) :] if tag.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def latest_tag(load_dir: Path) -> tuple[Optional[str], Optional[str]]:
    """(the tag `latest` names, None), (None, None) without one, or (None, why it is garbage).

    `latest` is a one-line tag of a directory inside load_dir: binary bytes, several lines, an
    absolute path or `..` are never followed.
    """
    latest = Path(load_dir) / "latest"
    if not latest.is_file():
        return None, None
    try:
        raw = latest.read_bytes()[:1024].decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None, f"{latest} is not text (binary bytes)"
    tag = raw.strip()
    if not tag or "\n" in tag or "/" in tag or not safe_name(tag) or not tag.isprintable():
        return None, f"{latest} holds {tag[:80]!r}, not the name of a checkpoint directory"
    return tag, None


def read_latest(load_dir: Path) -> Optional[str]:
    """The checkpoint tag `latest` names, or None (missing or garbage)."""
    return latest_tag(load_dir)[0]


def step_tags(load_dir: Path) -> list[str]:
    """Checkpoint directories (not staging ones), newest first."""
    tags = [
        p.name
        for p in Path(load_dir).glob(f"{TAG_PREFIX}*")
        if p.is_dir() and step_of(p.name) is not None
    ]
    return sorted(tags, key=step_of, reverse=True)


def has_plain_state(step_dir: Path) -> bool:
    """The checkpoint carries its training state by plain name: it resumes at any layout."""
    return (step_dir / PLAIN_STATE / PLAIN_STATE_META).is_file()


def written_by_neox(step_dir: Path) -> bool:
    """neox writes config.yml into every checkpoint (train.py's saves and the conversion
    tools'); gpt-neox and DeepSpeed do not."""
    return (step_dir / "config.yml").is_file()


def unverified_problem(step_dir: Path) -> Optional[str]:
    """The refusal of a checkpoint neox wrote that has no manifest, or None: every neox save
    ends with one, so its loss (or deletion) would hide corrupt files."""
    if (step_dir / MANIFEST).is_file() or not written_by_neox(step_dir):
        return None
    return (
        f"{step_dir} has lost its {MANIFEST} (neox writes one with every save), so its files "
        "cannot be checked; restore it, or set allow_unverified_checkpoint: true (tools: "
        "--allow-unverified) to load the files unchecked"
    )


def checkpoint_problem(
    step_dir: Path, verify: bool = False, allow_unverified: bool = False
) -> Optional[str]:
    """Why the checkpoint in step_dir cannot be loaded, or None if it looks complete.

    With a manifest (written by neox once every shard is on disk) each file must be present at
    its recorded size, and with `verify` match its recorded checksum (reads every byte);
    every torch file must also end in a readable zip directory, which a truncated write lacks.
    Without `verify` it reads no tensors, so it is quick even for large checkpoints. A
    checkpoint neox wrote without its manifest is refused unless `allow_unverified`.
    """
    if not step_dir.is_dir():
        return f"{step_dir} does not exist"
    problem = manifest_problem(step_dir, verify=verify) or config_problem(step_dir)
    if problem is None and not allow_unverified:
        problem = unverified_problem(step_dir)
    if problem is not None:
        return problem
    shards = sorted(step_dir.glob("*.pt"))
    if not any(is_model_file(p.name) for p in shards) and not has_plain_state(step_dir):
        return f"{step_dir} holds no model states ({PLAIN_STATE}/ or {MP_FILES})"
    for path in [*shards, *sorted((step_dir / PLAIN_STATE).glob("*.pt"))]:
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, OSError, ValueError) as e:  # ValueError: a garbled name
            return f"{path} is not a complete torch file ({e}): truncated or corrupt"
    return None


def config_problem(step_dir: Path) -> Optional[str]:
    """Why the checkpoint's config.yml (if any) is not a YAML mapping, or None."""
    path = step_dir / "config.yml"
    if not path.is_file():
        return None
    try:
        if isinstance(yaml.safe_load(path.read_bytes().decode("utf-8")), dict):
            return None
        return f"{path} is not a config (no key: value mapping)"
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        return f"{path} is garbled ({type(e).__name__})"


@dataclass
class Resume:
    """The checkpoint to resume from, and the ones passed over on the way."""

    load_dir: Path
    tag: Optional[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (tag, reason)
    notes: list[str] = field(default_factory=list)  # e.g. a garbage `latest`, ignored
    # The older ones, to try if this one still fails to load: (tag, reason it cannot) or
    # (tag, None) when it looks complete.
    fallbacks: list[tuple[str, Optional[str]]] = field(default_factory=list)

    @property
    def path(self) -> Optional[Path]:
        return self.load_dir / self.tag if self.tag else None

    def report(self) -> list[str]:
        return self.notes + [f"skipping checkpoint {tag}: {reason}" for tag, reason in self.skipped]


def find_checkpoint(load_dir: str, allow_unverified: bool = False) -> Resume:
    """The checkpoint `latest` names if it is complete, else the newest complete one. One
    without a manifest is used only if another tool wrote it (noted as unverified), or with
    `allow_unverified`."""
    root = Path(load_dir)
    latest, garbage = latest_tag(root)
    resume = Resume(root, None)
    if garbage:
        resume.notes.append(f"ignoring {garbage}; resuming from the newest complete checkpoint")
    tags = step_tags(root)
    order = ([latest] if latest else []) + [t for t in tags if t != latest]
    # Every save of neox ends with a manifest: where some checkpoints have one, a checkpoint
    # without it lost it (and maybe more). Checkpoints of other tools have none at all.
    manifests = not allow_unverified and any((root / t / MANIFEST).is_file() for t in tags)
    for tag in order:
        problem = checkpoint_problem(root / tag, allow_unverified=allow_unverified)
        if problem is None and manifests and not (root / tag / MANIFEST).is_file():
            problem = f"{root / tag} has lost its {MANIFEST} (neox writes one with every save)"
        if resume.tag is not None:
            resume.fallbacks.append((tag, problem))
        elif problem is not None:
            resume.skipped.append((tag, problem))
        else:
            resume.tag = tag
    if resume.tag is not None and not (root / resume.tag / MANIFEST).is_file():
        who = "written by neox" if written_by_neox(root / resume.tag) else "not written by neox"
        resume.notes.append(
            f"{root / resume.tag} has no {MANIFEST} ({who}): its files are loaded unverified, "
            "their checksums unknown"
        )
    return resume

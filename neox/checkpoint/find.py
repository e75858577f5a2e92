"""Which checkpoint a `load` directory resumes from: the one `latest` names if it is complete,
else the newest complete one. Torch-free, so deepy.py can check before it launches anything."""

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TAG_PREFIX = "global_step"
MANIFEST = "manifest.json"
# A save in progress writes here, and renames to the tag once every rank's shards are complete.
STAGING_SUFFIX = ".partial"
# Marks a directory of model weights only (tools that convert or re-lay-out weights write it):
# a run starts from it with `finetune: true`, never resumes it.
WEIGHTS_ONLY = "weights_only.txt"


def tag_for(iteration: int) -> str:
    return f"{TAG_PREFIX}{iteration}"


def step_of(tag: str) -> Optional[int]:
    rest = tag[len(TAG_PREFIX) :] if tag.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def read_latest(load_dir: Path) -> Optional[str]:
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def step_tags(load_dir: Path) -> list[str]:
    """Checkpoint directories (not staging ones), newest first."""
    tags = [
        p.name
        for p in Path(load_dir).glob(f"{TAG_PREFIX}*")
        if p.is_dir() and step_of(p.name) is not None
    ]
    return sorted(tags, key=step_of, reverse=True)


def checkpoint_problem(step_dir: Path) -> Optional[str]:
    """Why the checkpoint in step_dir cannot be loaded, or None if it looks complete.

    With a manifest (written by neox once every shard is on disk) each file must be present at
    its recorded size; every torch file must also end in a readable zip directory, which a
    truncated write lacks. Reads no tensors, so it is quick even for large checkpoints.
    """
    if not step_dir.is_dir():
        return f"{step_dir} does not exist"
    manifest = step_dir / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as e:
            return f"{manifest} is unreadable ({e})"
        for name, size in files.items():
            path = step_dir / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != size:
                return f"{path} is {path.stat().st_size} bytes, {size} expected (truncated?)"
    shards = sorted(step_dir.glob("*.pt"))
    if not any(p.name.endswith("model_states.pt") or p.name.startswith("layer_") for p in shards):
        return f"{step_dir} holds no model states (mp_rank_*_model_states.pt)"
    for path in shards:
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, OSError) as e:
            return f"{path} is not a complete torch file ({e}): truncated or corrupt"
    return None


@dataclass
class Resume:
    """The checkpoint to resume from, and the ones passed over on the way."""

    load_dir: Path
    tag: Optional[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (tag, reason)
    # The older ones, to try if this one still fails to load: (tag, reason it cannot) or
    # (tag, None) when it looks complete.
    fallbacks: list[tuple[str, Optional[str]]] = field(default_factory=list)

    @property
    def path(self) -> Optional[Path]:
        return self.load_dir / self.tag if self.tag else None

    def report(self) -> list[str]:
        return [f"skipping checkpoint {tag}: {reason}" for tag, reason in self.skipped]


def find_checkpoint(load_dir: str) -> Resume:
    """The checkpoint `latest` names if it is complete, else the newest complete one."""
    root = Path(load_dir)
    latest = read_latest(root)
    order = ([latest] if latest else []) + [t for t in step_tags(root) if t != latest]
    resume = Resume(root, None)
    for tag in order:
        problem = checkpoint_problem(root / tag)
        if resume.tag is not None:
            resume.fallbacks.append((tag, problem))
        elif problem is not None:
            resume.skipped.append((tag, problem))
        else:
            resume.tag = tag
    return resume

"""The manifest of a checkpoint: every file's size and sha256, written last at save and checked
before the checkpoint is used. Torch-free, so deepy.py can read it before launching.

A size catches a truncated write; the checksum catches flipped bits (a bad disk, a bad copy)
that would otherwise resume silently or be served to eval, generate and export. Checking reads
every byte once (sha256 runs at 0.5-2 GB/s per core; files are hashed in parallel threads).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Optional

MANIFEST = "manifest.json"
ALGORITHM = "sha256"


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return f"{ALGORITHM}:{hashlib.file_digest(f, ALGORITHM).hexdigest()}"


def bytes_digest(data: bytes) -> str:
    """file_digest of a file holding `data`."""
    return f"{ALGORITHM}:{hashlib.new(ALGORITHM, data).hexdigest()}"


def digests(root: Path, names: Iterable[str]) -> dict[str, str]:
    """name -> checksum of root/name, several files at a time (hashlib releases the GIL)."""
    names = list(names)
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(root / n), names)))


def files_in(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]


def write_manifest(
    root: Path,
    iteration: int,
    padded_vocab_size: Optional[int],
    known: Optional[dict[str, str]] = None,
) -> None:
    """Record every file under root (the checksums in `known` are not computed again)."""
    names = [n for n in files_in(root) if n != MANIFEST]
    known = {n: d for n, d in (known or {}).items() if n in names}
    sums = {**known, **digests(root, [n for n in names if n not in known])}
    manifest = {
        "iteration": iteration,
        "padded_vocab_size": padded_vocab_size,
        "files": {n: (root / n).stat().st_size for n in names},
        "checksums": {n: sums[n] for n in names},
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))


def safe_name(name: Any) -> bool:
    """A relative path that stays inside the checkpoint directory."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and ".." not in parts and "." not in parts


def read_manifest(step_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    """(manifest, None), (None, None) when there is none, or (None, why it is unusable)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None, None
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
        files = manifest["files"]
        sums = manifest.get("checksums", {})
        if not isinstance(files, dict) or not isinstance(sums, dict):
            raise ValueError("`files` and `checksums` must be mappings")
        for name, size in files.items():
            if not safe_name(name) or not isinstance(size, int):
                raise ValueError(f"bad entry {name!r}: {size!r}")
        if not all(safe_name(n) and isinstance(d, str) for n, d in sums.items()):
            raise ValueError("bad checksum entry")
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{path} is unreadable ({str(e)[:200]})"
    return manifest, None


def closure_problem(step_dir: Path, manifest: Optional[dict]) -> Optional[str]:
    """Why step_dir is not a closed set of files, or None: every entry under it is a plain file
    or directory (a symbolic link could lead any loader out of the checkpoint, and glob and
    rglob do not descend into linked directories, so its files would go unchecked), and with a
    manifest every file is listed in it (a file it does not list was never checksummed)."""
    listed = set((manifest or {}).get("files", {})) | {MANIFEST}
    for folder, dirs, files in os.walk(step_dir):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink():
                return (
                    f"{path} is a symbolic link (to {os.readlink(path)}): a checkpoint's files "
                    "must lie inside its directory; replace the link by a copy of what it names"
                )
            rel = str(path.relative_to(step_dir))
            if manifest is not None and name in files and rel not in listed:
                return (
                    f"{path} is not listed in {step_dir / MANIFEST}: it was added after the "
                    "save and is unchecked; remove it"
                )
    return None


def manifest_problem(
    step_dir: Path, verify: bool = False, only: Optional[list[str]] = None
) -> Optional[str]:
    """Why step_dir's files do not match its manifest, or None. No symbolic links, no file the
    manifest does not list, sizes always; with `verify` the checksums of the files in `only`
    (default all) too. No manifest: only the links are checked."""
    manifest, problem = read_manifest(step_dir)
    if problem is not None:
        return problem
    if problem := closure_problem(step_dir, manifest):
        return problem
    if manifest is None:
        return None
    for name, size in manifest["files"].items():
        path = step_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is {path.stat().st_size} bytes, {size} expected (truncated?)"
    if not verify:
        return None
    sums = manifest.get("checksums", {})
    names = [n for n in (only if only is not None else sums) if n in sums]
    for name, digest in digests(step_dir, names).items():
        if digest != sums[name]:
            return (
                f"{step_dir / name} is corrupt: its content differs from the checksum recorded "
                f"when it was saved ({MANIFEST})"
            )
    return None

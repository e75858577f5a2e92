"""The training state by plain parameter name, independent of the layout that saved it.

A run checkpoint is `state/` (with config.yml, the tokenizer files and the manifest beside it):
per logical parameter of the plain (unsharded) model, its fp32 master weight and Adam's exp_avg
and exp_avg_sq, plus the optimizer step, the loss scale and the engine's counters. Both engines
write it and read it back, at any layout (engine, TP, PP, DP, ZeRO stage); DeepSpeed's own files
are only read (checkpoints of gpt-neox, DeepSpeed and neox before this format:
neox/checkpoint/ds_files.py). docs/checkpoints.md says why this format (safetensors pieces and a
JSON index, no pickle for the tensors) and not DCP.

Each writing rank stores its pieces, whole TP slices of the logical tensors, in
`state/rank_RRRRR.safetensors` and describes them in `state/rank_RRRRR.json`: for each key
`<kind>/<name>`, the logical shape, the dim TP splits (None: whole) and where the slice starts.
Replicated tensors are written once (data-parallel rank 0; tensor-parallel rank 0 for
unsplit ones). An engine whose data-parallel ranks each own a contiguous range of the flattened
state (ZeRO-1/2, the flat engine) writes each rank's own range instead, a fragment: its entry adds
`flat` ([first, end) element of the flattened TP slice) and `local` (the TP slice's shape), and
the fragments of a slice together cover it exactly. A loading rank reads only the slices its own
parameters need (safe_open's get_slice; a fragmented slice is joined first), so any TP/PP/DP
split of the same model reads the same files. The client state
(counters, RNG states, DPO/KTO's reference weights) is kept per model-parallel rank, as
DeepSpeed kept it: `client_state.pt` for model-parallel rank 0, `client_state_mpRRRRR.pt` for
the others; a run at the saved TP/PP reads its own, any other rank 0's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.find import PLAIN_STATE, PLAIN_STATE_META

STATE_DIR = PLAIN_STATE
META_FILE = PLAIN_STATE_META
CLIENT_FILE = "client_state.pt"
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
"""What is kept per parameter: the fp32 master weight and Adam's two moments."""


@dataclass
class Piece:
    """One rank's part of a logical parameter: a slice along `dim` from `start` (dim None: the
    whole tensor), for each of KINDS (moments absent before the first step)."""

    name: str
    shape: tuple[int, ...]
    dim: Optional[int]
    start: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    flat: Optional[tuple[int, int]] = None
    """A fragment: elements [first, end) of the flattened TP slice (tensors are 1-D); None:
    the whole slice."""
    local: Optional[tuple[int, ...]] = None
    """A fragment's TP slice shape."""


@dataclass
class Layout:
    """What decides how an engine's own files are laid out; equal layouts load those files."""

    engine: str
    tp: int
    pp: int
    dp: int
    zero_stage: int

    def describe(self) -> str:
        return (
            f"{self.engine} engine, tp={self.tp} pp={self.pp} dp={self.dp} ZeRO-{self.zero_stage}"
        )


def tp_place(
    local_shape: tuple[int, ...], dim: Optional[int], rank: int, tp: int
) -> tuple[tuple[int, ...], Optional[int], int]:
    """(logical shape, split dim or None, start) of a tensor-parallel rank's slice."""
    shape = list(local_shape)
    if dim is None or tp == 1:
        return tuple(shape), None, 0
    shape[dim] *= tp
    return tuple(shape), dim, rank * local_shape[dim]


def tp_piece(name: str, local: dict[str, torch.Tensor], dim: Optional[int], rank: int, tp: int):
    """The Piece of a tensor-parallel rank's `local` tensors of parameter `name`."""
    some = next(iter(local.values()))
    return Piece(name, *tp_place(tuple(some.shape), dim, rank, tp), local)


def fragment(
    name: str,
    local_shape: tuple[int, ...],
    lo: int,
    hi: int,
    tensors: dict[str, torch.Tensor],
    dim: Optional[int] = None,
    rank: int = 0,
    tp: int = 1,
) -> Piece:
    """The Piece of elements [lo, hi) of the flattened TP slice (of `local_shape`) of parameter
    `name`, as one data-parallel rank owns them (`tensors` 1-D); a whole slice is written as
    tp_piece writes it."""
    local_shape = tuple(local_shape)
    if (lo, hi) == (0, math.prod(local_shape)):
        tensors = {k: t.view(local_shape) for k, t in tensors.items()}
        return Piece(name, *tp_place(local_shape, dim, rank, tp), tensors)
    return Piece(name, *tp_place(local_shape, dim, rank, tp), tensors, (lo, hi), local_shape)


def write_pieces(step_dir: Path, rank: int, pieces: list[Piece]) -> dict[Path, str]:
    """This rank's pieces (may be none) into step_dir/state; every rank calls it. Returns the
    files written with their checksums, computed as they were written (the manifest's, without
    reading the files back: neox.checkpoint.hashed_write)."""
    from neox.checkpoint.hashed_write import save_hashed
    from neox.checkpoint.manifest import bytes_digest

    out = Path(step_dir) / STATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    if not pieces:
        return {}
    tensors, index = {}, {}
    for p in pieces:
        for kind, t in p.tensors.items():
            key = f"{kind}/{p.name}"
            tensors[key] = t.detach().to("cpu", torch.float32).contiguous()
            index[key] = {"shape": list(p.shape), "dim": p.dim, "start": p.start}
            if p.flat is not None:
                index[key].update(flat=list(p.flat), local=list(p.local))
    stem = f"rank_{rank:05d}"
    data, text = out / f"{stem}.safetensors", (json.dumps(index, indent=0) + "\n").encode()
    sums = {data: save_hashed(tensors, data)}
    (out / f"{stem}.json").write_bytes(text)
    sums[out / f"{stem}.json"] = bytes_digest(text)
    return sums


def client_file(mp_rank: int) -> str:
    """The client state file of a model-parallel rank (pipeline stage x tp + tp rank)."""
    return CLIENT_FILE if mp_rank == 0 else f"client_state_mp{mp_rank:05d}.pt"


def write_meta(step_dir: Path, layout: Layout, scalars: dict[str, Any]) -> list[Path]:
    """Rank 0: the saving layout and the engine's scalars; the files."""
    out = Path(step_dir) / STATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    meta = {"layout": vars(layout), "scalars": scalars}
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return [out / META_FILE]


def write_client_state(step_dir: Path, mp_rank: int, client_state: dict[str, Any]) -> list[Path]:
    """Data-parallel rank 0 of each model-parallel rank: its client state; the file."""
    out = Path(step_dir) / STATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    torch.save(client_state, out / client_file(mp_rank))
    return [out / client_file(mp_rank)]


def copy_plain_state(src_step_dir: Path, dst_step_dir: Path) -> None:
    """A checkpoint's state/ into a re-laid-out copy of its weights (tools/reshape_checkpoint.py).
    The layout recorded becomes `reshape_checkpoint`'s, which no engine has: a run resumes the
    copy from state/, never from its weights-only engine files."""
    import shutil

    dst = Path(dst_step_dir) / STATE_DIR
    shutil.copytree(Path(src_step_dir) / STATE_DIR, dst)
    meta = json.loads((dst / META_FILE).read_text())
    meta["layout"]["engine"] = "reshape_checkpoint"
    (dst / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def saved_layout(step_dir: Path) -> Optional[Layout]:
    """The layout a checkpoint's state/ was written by, or None when it has none."""
    path = Path(step_dir) / STATE_DIR / META_FILE
    if not path.is_file():
        return None
    return Layout(**json.loads(path.read_text())["layout"])


class PlainState:
    """A checkpoint's state/ for reading: any slice of any logical tensor, and the client state
    of model-parallel rank `mp_rank` (rank 0's where the checkpoint has none of its own)."""

    def __init__(self, step_dir: Path, trust: bool = False, mp_rank: int = 0) -> None:
        from neox.checkpoint.trust import load_file

        self.dir = Path(step_dir) / STATE_DIR
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise CheckpointError(
                f"{step_dir} has no {STATE_DIR}/{META_FILE}: it was saved before checkpoints "
                "carried their state by plain name, so it resumes only at the layout that saved "
                "it; resume at that layout, or set finetune: true to load its weights"
            )
        meta = json.loads(meta_path.read_text())
        self.layout = Layout(**meta["layout"])
        self.scalars: dict[str, Any] = meta["scalars"]
        # Model-parallel ranks with a client state file of their own (1 before it was per rank).
        self.client_ranks = len(list(self.dir.glob("client_state*.pt")))
        own = self.dir / client_file(mp_rank)
        self.client_state: dict[str, Any] = load_file(
            own if own.is_file() else self.dir / CLIENT_FILE, trust
        )
        # key -> [(file, entry)]: a split tensor has one entry per saved TP rank.
        self.entries: dict[str, list[tuple[Path, dict]]] = {}
        for index in sorted(self.dir.glob("rank_*.json")):
            data = index.with_suffix(".safetensors")
            if not data.is_file():
                raise CheckpointError(f"{data} is missing: the checkpoint is incomplete")
            for key, entry in json.loads(index.read_text()).items():
                self.entries.setdefault(key, []).append((data, entry))
        for key, entries in self.entries.items():
            slices = tp_slices(entries)
            # A split tensor has one slice per saving tensor-parallel rank, all of them.
            if entries[0][1]["dim"] is not None and len(slices) != self.layout.tp:
                raise CheckpointError(
                    f"{self.dir} holds {len(slices)} of the {self.layout.tp} tensor-parallel "
                    f"pieces of {key}: the checkpoint is incomplete"
                )
            for parts in slices:
                check_fragments(self.dir, key, parts)

    def has(self, kind: str, name: str) -> bool:
        return f"{kind}/{name}" in self.entries

    def read(
        self, kind: str, name: str, shape: tuple[int, ...], dim: Optional[int], start: int
    ) -> torch.Tensor:
        """The slice of `kind` of parameter `name` this rank holds: `shape` from `start` along
        `dim` (dim None: the whole tensor). Rows past the saved logical shape (a vocabulary
        padded further at this layout) are zeros."""
        from safetensors import safe_open

        key = f"{kind}/{name}"
        if key not in self.entries:
            raise CheckpointError(
                f"{self.dir} holds no {key}: the checkpoint was saved by another model; resume "
                "with the model config it was saved with"
            )
        out = torch.zeros(shape, dtype=torch.float32)
        region = [(0, n) for n in shape]
        if dim is not None:
            region[dim] = (start, start + shape[dim])
        for parts in tp_slices(self.entries[key]):
            data, entry = parts[0]
            if "flat" in entry:  # fragments: joined into the whole slice first
                joined = _join_fragments(key, parts)
                cut = _overlap(region, entry, joined.shape)
                if cut is not None:
                    out[cut[1]] = joined[cut[0]]
                continue
            with safe_open(str(data), framework="pt") as f:
                view = f.get_slice(key)
                cut = _overlap(region, entry, view.get_shape())
                if cut is not None:
                    out[cut[1]] = view[cut[0]].to(torch.float32)
        return out


def tp_slices(entries: list[tuple[Path, dict]]) -> list[list[tuple[Path, dict]]]:
    """A key's entries grouped by the tensor-parallel slice they hold (its start): one entry
    per slice, or that slice's fragments."""
    by_start: dict[int, list[tuple[Path, dict]]] = {}
    for data, entry in entries:
        by_start.setdefault(entry["start"], []).append((data, entry))
    return list(by_start.values())


def check_fragments(step_state: Path, key: str, parts: list[tuple[Path, dict]]) -> None:
    """One whole slice, or fragments that cover their slice exactly once."""
    if len(parts) == 1 and "flat" not in parts[0][1]:
        return
    ranges = sorted(tuple(entry.get("flat") or (-1, -1)) for _, entry in parts)
    numel = math.prod(parts[0][1].get("local") or [0])
    covered = 0
    for lo, hi in ranges:
        if lo != covered:
            break
        covered = hi
    if covered != numel or numel == 0:
        raise CheckpointError(
            f"{step_state} holds {key} in pieces that do not cover it exactly (element ranges "
            f"{ranges} of {numel}): the checkpoint is incomplete"
        )


def _join_fragments(key: str, parts: list[tuple[Path, dict]]) -> torch.Tensor:
    """A tensor-parallel slice whole, from its fragments (check_fragments checked them)."""
    from safetensors import safe_open

    local = parts[0][1]["local"]
    flat = torch.empty(math.prod(local), dtype=torch.float32)
    for data, entry in parts:
        lo, hi = entry["flat"]
        with safe_open(str(data), framework="pt") as f:
            flat[lo:hi] = f.get_tensor(key).reshape(-1).to(torch.float32)
    return flat.view(local)


def _overlap(region: list[tuple[int, int]], entry: dict, held: list[int]):
    """(source index, target index) where the saved slice (`entry`, of shape `held`) meets
    `region` of the logical tensor, or None. The slice covers the saved logical shape along
    every dim but its own split dim; rows past that shape are left to the caller's zeros."""
    saved, piece_dim, piece_start = entry["shape"], entry["dim"], entry["start"]
    slices, targets = [], []
    for d, (lo, hi) in enumerate(region):
        p_lo, p_hi = 0, saved[d]
        if d == piece_dim:
            p_lo, p_hi = piece_start, piece_start + held[piece_dim]
        a, b = max(lo, p_lo), min(hi, p_hi, saved[d])
        if a >= b:
            return None
        slices.append(slice(a - p_lo, b - p_lo))
        targets.append(slice(a - lo, b - lo))
    return tuple(slices), tuple(targets)


def weights_only(state: Any) -> Any:
    """`state` (a PlainState or UniversalState) as a finetune run reads it: the weights, and
    nothing of the saving run's step, counters or client state."""
    state.scalars = {"step": None}
    state.client_state = {}
    return state


def plain_state_dict(
    step_dir: Path, trust: bool = False, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint's state/, whole and by plain name (the trainable
    parameters: every one, but for a LoRA run's frozen base): the fp32 masters, rounded to
    `dtype` (a run's training precision: the weights its model computed with)."""
    state = PlainState(step_dir, trust)
    out = {}
    for key, entries in state.entries.items():
        kind, _, name = key.partition("/")
        if kind == "fp32":
            whole = state.read(kind, name, tuple(entries[0][1]["shape"]), None, 0)
            out[name] = whole.to(dtype)
    return out


def is_universal(step_dir: Path) -> bool:
    """A DeepSpeed universal checkpoint (ds_to_universal's output): zero/<name>/fp32.pt."""
    return any((Path(step_dir) / "zero").glob("*/fp32.pt"))


class UniversalState:
    """A DeepSpeed universal checkpoint read as a PlainState: `zero/<parameter>/<kind>.pt`, each
    {"param": the whole logical tensor, ...}, `zero/<parameter>/step.pt`, and the model states
    file DeepSpeed copied beside them (the engine's counters and the client state)."""

    layout = Layout("deepspeed universal checkpoint", 0, 0, 0, 0)

    def __init__(self, step_dir: Path, trust: bool = False) -> None:
        from neox.checkpoint.ds_files import ENGINE_KEYS, mp_file
        from neox.checkpoint.trust import load_file

        self.dir, self.trust = Path(step_dir), trust
        model_file = self.dir / mp_file(0)
        if not model_file.is_file():
            raise CheckpointError(
                f"{step_dir} holds a universal checkpoint's zero/ but no {mp_file(0)}; copy the "
                "whole ds_to_universal output folder"
            )
        model = load_file(model_file, trust)
        steps = sorted(self.dir.glob("zero/*/step.pt"))
        step = load_file(steps[0], trust) if steps else None
        self.scalars: dict[str, Any] = {
            "step": None if step is None else float(step),
            "global_steps": model.get("global_steps", 0),
            "global_samples": model.get("global_samples", 0),
            "skipped_steps": model.get("skipped_steps", 0),
            "loss_scale": None,
        }
        self.client_state = {k: v for k, v in model.items() if k not in ENGINE_KEYS}
        self._cache: dict[str, torch.Tensor] = {}

    def _path(self, kind: str, name: str) -> Path:
        return self.dir / "zero" / name / f"{kind}.pt"

    def has(self, kind: str, name: str) -> bool:
        return self._path(kind, name).is_file()

    def read(
        self, kind: str, name: str, shape: tuple[int, ...], dim: Optional[int], start: int
    ) -> torch.Tensor:
        """As PlainState.read: this rank's slice, zero rows past the saved vocabulary."""
        from neox.checkpoint.trust import load_file

        path = self._path(kind, name)
        if not path.is_file():
            raise CheckpointError(
                f"{self.dir} holds no zero/{name}/{kind}.pt: the universal checkpoint was saved "
                "by another model; resume with the model config it was saved with"
            )
        full = load_file(path, self.trust)["param"].float()
        out = torch.zeros(shape, dtype=torch.float32)
        region = [slice(0, min(n, s)) for n, s in zip(shape, full.shape)]
        source = list(region)
        if dim is not None:
            hi = min(start + shape[dim], full.shape[dim])
            source[dim] = slice(start, max(start, hi))
            region[dim] = slice(0, max(0, hi - start))
        out[tuple(region)] = full[tuple(source)]
        return out

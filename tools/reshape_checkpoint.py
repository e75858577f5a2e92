"""Rewrite a neox checkpoint at another tensor/pipeline-parallel layout, in DeepSpeed's files.

Example:
    python tools/reshape_checkpoint.py --input_dir ckpt/run --output_dir ckpt/run-tp1 --tp 1 --pp 2
The weights are written as DeepSpeed's module files per tp/pp rank (what gpt-neox's tools read;
train.py itself writes neox's state by plain name alone). The training state by plain name (fp32 weights, Adam's moments and step, counters, data
position) goes along, so a run at any layout resumes the output (`load` set to it). Checkpoints
saved before neox kept that state, and --weights-only, give weights only: start a run from them
with `finetune: true`. A run at another layout can also load the original checkpoint directly.
"""

from __future__ import annotations

import argparse

from neox.checkpoint.consolidate import CheckpointError
from neox.checkpoint.find import WEIGHTS_ONLY
from neox.checkpoint.relayout import reshape_checkpoint
from neox.checkpoint.staging import OutputDirError
from neox.cli import CHECKPOINT_INPUT, add_directories, add_iteration, exit_on, tool_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    add_directories(p, CHECKPOINT_INPUT, "checkpoint directory to write")
    add_iteration(p, "reshape")
    p.add_argument("--tp", type=int, required=True, help="new model_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="new pipe_parallel_size (default 1)")
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="write the weights alone (no optimizer state): for a run started with finetune: true",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle the checkpoint files fully (runs any code they hold); only for files you "
        "trust: by default only tensors and neox's and DeepSpeed's own classes are read",
    )
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="read a checkpoint neox wrote whose manifest.json is gone, its files unchecked "
        "against their checksums (by default it is refused)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on("reshape_checkpoint", CheckpointError, OutputDirError):
        tag_dir = reshape_checkpoint(
            args.input_dir,
            args.output_dir,
            args.tp,
            args.pp,
            iteration=args.iteration,
            overwrite=args.overwrite,
            trust=args.trust_checkpoint,
            allow_unverified=args.allow_unverified,
            weights_only=args.weights_only,
        )
    if (tag_dir / WEIGHTS_ONLY).is_file():
        print(f"wrote {tag_dir} at tp={args.tp} pp={args.pp}: weights only, no optimizer state;")
        print(f"start a run from it with `finetune: true` and `load: {args.output_dir}`")
    else:
        print(f"wrote {tag_dir} at tp={args.tp} pp={args.pp} with its optimizer state;")
        print(f"resume it at any layout with `load: {args.output_dir}`")


if __name__ == "__main__":
    main()

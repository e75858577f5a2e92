"""Rewrite a neox checkpoint at another tensor/pipeline-parallel layout (weights only).

Example:
    python tools/reshape_checkpoint.py --input_dir ckpt/run --output_dir ckpt/run-tp1 --tp 1 --pp 2
The optimizer state is NOT carried over (it is tied to the old partitioning): start a run from
the output with `finetune: true` and `load` set to it. A finetune run at another layout can
also load the original checkpoint directly; it is re-laid out on load.
"""

from __future__ import annotations

import argparse

from neox.checkpoint.consolidate import CheckpointError
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
        )
    print(f"wrote {tag_dir} at tp={args.tp} pp={args.pp}: weights only, no optimizer state;")
    print(f"start a run from it with `finetune: true` and `load: {args.output_dir}`")


if __name__ == "__main__":
    main()

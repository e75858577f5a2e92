"""Rewrite a neox checkpoint at another tensor/pipeline-parallel layout (weights only).

Example:
    python tools/reshape_checkpoint.py --input_dir ckpt/run --output_dir ckpt/run-tp1 --tp 1 --pp 2
The optimizer state is NOT carried over (it is tied to the old partitioning): start a run from
the output with `finetune: true` and `load` set to it. A finetune run at another layout can
also load the original checkpoint directly; it is re-laid out on load.
"""

from __future__ import annotations

import argparse
import logging

from neox.checkpoint.consolidate import CheckpointError
from neox.checkpoint.relayout import reshape_checkpoint
from neox.checkpoint.staging import OutputDirError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--input_dir",
        required=True,
        help="checkpoint directory (uses its `latest`) or one global_stepN directory",
    )
    p.add_argument("--output_dir", required=True, help="checkpoint directory to write")
    p.add_argument("--tp", type=int, required=True, help="new model_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="new pipe_parallel_size (default 1)")
    p.add_argument("--iteration", type=int, help="reshape global_step<N> instead of `latest`")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output_dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        tag_dir = reshape_checkpoint(
            args.input_dir,
            args.output_dir,
            args.tp,
            args.pp,
            iteration=args.iteration,
            overwrite=args.overwrite,
        )
    except (CheckpointError, OutputDirError) as err:
        raise SystemExit(f"reshape_checkpoint: error: {err}") from None
    print(f"wrote {tag_dir} at tp={args.tp} pp={args.pp}: weights only, no optimizer state;")
    print(f"start a run from it with `finetune: true` and `load: {args.output_dir}`")


if __name__ == "__main__":
    main()

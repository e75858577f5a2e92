"""Convert a local Hugging Face GPTNeoX or Llama model into a neox checkpoint at a chosen TP/PP.

Example:
    python tools/convert_from_hf.py --input_dir hf/pythia-14m --output_dir ckpt/pythia-14m --tp 2
    python deepy.py train.py ckpt/pythia-14m/model.yml configs/my_data.yml
The output is a checkpoint (`latest`, global_step0/, config.yml) holding the weights only, and
model.yml: the model and tokenizer keys with `finetune: true` and `load` set to it.
"""

from __future__ import annotations

import argparse

from neox.checkpoint.consolidate import CheckpointError
from neox.checkpoint.hf_import import HFImportError, convert_from_hf
from neox.checkpoint.staging import OutputDirError
from neox.cli import add_directories, exit_on, tool_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    add_directories(
        p, "HF model directory (config.json and weights)", "neox checkpoint directory to write"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (model_parallel_size)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (pipe_parallel_size)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on("convert_from_hf", CheckpointError, HFImportError, OutputDirError):
        config, note = convert_from_hf(
            args.input_dir, args.output_dir, args.tp, args.pp, overwrite=args.overwrite
        )
    print(f"wrote {args.output_dir} (tp={args.tp}, pp={args.pp}) and {config}")
    if note:
        print(f"note: {note}")


if __name__ == "__main__":
    main()

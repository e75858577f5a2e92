"""Convert a local Hugging Face model (gpt_neox, llama, mistral, qwen2, qwen3) into a neox
checkpoint at a chosen TP/PP.

Example:
    python tools/convert_from_hf.py --input_dir hf/Llama-3.1-8B --output_dir ckpt/llama --tp 2
    python deepy.py train.py ckpt/llama/model.yml configs/my_data.yml
The input is config.json plus model.safetensors, pytorch_model.bin or their sharded
*.index.json; it is read one layer at a time, so memory stays near one layer. The output is a
checkpoint (`latest`, global_step0/, config.yml) holding the weights only, hf/ (the tokenizer
files, generation_config.json and chat template, given back by convert_to_hf.py), and model.yml:
the model and tokenizer keys with `finetune: true` and `load` set to it.
gpt-neox's tools/ckpts/convert_hf_llama_to_neox.py flags work too: --model (a local directory
here, nothing is downloaded) for --input_dir, --model_path for --output_dir, --pp 0 for 1.
A config.json field neox does not know, or cannot express, is refused by name (exit status 2)
before anything is written, as is any malformed input (a truncated or corrupt weight file, a
config.json that is not JSON or lacks a size, a shard missing or not matching the index, weights
that are not floating point, of mixed dtypes or of other shapes than config.json's).
--verify then loads the output with neox and the input with transformers and checks that their
logits (fp32, within 1e-4) and greedy tokens agree, as convert_to_hf.py --verify does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neox.checkpoint.consolidate import CheckpointError
from neox.checkpoint.staging import OutputDirError
from neox.cli import tool_parser
from neox.hf.importer import DTYPES, HFImportError, convert_from_hf
from neox.hf.weights import HFWeightsError

REFUSED = 2  # bad input, as deepy.py exits on a bad config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    p.add_argument(
        "--input_dir",
        "--model",
        dest="input_dir",
        required=True,
        help="HF model directory (config.json and weights); --model is gpt-neox's name",
    )
    p.add_argument(
        "--output_dir",
        "--model_path",
        dest="output_dir",
        required=True,
        help="neox checkpoint directory to write; --model_path is gpt-neox's name",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output_dir")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (model_parallel_size)")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (pipe_parallel_size; 0 means 1)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="dtype of the written weights (auto: as the HF files store them)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="then check that neox's load of the output computes transformers' logits (fp32, "
        "within 1e-4) and greedy tokens on a sample text",
    )
    args = p.parse_args(argv)
    if args.tp < 1 or args.pp < 0:
        p.error(f"--tp {args.tp} --pp {args.pp}: tp must be >= 1 and pp >= 0")
    args.pp = max(args.pp, 1)  # gpt-neox's converter takes 0 for "no pipeline"
    return args


def main(argv: list[str] | None = None) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if not Path(args.input_dir).is_dir():
        # A missing input is not a refused model: exit 1, as the other checkpoint tools do.
        print(f"convert_from_hf: error: {args.input_dir} is not a directory", file=sys.stderr)
        raise SystemExit(1)
    try:
        config, note = convert_from_hf(
            args.input_dir,
            args.output_dir,
            args.tp,
            args.pp,
            overwrite=args.overwrite,
            dtype=args.dtype,
        )
    except (CheckpointError, HFImportError, HFWeightsError, OutputDirError) as err:
        print(f"convert_from_hf: error: {err}", file=sys.stderr)
        raise SystemExit(REFUSED) from None
    print(f"wrote {args.output_dir} (tp={args.tp}, pp={args.pp}) and {config}")
    if note:
        print(f"note: {note}")
    if args.verify:
        from neox.hf.verify import VerifyError, verify_export

        try:
            agreement = verify_export(
                args.input_dir, args.output_dir, hf_dtype=DTYPES.get(args.dtype)
            )
        except VerifyError as err:
            print(f"convert_from_hf: verification failed: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        print(agreement.describe())


if __name__ == "__main__":
    main()

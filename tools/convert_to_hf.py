"""Export a neox checkpoint (any TP/PP/ZeRO layout) as a Hugging Face model directory.

Example:
    python tools/convert_to_hf.py --input_dir checkpoints/pythia-14m --output_dir hf/pythia-14m
The output holds config.json, model.safetensors (or shards of at most --max_shard_size with
model.safetensors.index.json), generation_config.json and the tokenizer files, ready for
AutoModelForCausalLM / AutoTokenizer.from_pretrained. A checkpoint imported with
convert_from_hf.py is written as the family it came from, with the tokenizer files, generation
config and chat template it carried. CharLevelTokenizer, SPMTokenizer and TiktokenTokenizer runs
are exported without tokenizer files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from neox.checkpoint.consolidate import CheckpointError
from neox.checkpoint.staging import OutputDirError
from neox.cli import CHECKPOINT_INPUT, add_directories, add_iteration, exit_on, tool_parser
from neox.hf.export import (
    ARCHITECTURES,
    LORA_FORMATS,
    MAX_SHARD_SIZE,
    PRECISIONS,
    ExportError,
    export_to_hf,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser(__doc__)
    add_directories(p, CHECKPOINT_INPUT, "HF model directory to write")
    add_iteration(p, "export")
    p.add_argument(
        "--config_file", help="neox config to use instead of the one saved in the checkpoint"
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="dtype of the written weights (auto: the run's precision)",
    )
    p.add_argument(
        "--architecture",
        choices=list(ARCHITECTURES),
        default=None,
        help="HF class: neox = GPTNeoXForCausalLM, llama = LlamaForCausalLM, mistral, qwen2, "
        "qwen3, mixtral, qwen3_moe, qwen2_moe, olmoe (default: the family the checkpoint was "
        "imported from, else neox)",
    )
    p.add_argument(
        "--max_shard_size",
        default=MAX_SHARD_SIZE,
        help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); bigger models are split into "
        "shards with model.safetensors.index.json (default: %(default)s, as transformers)",
    )
    p.add_argument(
        "--lora_format",
        choices=LORA_FORMATS,
        default="merged",
        help="for a LoRA run's checkpoint: merged = the adapters folded into the weights; peft "
        "= the base model in OUTPUT_DIR and a PEFT adapter (adapter_config.json, "
        "adapter_model.safetensors) in OUTPUT_DIR/adapter, for peft.PeftModel.from_pretrained",
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
    p.add_argument(
        "--verify",
        action="store_true",
        help="then load the output with transformers and check that its logits (fp32, within "
        "1e-4) and greedy tokens equal neox's on a sample text",
    )
    return p.parse_args(argv)


def check_tokenizer(args: argparse.Namespace) -> None:
    """--config_file's tokenizer must be the one the checkpoint trained with (the export would
    pair the weights with other token ids), unless that config sets allow_tokenizer_mismatch."""
    if not args.config_file:
        return  # the checkpoint's own config, so its own tokenizer
    from neox.checkpoint.compat import tokenizer_mismatch
    from neox.checkpoint.consolidate import resolve_checkpoint
    from neox.config import ConfigError, read_saved_config

    tag_dir = resolve_checkpoint(
        args.input_dir, args.iteration, allow_unverified=args.allow_unverified
    )
    if not (tag_dir / "config.yml").is_file():
        return
    try:
        cfg = read_saved_config(args.config_file)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    if problem := tokenizer_mismatch(read_saved_config(tag_dir), tag_dir, cfg):
        raise ExportError(f"--config_file {args.config_file}: {problem}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A refused checkpoint or config exits 2, as convert_from_hf.py's and deepy.py's refusals
    # do; a missing input is a mistyped path, not a refusal: 1, as the other checkpoint tools.
    status = 2 if Path(args.input_dir).exists() else 1
    with exit_on("convert_to_hf", CheckpointError, ExportError, OutputDirError, status=status):
        check_tokenizer(args)
        note = export_to_hf(
            args.input_dir,
            args.output_dir,
            iteration=args.iteration,
            config_file=args.config_file,
            precision=args.precision,
            architecture=args.architecture,
            overwrite=args.overwrite,
            trust=args.trust_checkpoint,
            max_shard_size=args.max_shard_size,
            lora_format=args.lora_format,
            allow_unverified=args.allow_unverified,
        )
    print(f"wrote {args.output_dir}")
    if note:
        print(f"note: {note}; only the model was written")
    if args.verify:
        from neox.hf.verify import VerifyError, verify_export

        with exit_on("convert_to_hf", VerifyError, what="verification failed"):
            agreement = verify_export(
                args.output_dir,
                args.input_dir,
                args.iteration,
                trust=args.trust_checkpoint,
                allow_unverified=args.allow_unverified,
            )
        print(agreement.describe())


if __name__ == "__main__":
    main()

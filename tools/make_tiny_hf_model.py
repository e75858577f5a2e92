"""Write a tiny, randomly initialised Hugging Face model with a chat tokenizer, for trying the
finetuning path (import, chat preprocessing, LoRA SFT, generate, export) without a download.

Example:
    python tools/make_tiny_hf_model.py hf/tiny-chat --family qwen2 \
        --write-chat configs/demo/chat.jsonl
    python tools/convert_from_hf.py --input_dir hf/tiny-chat --output_dir ckpt/tiny-chat
The directory holds config.json, model.safetensors and a transformers tokenizer (a byte-level
BPE trained here on the demo conversations, ChatML special tokens and a ChatML
`chat_template`), as `save_pretrained` writes them; `--write-chat` also writes those
conversations as chat jsonl (`{"messages": [{"role": ..., "content": ...}, ...]}` a line).
The weights are random: the model learns the conversations' pattern in a few dozen steps, it
knows nothing else.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from neox.cli import exit_on, tool_parser

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NUMBERS = "zero one two three four five six seven eight nine ten".split()
# A small transformer of each family: 2 layers, hidden 64, GQA where the family has it.
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox")


def conversations(n: int = 50, seed: int = 0) -> list[list[dict[str, str]]]:
    """n short arithmetic conversations (some with a system turn, some with two exchanges)."""
    rng = random.Random(seed)

    def exchange() -> list[dict[str, str]]:
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        q = rng.choice(["What is {} plus {}?", "Add {} and {}.", "{} plus {} is?"])
        return [
            {"role": "user", "content": q.format(NUMBERS[a], NUMBERS[b])},
            {
                "role": "assistant",
                "content": f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}.",
            },
        ]

    chats = []
    for i in range(n):
        chat = [{"role": "system", "content": "You add small numbers."}] if i % 3 == 0 else []
        chat += exchange() + (exchange() if i % 4 == 0 else [])
        chats.append(chat)
    return chats


def make_tokenizer(chats: list[list[dict[str, str]]], vocab_size: int):
    """A byte-level BPE trained on the conversations, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [t["role"] + "\n" + t["content"] for chat in chats for t in chat]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def make_model(family: str, vocab_size: int, eos_id: int, pad_id: int, seed: int):
    """A randomly initialised transformers causal LM of the family."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        SHAPE,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=pad_id,
        tie_word_embeddings=False,
    )
    if family == "gpt_neox":
        config = transformers.GPTNeoXConfig(**kw)
    else:
        names = {
            "llama": "LlamaConfig",
            "mistral": "MistralConfig",
            "qwen2": "Qwen2Config",
            "qwen3": "Qwen3Config",
        }
        head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # Qwen3's default is 128
        config = getattr(transformers, names[family])(
            **kw, num_key_value_heads=2, head_dim=head_dim
        )
    return transformers.AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__)
    p.add_argument("output_dir", help="directory to write the HF model and tokenizer into")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="model family (llama)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        help="BPE vocabulary size at most (512; the conversations give 336)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and conversations seed (0)")
    p.add_argument("--conversations", type=int, default=50, help="how many to make (50)")
    p.add_argument("--write-chat", metavar="JSONL", help="also write the conversations here")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty output_dir")
    args = p.parse_args(argv)

    with exit_on("make_tiny_hf_model", FileExistsError, ValueError):
        out = Path(args.output_dir)
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise FileExistsError(f"{out} is not empty; pass --overwrite to write into it")
        chats = conversations(args.conversations, args.seed)
        tokenizer = make_tokenizer(chats, args.vocab_size)
        model = make_model(
            args.family,
            len(tokenizer),
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            args.seed,
        )
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        n = sum(p.numel() for p in model.parameters())
        print(f"wrote a {n:,}-parameter random {args.family} model and its tokenizer to {out}")
        if args.write_chat:
            chat_file = Path(args.write_chat)
            chat_file.parent.mkdir(parents=True, exist_ok=True)
            lines = (json.dumps({"messages": chat}) for chat in chats)
            chat_file.write_text("".join(line + "\n" for line in lines))
            print(f"wrote {len(chats)} conversations to {chat_file}")


if __name__ == "__main__":
    main()

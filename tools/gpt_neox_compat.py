#!/usr/bin/env python
"""Dry-run every YAML config of a gpt-neox checkout through deepy.py and write the table.

python tools/gpt_neox_compat.py /path/to/gpt-neox [--output docs/compat_configs.md]

Each file runs as `deepy.py train.py <file> <overlay> --dry-run`, where the overlay points the
tokenizer files at local copies (NEOX_COMPAT_VOCAB_DIR, default /work/shared/data) and a hostfile
of this machine is not needed (gpt-neox's `/mock_path` runs locally). The result is `passes`,
`refused` with the feature named, or `fails` with deepy.py's message.
"""

import argparse
import ast
import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepy  # noqa: E402

UNKNOWN_KEY = re.compile(r"unknown config key '(\w+)'")


def neox_args_keys(gpt_neox: Path) -> set[str]:
    """Field names of gpt-neox's NeoXArgs dataclasses, read from its source."""
    keys = set()
    for path in (gpt_neox / "megatron" / "neox_arguments").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                keys |= {
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
    return keys


def overlay_for(config: Path, vocab_dir: Path) -> dict:
    """Local tokenizer files of the kind the config's tokenizer_type reads."""
    text = config.read_text()
    if "HFTokenizer" in text:
        return {"vocab_file": str(vocab_dir / "20B_tokenizer.json")}
    if "tokenizer_type" in text and "GPT2BPETokenizer" not in text:
        return {}
    return {
        "vocab_file": str(vocab_dir / "gpt2-vocab.json"),
        "merge_file": str(vocab_dir / "gpt2-merges.txt"),
    }


def dry_run(config: Path, overlay: dict, gpt_neox_keys: set[str]) -> tuple[str, str]:
    """(result, note) of one file's dry run."""
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(overlay, f)
    out, err = io.StringIO(), io.StringIO()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger().addHandler(handler)  # deepy's basicConfig then adds none of its own
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = deepy.main(["train.py", str(config), f.name, "--dry-run"])
    except SystemExit as e:  # argparse
        code = e.code
    finally:
        os.unlink(f.name)
        logging.getLogger().removeHandler(handler)
    if code == 0:
        return "passes", "; ".join(w.removeprefix("WARNING: ").split(":")[0] for w in warnings)
    message = err.getvalue().replace("deepy: config error:\n", "").strip()
    first = (message.splitlines() or [f"exit {code}"])[0].replace(f"{config}: ", "")
    if "not implemented" in first:
        return "refused", first
    unknown = UNKNOWN_KEY.search(first)
    if unknown and gpt_neox_keys and unknown.group(1) not in gpt_neox_keys:
        return "refused", f"{first}; not a NeoXArgs key either, so gpt-neox refuses the file too"
    return "fails", first


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("gpt_neox", type=Path, help="a gpt-neox checkout (its configs/ is read)")
    p.add_argument("--output", type=Path, help="write the markdown table here (default: stdout)")
    p.add_argument("--label", help="what the checkout is, for the table's first line")
    args = p.parse_args(argv)
    vocab_dir = Path(os.environ.get("NEOX_COMPAT_VOCAB_DIR", "/work/shared/data"))
    gpt_neox_keys = neox_args_keys(args.gpt_neox)
    logging.disable(logging.INFO)
    os.chdir(ROOT)  # deepy.py checks the entry script relative to the repository root
    configs = sorted((args.gpt_neox / "configs").rglob("*.yml"))
    git = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=args.gpt_neox, capture_output=True, text=True
    )
    label = args.label or (git.stdout.strip() if git.returncode == 0 else "(unknown commit)")
    rows = []
    for config in configs:
        result, note = dry_run(config, overlay_for(config, vocab_dir), gpt_neox_keys)
        name = config.relative_to(args.gpt_neox).as_posix()
        rows.append(f"| `{name}` | {result} | {note.replace('|', '/')} |")
    counts = {r: sum(f"| {r} |" in row for row in rows) for r in ("passes", "refused", "fails")}
    table = "\n".join(
        [
            f"{len(rows)} files from gpt-neox {label}: "
            + ", ".join(f"{n} {r}" for r, n in counts.items()),
            "",
            "| file | result | note |",
            "| --- | --- | --- |",
            *rows,
        ]
    )
    if args.output:
        args.output.write_text(table + "\n")
    else:
        print(table)
    return 1 if counts["fails"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

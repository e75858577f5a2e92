"""Plot runs' loss, validation loss, learning rate and throughput against tokens seen, overlaid.

Example:
    python tools/plot_metrics.py logs/tiny logs/tiny-wide --out compare.png
Each argument is a run's log_dir (holding metrics.jsonl). Needs matplotlib (pip install neox[plot]).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neox.training.metrics import read_metrics

PANELS = (
    ("train", "loss", "training loss"),
    ("valid", "loss", "validation loss"),
    ("train", "lr", "learning rate"),
    ("train", "tokens_per_s", "tokens/s (all ranks)"),
)


def series(records: list[dict], split: str, key: str) -> tuple[list[float], list[float]]:
    """(tokens seen, value) for one metric; validation steps map to tokens via training steps."""
    train = [r for r in records if r["split"] == "train" and "consumed_tokens" in r]
    tokens_per_step = train[0]["consumed_tokens"] / train[0]["step"] if train else 1.0
    points = sorted(
        (r["step"] * tokens_per_step, r[key]) for r in records if r["split"] == split and key in r
    )
    return [p[0] for p in points], [p[1] for p in points]


def plot(run_dirs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        for ax, (split, key, title) in zip(axes.flat, PANELS):
            x, y = series(records, split, key)
            if x:
                ax.plot(x, y, marker="." if len(x) < 30 else None, label=str(run_dir))
            ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("tokens")
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="log_dir of each run")
    p.add_argument("--out", type=Path, default=Path("metrics.png"), help="PNG to write")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "plot_metrics: matplotlib is not installed: pip install 'neox[plot]'", file=sys.stderr
        )
        return 2
    try:
        plot(args.runs, args.out)
    except FileNotFoundError as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

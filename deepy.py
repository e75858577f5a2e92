#!/usr/bin/env python
"""Merge config files, validate them, and launch a neox script on every rank through DeepSpeed.

python deepy.py train.py configs/tiny.yml [more.yml ...] [-d CONF_DIR] [--dry-run]
"""

import argparse
import json
import logging
import sys

import yaml

from neox.config import ConfigError, build_ds_config, derive, encode, load_config
from neox.config.preflight import (
    check_data,
    check_eval,
    check_generation,
    check_tokenizer_files,
    describe_resume,
    tokenizer_vocab_size,
)
from neox.estimate_report import estimate_report, estimate_vocab, fit_warning
from neox.launcher import HostfileError, build_launch, run_launch

# Entry scripts that read training data, and those that read a trained checkpoint (with the
# check of what each one reads).
NEEDS_DATA = {"train.py"}
NEEDS_CHECKPOINT = {"generate.py": check_generation, "eval.py": check_eval}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("script", help="per-rank entry script: train.py, generate.py or eval.py")
    p.add_argument("configs", nargs="+", help="YAML/JSON config files, later ones override earlier")
    p.add_argument("-d", "--conf_dir", help="directory prefixed to every config name")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the merged config, DeepSpeed config and launch command; launch "
        "nothing (files missing on this machine are warnings here, errors in a real launch)",
    )
    return p.parse_args(argv)


def plan_smallest_layout(cfg, plan, script: str):
    """A dry run on a machine too small for the layout plans the smallest one that fits."""
    tp, pp = cfg.parallel.model_parallel_size, cfg.parallel.pp
    launcher = cfg.launcher
    if plan.world_size >= tp * pp or launcher.hostfile or launcher.num_gpus is not None:
        return plan
    print(
        f"dry run: this machine gives {plan.world_size} rank(s); planning the smallest layout, "
        f"{tp * pp} ranks on one node (set num_gpus or a hostfile to plan another)"
    )
    wider = launcher.model_copy(update={"num_gpus": tp * pp})
    return build_launch(wider, script, plan.argv[plan.argv.index(script) + 1 :])


def local_gpu_bytes() -> int | None:
    """Memory of this machine's first GPU (torch is imported only on GPU launches)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def warn_if_too_big(cfg, derived) -> None:
    """Warn, before a GPU launch, when the memory estimate exceeds the GPUs this machine has."""
    gpu_bytes = local_gpu_bytes()
    if gpu_bytes is None:
        return
    warning = fit_warning(cfg, derived, estimate_vocab(cfg, derived)[0], gpu_bytes)
    if warning:
        print(f"deepy: warning: {warning}", file=sys.stderr)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="deepy: %(message)s")
    args = parse_args(argv)
    try:
        loaded = load_config(args.configs, args.conf_dir)
        cfg = loaded.config
        for override in loaded.overrides:
            print(f"override  {override}")
        plan = build_launch(cfg.launcher, args.script, ["--neox_config", encode(cfg)])
        if args.dry_run:
            plan = plan_smallest_layout(cfg, plan, args.script)
        problems = []
        checks = [check_tokenizer_files, tokenizer_vocab_size]
        script = args.script.rsplit("/", 1)[-1]
        if script in NEEDS_DATA:
            checks.insert(1, check_data)
        if script in NEEDS_CHECKPOINT:
            checks.insert(1, NEEDS_CHECKPOINT[script])
        vocab_size = None
        for check in checks:
            try:
                vocab_size = check(loaded) or vocab_size
            except ConfigError as e:
                problems.append(str(e))
                if check is check_tokenizer_files:
                    checks.remove(tokenizer_vocab_size)
        if problems and not args.dry_run:
            raise ConfigError("\n".join(problems))
        if problems:
            # A dry run may plan for another machine: files missing here are reported, not fatal.
            print("warning (a real launch would stop here):", *problems, sep="\n", file=sys.stderr)
        derived = derive(cfg, plan.world_size, vocab_size)
    except (ConfigError, HostfileError) as e:
        print(f"deepy: config error:\n{e}", file=sys.stderr)
        return 2
    if script not in NEEDS_CHECKPOINT:
        print(describe_resume(loaded))
    if args.dry_run:
        print("# merged config")
        print(yaml.safe_dump(cfg.to_flat(), sort_keys=False), end="")
        print("# derived")
        print(yaml.safe_dump(derived.as_dict(), sort_keys=False), end="")
        print("# estimate (python tools/estimate.py for options)")
        vocab, source = estimate_vocab(cfg, derived)
        if source != "tokenizer":
            print(f"vocabulary: {source}, padded to {vocab}")
        print(estimate_report(cfg, derived, vocab))
        print("# deepspeed config")
        print(json.dumps(build_ds_config(cfg, derived), indent=2))
        print("# launch command")
        print(plan.command)
        return 0
    if not plan.cpu:
        warn_if_too_big(cfg, derived)
    return run_launch(plan)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

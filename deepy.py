#!/usr/bin/env python
"""Merge config files, validate them, and launch a neox script on every rank through DeepSpeed.

python deepy.py train.py configs/tiny.yml [more.yml ...] [-d CONF_DIR] [--dry-run]
"""

import argparse
import json
import logging
import sys

import yaml

from neox.checkpoint.compat import check_resume, describe_stop
from neox.config import ConfigError, build_ds_config, derive, encode, load_config
from neox.config.preflight import check_data, check_tokenizer_files, tokenizer_vocab_size
from neox.launcher import HostfileError, build_launch, launch

# Entry scripts that read training data, and those that need a tokenizer.
NEEDS_DATA = {"train.py"}


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
        if args.script.rsplit("/", 1)[-1] in NEEDS_DATA:
            checks.insert(1, check_data)
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
        resume = check_resume(cfg, derived)
    except (ConfigError, HostfileError) as e:
        print(f"deepy: config error:\n{e}", file=sys.stderr)
        return 2
    print(resume)
    if args.dry_run:
        print("# merged config")
        print(yaml.safe_dump(cfg.to_flat(), sort_keys=False), end="")
        print("# derived")
        print(yaml.safe_dump(derived.as_dict(), sort_keys=False), end="")
        print("# deepspeed config")
        print(json.dumps(build_ds_config(cfg, derived), indent=2))
        print("# launch command")
        print(plan.command)
        return 0
    result = launch(plan)
    if result.signal is not None:
        print(f"deepy: {describe_stop(cfg, result)}")
    return result.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python
"""Merge config files, validate them, and launch a neox script on every rank (an agent per node).

python deepy.py train.py configs/tiny.yml [more.yml ...] [-d CONF_DIR] [-H HOSTFILE] [--dry-run]
"""

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

import yaml

from neox.checkpoint.compat import check_resume, describe_stop, latest_state
from neox.config import ConfigError, build_ds_config, derive, encode, load_config
from neox.launcher import LaunchError, build_launch
from neox.launcher.port import check_master_port
from neox.launcher.reach import check_nodes_reachable
from neox.launcher.restart import launch_with_restarts, restart_problem
from neox.plan.attention_path import describe_attention_paths
from neox.plan.memory import GiB
from neox.plan.preflight import (
    NEEDS_CHECKPOINT,
    NEEDS_DATA,
    adopt_checkpoint_tokenizer,
    check_save_dir,
    deepspeed_section_problems,
    derived_problems,
    git_hash,
    preflight,
)
from neox.plan.report import (
    GPUS,
    estimate_report,
    estimate_vocab,
    fit_refusal,
    fit_warning,
    host_refusal,
    recompute_note,
)

# gpt-neox's deepy.py flags that set a config key (flag -> key).
KEY_FLAGS = {
    "hostfile": "hostfile",
    "wandb_group": "wandb_group",
    "wandb_team": "wandb_team",
    "wandb_run_name": "wandb_run_name",
    "eval_tasks": "eval_tasks",
    "eval_results_prefix": "eval_results_prefix",
    "sample_input_file": "sample_input_file",
    "sample_output_file": "sample_output_file",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("script", help="per-rank entry script: train.py, generate.py or eval.py")
    p.add_argument(
        "configs", nargs="+", help="YAML/JSON config files (`name` means name.yml), later win"
    )
    p.add_argument("-d", "--conf_dir", help="directory prefixed to every config name")
    p.add_argument("-H", "--hostfile", help="hostfile (overrides the config's `hostfile`)")
    p.add_argument("--wandb_group", help="Weights & Biases group")
    p.add_argument("--wandb_team", help="Weights & Biases team")
    p.add_argument("--wandb_run_name", help="Weights & Biases run name")
    p.add_argument("--eval_tasks", nargs="+", help="tasks for eval.py")
    p.add_argument("--eval_results_prefix", help="prefix of eval.py's results file")
    p.add_argument("-i", "--sample_input_file", help="prompts for generate.py")
    p.add_argument("-o", "--sample_output_file", help="where generate.py writes samples")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print everything: the launch command, every rank's lines, library notes "
        "(sets log_level: debug)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the merged config, DeepSpeed config and launch command; launch "
        "nothing (files missing on this machine are warnings here, errors in a real launch)",
    )
    return p.parse_args(argv)


def flag_overrides(args: argparse.Namespace) -> dict:
    """Config keys set on the command line."""
    keys = {key: getattr(args, flag) for flag, key in KEY_FLAGS.items() if getattr(args, flag)}
    if args.verbose:
        keys["log_level"] = "debug"
    return keys


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
    return build_launch(wider, script, plan.script_args[1:])


def local_gpu_bytes() -> int | None:
    """Memory of this machine's first GPU (torch is imported only on GPU launches)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def memory_problem(cfg, derived, plan, dry_run: bool) -> str | None:
    """The estimate against what each rank has: host memory shared by the CPU ranks of a node,
    else this machine's GPU (a real launch), else the largest GPU neox knows."""
    vocab = estimate_vocab(cfg, derived)[0]
    if plan.cpu:
        per_node = max(len(slots) for slots in plan.hosts.values())
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return fit_refusal(
            cfg,
            derived,
            vocab,
            host // per_node,
            f"of host memory each of {per_node} CPU rank(s) has",
        )
    if not dry_run and (gpu_bytes := local_gpu_bytes()) is not None:
        return fit_refusal(cfg, derived, vocab, gpu_bytes, "this machine's GPU has")
    name, largest = max(GPUS.items(), key=lambda kv: kv[1]["memory_gib"])
    return fit_refusal(
        cfg, derived, vocab, int(largest["memory_gib"] * GiB), f"the largest GPU ({name}) has"
    )


def available_host_bytes() -> int | None:
    """MemAvailable of this machine (/proc/meminfo), None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_problem(cfg, derived, plan) -> str | None:
    """ZeRO-Offload's host memory against this machine's, for a launch on this machine only."""
    local = {"localhost", "127.0.0.1", socket.gethostname()}
    if plan.cpu or not set(plan.hosts) <= local or (host := available_host_bytes()) is None:
        return None
    ranks = max(len(slots) for slots in plan.hosts.values())
    vocab = estimate_vocab(cfg, derived)[0]
    return host_refusal(cfg, derived, vocab, ranks, host, "this machine has available")


def memory_notes(cfg, derived) -> None:
    """Before a GPU launch: warn when the memory estimate exceeds this machine's GPUs, or note
    that activation checkpointing is on where the run fits without it."""
    gpu_bytes = local_gpu_bytes()
    if gpu_bytes is None:
        return
    vocab = estimate_vocab(cfg, derived)[0]
    if warning := fit_warning(cfg, derived, vocab, gpu_bytes):
        print(f"deepy: warning: {warning}", file=sys.stderr)
    elif note := recompute_note(cfg, derived, vocab, gpu_bytes):
        print(f"deepy: note: {note}", file=sys.stderr)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="deepy: %(message)s")
    args = parse_args(argv)
    try:
        loaded = load_config(args.configs, args.conf_dir, flag_overrides(args))
        if loaded.config.logging.git_hash is None and (commit := git_hash()):
            loaded.config.logging.git_hash = commit
        cfg = loaded.config
        if cfg.logging.log_level == "debug":
            logging.getLogger("neox").setLevel(logging.DEBUG)
        for override in loaded.overrides:
            print(f"override  {override}")
        if Path(args.script).name in NEEDS_CHECKPOINT and (
            note := adopt_checkpoint_tokenizer(loaded)
        ):
            print(note)
        plan = build_launch(cfg.launcher, args.script, ["--neox_config", encode(cfg)])
        if args.dry_run:
            plan = plan_smallest_layout(cfg, plan, args.script)
        vocab_size, problems = preflight(loaded, args.script)
        try:
            derived = derive(cfg, plan.world_size, vocab_size)
            ds_config = build_ds_config(cfg, derived)
        except ConfigError as e:
            raise loaded.explain(e) from None
        problems += derived_problems(loaded, derived, args.script, cpu_ranks=plan.cpu)
        problems += deepspeed_section_problems(loaded, ds_config)
        if problem := restart_problem(cfg, args.script):
            problems.append(problem)
        try:
            attention = describe_attention_paths(
                cfg.model,
                cpu_ranks=plan.cpu,
                packed=cfg.data.reset_attention_mask,
                tp=derived.tensor_parallel,
                cp=derived.context_parallel,
                chunks=cfg.parallel.context_parallel_chunks,
            )
        except ValueError as e:  # e.g. `local` layers without a window: the model would refuse
            problems.append(str(e))
            attention = []
        # Training compares the checkpoint it resumes with this config before launching.
        resume = None
        if Path(args.script).name not in NEEDS_CHECKPOINT:
            try:
                resume = check_resume(cfg, derived)
            except ConfigError as e:
                problems.append(str(e))
        if Path(args.script).name in NEEDS_DATA and (
            problem := memory_problem(cfg, derived, plan, args.dry_run)
        ):
            problems.append(problem)
        if Path(args.script).name in NEEDS_DATA and (
            problem := host_memory_problem(cfg, derived, plan)
        ):
            problems.append(problem)
        if problems and not args.dry_run:
            raise ConfigError("\n".join(problems))
        if problems:
            # A dry run may plan for another machine: files missing here are reported, not fatal.
            print("warning (a real launch would stop here):", *problems, sep="\n", file=sys.stderr)
        if not args.dry_run:
            check_master_port(plan)
            check_nodes_reachable(plan)
            check_save_dir(loaded, derived, create=True)
    except (ConfigError, LaunchError) as e:
        print(f"deepy: config error:\n{e}", file=sys.stderr)
        return 2
    if resume:
        print(resume)
    if args.dry_run:
        print("# merged config")
        print(yaml.safe_dump(cfg.to_flat(), sort_keys=False), end="")
        print("# derived")
        print(yaml.safe_dump(derived.as_dict(), sort_keys=False), end="")
        print("# attention per layer type (kernel on GPU ranks, why)")
        print(*attention, sep="\n")
        print("# estimate (python tools/estimate.py for options)")
        vocab, source = estimate_vocab(cfg, derived)
        if source != "tokenizer":
            print(f"vocabulary: {source}, padded to {vocab}")
        print(estimate_report(cfg, derived, vocab))
        print("# deepspeed config")
        print(json.dumps(ds_config, indent=2))
        print("# launch command")
        print(plan.command)
        return 0
    if not plan.cpu:
        memory_notes(cfg, derived)
    written = Path(args.script).name == "train.py" and cfg.logging.log_dir
    # What `latest` was when a stop signal came: only a save completed after it is claimed.
    at_stop: list = []

    def relaunch_plan(relaunch, environ):
        """The same command, its own launch id and environment, to nodes that still answer."""
        again = build_launch(
            relaunch.launcher, args.script, ["--neox_config", encode(relaunch)], environ=environ
        )
        check_nodes_reachable(again)
        return again

    result = launch_with_restarts(
        cfg,
        args.script,
        relaunch_plan,
        plan,
        f"{cfg.logging.log_dir}/config.yml" if written else None,
        on_stop=lambda: at_stop.append(latest_state(cfg.checkpoint.save)),
    )
    if result.signal is not None:
        print(f"deepy: {describe_stop(cfg, result, at_stop[0] if at_stop else None)}")
    return result.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

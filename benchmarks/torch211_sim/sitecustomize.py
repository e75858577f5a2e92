"""Diagnosis aid, not a benchmark: with this folder on PYTHONPATH and SIM211=1, a CPU torch 2.13
traces autograd.Function forwards as torch 2.11 does, so the TP=2 + torch_compile divergence
measured on GPUs (torch 2.11.0+cu130) reproduces on CPU ranks.

torch 2.11's dynamo makes every intermediate of an autograd.Function forward an extra subgraph
output, aliases included (pytorch issue 180642): when the forward returns a tensor written in
place, the gradient goes to the alias's slot and the real output's gradient is lost. torch 2.12
added `filter_aliased_intermediates=True` there (pytorch PR 180921) and collects intermediates
only after a side effect; this loader takes both back out of
torch/_dynamo/variables/higher_order_ops.py as it is imported. Example (the repository root):

    SIM211=1 PYTHONPATH=benchmarks/torch211_sim:$PWD python -m pytest \
        tests/training/test_speed_options.py -k tensor_and_pipeline

tests/training/test_torch211_tracing.py runs the ZeRO-3 and TP/PP loss tests this way in CI.
The whole suite under it (2026-11-26): one failure, tests/parallel/test_tp_layers.py's check of
a bare compiled functional all-reduce, whose wait_tensor returns an alias the simulation keeps.
The real torch 2.11 fails it too where dynamo's graph runs without AOTAutograd (the device's
CPU ranks, 2026-11-29): neox/parallel/mappings.py's `fresh` copies such results since, and the
check runs under the simulation in CI.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

NAME = "torch._dynamo.variables.higher_order_ops"
EDITS = {
    # Collect intermediates whenever side effects are allowed (autograd.Function: always).
    "if (allow_side_effects or traced_externally) and has_side_effects:": (
        "if allow_side_effects or traced_externally:"
    ),
    # The autograd.Function forward's speculate_subgraph call: no alias filtering.
    "filter_aliased_intermediates=True,\n                tracer=fwd_tracer,": (
        "filter_aliased_intermediates=False,\n                tracer=fwd_tracer,"
    ),
}


class _Loader(importlib.machinery.SourceFileLoader):
    def get_data(self, path: str) -> bytes:
        src = super().get_data(path).decode()
        for old, new in EDITS.items():
            if src.count(old) != 1:
                raise RuntimeError(f"SIM211: this torch's {NAME} lacks {old!r}; update EDITS")
            src = src.replace(old, new)
        print("SIM211: autograd.Function forwards traced as in torch 2.11", file=sys.stderr)
        if mark := os.environ.get("SIM211_MARK"):  # a file every process that edits appends to
            with open(mark, "a") as f:
                f.write(f"{os.getpid()}\n")
        return src.encode()

    def path_stats(self, path: str) -> dict:
        raise OSError  # no cached bytecode: always the edited source


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name.rsplit(".", 1)[1], path)
        loader = _Loader(name, spec.origin)
        return importlib.util.spec_from_file_location(name, spec.origin, loader=loader)


if os.environ.get("SIM211"):
    sys.meta_path.insert(0, _Finder())

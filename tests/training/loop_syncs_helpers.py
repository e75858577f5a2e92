"""Trains one config through neox's loop on a GPU and prints, as JSON, the host-device syncs
the loop caused (by file:line), the engine and the last loss. Run by test_loop_gpu.py."""

import json
import sys
import warnings
from collections import Counter

import torch

from neox.config import load_config
from neox.training.loop import train
from neox.training.metrics import MetricsWriter
from neox.training.setup import build_run

run = build_run(load_config([sys.argv[1]]).config)
sites: Counter = Counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        last = train(run, 0, MetricsWriter(None, None, enabled=False))
    finally:
        torch.cuda.set_sync_debug_mode(0)
for w in caught:
    if "synchroniz" in str(w.message):
        sites[f"{w.filename}:{w.lineno}"] += 1
print(json.dumps({"engine": type(run.engine).__name__, "sites": sites, "loss": last["loss"]}))

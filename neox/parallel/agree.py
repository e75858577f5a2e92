"""One small integer agreed on by every rank: for decisions all ranks must take together."""

import functools
import logging

import torch

log = logging.getLogger(__name__)


def all_ranks_max(value: int) -> int:
    """The largest `value` over all ranks (the value itself without torch.distributed).

    Reduced over a CPU (gloo) group, so asking once a step never waits for the GPU: an NCCL
    reduction would need a device tensor, and reading it back would drain the device's queue.
    """
    if not torch.distributed.is_initialized():
        return value
    group, device = _host_group(torch.distributed.group.WORLD)
    flag = torch.tensor([float(value)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(flag.item())


@functools.cache
def _host_group(world: object) -> tuple:
    """(group, device) for the reduction: the default group where it reduces CPU tensors, else
    a gloo group over every rank, made once per `world` (a collective: every rank gets here
    together; keyed by the default group, so a re-initialised one gets a new group)."""
    if torch.distributed.get_backend() != "nccl":
        return None, torch.device("cpu")
    try:
        return torch.distributed.new_group(backend="gloo"), torch.device("cpu")
    except (RuntimeError, ValueError) as err:  # a torch built without gloo
        log.warning("no gloo group (%s): agreeing through NCCL, one device sync a step", err)
        return None, torch.device("cuda", torch.cuda.current_device())

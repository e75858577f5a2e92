"""One small integer agreed on by every rank: for decisions all ranks must take together."""

import torch


def all_ranks_max(value: int) -> int:
    """The largest `value` over all ranks (the value itself without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return value
    # On the rank's own device: NCCL reduces only GPU tensors.
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([float(value)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())

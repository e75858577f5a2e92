"""Preference training (train_impl dpo, kto, rm): a different loss over a different batch.

An `Objective` is chosen once at setup (`build_objective`) and handed to the engine as its loss
function, so neither the loop nor the engines ask which train_impl runs. It turns a collated
sample of neox.data.pairs into a `PreferenceBatch`, computes the loss from the engine's forward
(full logits, or the reward head's values), and keeps the metrics users watch (chosen/rejected
rewards, reward accuracy and margin), summed on the device until the loop takes them.

The reference model of DPO and KTO is a frozen copy of the weights the run starts from (after
`load`/`finetune`): no gradients, no optimizer state, in the training dtype (bf16 under bf16),
so it costs one more copy of the weights, not of the optimizer. A resumed run reads the copy it
saved in its checkpoint (client state "preference_reference"), never the resumed weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from neox.data.batch import Batch

log = logging.getLogger(__name__)

REFERENCE_KEY = "preference_reference"


@dataclass
class PreferenceBatch(Batch):
    """A Batch whose rows are whole documents. For DPO/RM the first half of the rows are the
    chosen answers and the second half the rejected ones, pair i in rows i and B + i."""

    rewards: Optional[torch.Tensor] = None
    """KTO: each row's reward (B,); > 0 desirable, < 0 undesirable."""
    paired: bool = False
    """Rows are chosen answers then rejected ones (DPO, RM)."""

    @property
    def trained_tokens(self) -> torch.Tensor:
        """The units the loss averages over, as the engines weigh micro-batches by them: pairs
        (DPO, RM) or answers (KTO), so a step's loss is the mean over the global batch's."""
        rows = self.tokens.shape[0] // (2 if self.paired else 1)
        return torch.tensor(float(rows), dtype=torch.float64, device=self.tokens.device)


def documents_batch(tokens: torch.Tensor, labels: torch.Tensor) -> PreferenceBatch:
    """Inputs, next-token targets and loss mask from windows (N, T + 1) of tokens and labels
    (-100 where masked); as gpt-neox's _get_batch: the target is the label, trained where >= 0."""
    tokens, labels = tokens.long(), labels.long()
    target = labels[:, 1:]
    mask = (target >= 0).float()
    N, T = target.shape
    positions = torch.arange(T, device=tokens.device).expand(N, T).contiguous()
    return PreferenceBatch(
        tokens=tokens[:, :-1].contiguous(),
        labels=target.clamp(min=0).contiguous(),
        loss_mask=mask,
        position_ids=positions,
    )


def token_logps(
    logits: torch.Tensor, labels: torch.Tensor, fp32: bool, group: Any = None
) -> torch.Tensor:
    """log p(label) per token (N, T) from logits (N, T, V), or this rank's vocab shard of them
    when `group` is the tensor-parallel group (computed in float32 there, always)."""
    if group is not None:
        from neox.parallel.layers import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits, labels, group)
    z = logits.float() if fp32 else logits
    ce = F.cross_entropy(z.flatten(0, 1), labels.flatten(), reduction="none")
    return -ce.view_as(labels)


class Metrics:
    """Running sums of named values on the device; `take` returns their means and resets."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, name: str, values: torch.Tensor, where: Optional[torch.Tensor] = None) -> None:
        values = values.detach().float().flatten()
        weight = torch.ones_like(values) if where is None else where.detach().float().flatten()
        s, c = (values * weight).sum(), weight.sum()
        if name in self.sums:
            self.sums[name] += s
            self.counts[name] += c
        else:
            self.sums[name], self.counts[name] = s, c

    def take(self) -> dict[str, torch.Tensor]:
        out = {k: self.sums[k] / self.counts[k].clamp(min=1.0) for k in self.sums}
        self.sums, self.counts = {}, {}
        return out


class Reference:
    """A frozen copy of the policy's starting weights (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module.requires_grad_(False).eval()

    def start(self, policy: nn.Module, state: Optional[dict[str, Any]]) -> None:
        saved = (state or {}).get(REFERENCE_KEY)
        dtype = next(policy.parameters()).dtype
        self.module.to(dtype)
        with torch.no_grad():
            weights = saved if saved is not None else policy.state_dict()
            self.module.load_state_dict(weights, strict=True)
        self.module.requires_grad_(False).eval()

    def state(self) -> dict[str, Any]:
        return {REFERENCE_KEY: self.module.state_dict()}

    @torch.no_grad()
    def __call__(self, batch: Batch) -> torch.Tensor:
        return self.module(batch.tokens, batch.position_ids, batch.attention_mask)


class Objective:
    """One train_impl's batch and loss; the engine calls it as loss_fn(model, batch)."""

    metric_names: tuple[str, ...] = ()

    def __init__(self, cfg: Any, tp_group: Any = None, reference: Optional[Reference] = None):
        self.cfg = cfg.preference
        self.tp_group = tp_group
        self.reference = reference
        self.metrics = Metrics()

    # -- what the loop and setup call ---------------------------------------------------------

    def batch(self, sample: dict[str, torch.Tensor], device: torch.device) -> PreferenceBatch:
        raise NotImplementedError

    def __call__(self, model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
        """The micro-batch's loss, times the weight the engine gave it (forward_loss's rule)."""
        loss = self.loss(model, batch)
        return loss if batch.loss_weight is None else loss * batch.loss_weight

    def loss(self, model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
        """The mean loss over the micro-batch's pairs or answers."""
        raise NotImplementedError

    def start(self, policy: nn.Module, state: Optional[dict[str, Any]]) -> None:
        """Before the first step, after the checkpoint is loaded: fix the reference weights."""
        if self.reference is not None:
            self.reference.start(policy, state)

    def checkpoint_state(self) -> dict[str, Any]:
        return self.reference.state() if self.reference is not None else {}

    def take_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.take()

    # -- shared pieces ------------------------------------------------------------------------

    def sequence_logps(self, logits: torch.Tensor, batch: Batch, fp32: bool) -> torch.Tensor:
        """Sum of log p over each row's trained tokens (N,)."""
        logp = token_logps(logits, batch.labels, fp32, self.tp_group)
        return (logp * batch.loss_mask.to(logp.dtype)).sum(-1)


class DPO(Objective):
    """Direct Preference Optimization: -logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))
    with pi, ref the summed log-probabilities of each answer's trained tokens."""

    def batch(self, sample: dict[str, torch.Tensor], device: torch.device) -> PreferenceBatch:
        return paired_batch(sample, device)

    def loss(self, model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
        p = self.cfg
        fp32 = p.dpo_fp32
        if self.reference is None:  # dpo_reference_free
            ref = torch.zeros(batch.tokens.shape[0], device=batch.tokens.device)
        else:
            ref = self.sequence_logps(self.reference(batch), batch, fp32)
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        pi = self.sequence_logps(logits, batch, fp32)
        pi_c, pi_r = pi.chunk(2)
        ref_c, ref_r = ref.to(pi.dtype).chunk(2)
        margin = (pi_c - pi_r) - (ref_c - ref_r)
        loss = -F.logsigmoid(p.dpo_beta * margin).mean()
        chosen, rejected = p.dpo_beta * (pi_c - ref_c), p.dpo_beta * (pi_r - ref_r)
        record_pairs(self.metrics, chosen, rejected)
        self.metrics.add("chosen_logps", pi_c)
        self.metrics.add("rejected_logps", pi_r)
        return loss


class KTO(Objective):
    """KTO as gpt-neox computes it: each half of the micro-batch is the other's KL baseline
    z = max(0, mean(pi - ref)) (no gradient), and a sample of reward r (sign: desirable or not)
    costs w * (1 - sigmoid(beta * r * (log(pi/ref) - z))), w the kto_*_weight of its kind; the
    loss is half the batch mean of that (gpt-neox's 0.5 per half)."""

    def batch(self, sample: dict[str, torch.Tensor], device: torch.device) -> PreferenceBatch:
        b = documents_batch(sample["text"].to(device), sample["text_label"].to(device))
        b.rewards = sample["reward"].to(device).float()
        return b

    def loss(self, model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
        p = self.cfg
        ref = self.sequence_logps(self.reference(batch), batch, p.kto_fp32)
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        pi = self.sequence_logps(logits, batch, p.kto_fp32)
        ratio = pi - ref.to(pi.dtype)  # (B,)
        r = batch.rewards.to(pi.dtype)
        first, second = ratio.chunk(2)
        with torch.no_grad():
            kl_first = first.mean().clamp(min=0)
            kl_second = second.mean().clamp(min=0)
        baseline = torch.cat([kl_second.expand(first.shape[0]), kl_first.expand(second.shape[0])])
        weight = (r > 1e-3).to(pi.dtype) * p.kto_desirable_weight
        weight = weight + (r < -1e-3).to(pi.dtype) * p.kto_undesirable_weight
        loss = 0.5 * (weight * (1 - torch.sigmoid(p.kto_beta * r * (ratio - baseline)))).mean()
        with torch.no_grad():
            rewards = p.kto_beta * ratio
            desirable, undesirable = r > 1e-3, r < -1e-3
            m = self.metrics
            m.add("kl", torch.stack([kl_first, kl_second]))
            m.add("reward_acc", (r * rewards > 0).float(), desirable | undesirable)
            m.add("chosen_rewards", rewards, desirable)
            m.add("rejected_rewards", rewards, undesirable)
        return loss

    def take_metrics(self) -> dict[str, torch.Tensor]:
        out = self.metrics.take()
        if "chosen_rewards" in out:
            out["margins"] = out["chosen_rewards"] - out["rejected_rewards"]
        return out


class RewardModel(Objective):
    """A scalar reward per sequence, read at its last trained token (the EOS that
    `--for-rm` labels); loss -logsigmoid(r_chosen - r_rejected) over the pairs."""

    def batch(self, sample: dict[str, torch.Tensor], device: torch.device) -> PreferenceBatch:
        return paired_batch(sample, device)

    def loss(self, model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
        values = model(batch.tokens, batch.position_ids, batch.attention_mask)  # (N, T, 1)
        values = values.float().squeeze(-1)
        T = values.shape[1]
        order = torch.arange(1, T + 1, device=values.device)
        last = (batch.loss_mask * order).argmax(-1)  # the last trained position of each row
        reward = values.gather(1, last.unsqueeze(1)).squeeze(1)
        chosen, rejected = reward.chunk(2)
        loss = -F.logsigmoid(chosen - rejected).mean()
        record_pairs(self.metrics, chosen, rejected)
        return loss

    def start(self, policy: nn.Module, state: Optional[dict[str, Any]]) -> None:
        pass


def record_pairs(m: Metrics, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    m.add("chosen_rewards", chosen)
    m.add("rejected_rewards", rejected)
    m.add("reward_acc", (chosen > rejected).float())
    m.add("margins", chosen - rejected)


def paired_batch(sample: dict[str, torch.Tensor], device: torch.device) -> PreferenceBatch:
    """Chosen rows then rejected rows, one pair per row index."""
    tokens = torch.cat([sample["chosen"], sample["rejected"]]).to(device, non_blocking=True)
    labels = torch.cat([sample["chosen_label"], sample["rejected_label"]]).to(device)
    batch = documents_batch(tokens, labels)
    batch.paired = True
    return batch


# -- the reward head ----------------------------------------------------------------------------


def attach_reward_head(model: nn.Module, seed: int, tp_group: Any = None) -> nn.Module:
    """Replace `model`'s output layer by a scalar head (hidden -> 1), as gpt-neox's
    train_impl: rm does: the model then returns (B, T, 1) values instead of logits.

    Under tensor parallelism the head is replicated; the final norm's output already carries
    the all-reduce that sums its gradient over the tp ranks (apply_tensor_parallel), made for a
    vocab-split head. Each rank passes 1/tp of its (equal) gradient on, so the sum is one
    rank's; every rank still takes part in that all-reduce."""
    from neox.model.gpt import GPTNeoX

    if not isinstance(model, GPTNeoX):
        raise TypeError(f"train_impl: rm needs the plain GPTNeoX model, got {type(model)}")
    hidden = model.cfg.hidden_size
    w = model.head_weight()
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(hidden, 1, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=g) / math.sqrt(hidden))
    model.embed_out = head
    tp = 1 if tp_group is None else torch.distributed.get_world_size(group=tp_group)

    def reward_head(x: torch.Tensor) -> torch.Tensor:
        h = model.final_layer_norm(x)
        if tp > 1:
            h = h.detach() + (h - h.detach()) / tp  # the same values; 1/tp of the gradient
        return F.linear(h, model.embed_out.weight)

    model.head = reward_head
    model.register_load_state_dict_pre_hook(_keep_fresh_reward_head)
    from neox.parallel.build import _register_head_weight

    _register_head_weight(model)  # ZeRO-3: the head's weight is read outside its own forward
    return model


def _keep_fresh_reward_head(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    """Loading a language model's weights (finetune from a pretrained checkpoint) into a reward
    model: its output layer (V x hidden, or none when tied) is not a reward head, so the fresh
    head is kept; a reward model's own checkpoint (1 x hidden) loads as saved."""
    key = prefix + "embed_out.weight"
    head = module.embed_out.weight
    if key not in state or state[key].shape != head.shape:
        log.info(
            "the checkpoint holds a language model's output layer: the reward head starts fresh"
        )
        state[key] = head.detach().clone()


# -- setup ----------------------------------------------------------------------------------------

OBJECTIVES: dict[str, type[Objective]] = {"dpo": DPO, "kto": KTO, "rm": RewardModel}


def needs_reference(cfg: Any) -> bool:
    p = cfg.preference
    return p.train_impl == "kto" or (p.train_impl == "dpo" and not p.dpo_reference_free)


def build_objective(
    cfg: Any, tp_group: Any = None, reference_module: Optional[nn.Module] = None
) -> Optional[Objective]:
    """The Objective of cfg's train_impl (None for plain language modelling)."""
    impl = cfg.preference.train_impl
    if impl == "normal":
        return None
    reference = Reference(reference_module) if reference_module is not None else None
    if needs_reference(cfg) and reference is None:
        raise ValueError(f"train_impl={impl!r} needs a reference model")
    return OBJECTIVES[impl](cfg, tp_group, reference)

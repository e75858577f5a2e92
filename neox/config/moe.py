"""Mixture-of-experts keys (gpt-neox's `moe_*`, plus the router and shared-expert options of
today's MoE families), part of ModelConfig so every model built from it sees them."""

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from neox.config.base import MAX_MLP_WIDTH, ConfigGroup, Reads, Refused, Restricted
from neox.config.errors import ConfigError

MAX_EXPERTS = 1 << 14


class MoeFields(ConfigGroup):
    """MLPs of mixture-of-experts layers: a router picks top-k experts per token."""

    moe_num_experts: Annotated[
        int,
        Reads("neox/model/moe.py", "neox/config/moe.py"),
        Restricted(
            "Above 1, needs pipe_parallel_size 1.",
            example={"moe_num_experts": 4},
            broken_by=({"pipe_parallel_size": 2, "gradient_clipping": 0},),
        ),
    ] = Field(1, ge=1, le=MAX_EXPERTS)
    """Routed experts per MoE layer; 1 (the default) is a dense model."""

    moe_top_k: Annotated[int, Reads("neox/model/moe.py")] = Field(1, ge=1, le=MAX_EXPERTS)
    """Experts each token is sent to; at most moe_num_experts."""

    moe_type: Annotated[Literal["megablocks", "deepspeed"], Reads("neox/model/moe.py")] = (
        "megablocks"
    )
    """gpt-neox's MoE implementation. Both run neox's grouped-GEMM experts; `deepspeed` routes
    as DeepSpeed-MoE's gate (softmax top-k, moe_router_type not read) and honours
    moe_token_dropping with its capacity keys; `megablocks` is dropless (the capacity keys are
    not read)."""

    moe_router_type: Annotated[Literal["sinkhorn", "topk"], Reads("neox/model/moe.py")] = "sinkhorn"
    """How experts are chosen in training: `topk` of the scores, or `sinkhorn`: top-k of the
    Sinkhorn-balanced exp(logits) (rows and columns normalised in turn), the weights still the
    scores of the chosen experts. Evaluation and generation always take top-k of the scores."""

    moe_score_func: Annotated[
        Optional[Literal["softmax", "sigmoid"]], Reads("neox/model/moe.py")
    ] = None
    """Router scores from logits (None: gpt-neox's choice, sigmoid for the sinkhorn router and
    softmax otherwise). Mixtral, OLMoE and Qwen3-MoE use softmax; DeepSeek-V3 sigmoid."""

    moe_norm_topk_prob: Annotated[bool, Reads("neox/model/moe.py")] = False
    """Divide each token's top-k weights by their sum (Mixtral, Qwen3-MoE: true; OLMoE false)."""

    moe_expert_interval: Annotated[int, Reads("neox/config/moe.py")] = Field(1, ge=1, le=1 << 12)
    """Every this many layers is an MoE layer, counting from layer 0 (gpt-neox's rule: layer i
    when i % interval == 0); the others keep the dense MLP."""

    moe_ffn_hidden_size: Annotated[Optional[int], Reads("neox/model/moe.py")] = Field(
        None, ge=1, le=MAX_MLP_WIDTH
    )
    """Inner width of each expert (None: the dense MLP's width). OLMoE-1B-7B: 1024 at hidden
    2048; Qwen3-MoE's moe_intermediate_size."""

    moe_num_shared_experts: Annotated[int, Reads("neox/model/moe.py")] = Field(
        0, ge=0, le=MAX_EXPERTS
    )
    """Experts every token passes through besides the routed ones (DeepSeek/Qwen2-MoE style),
    run as one MLP of moe_num_shared_experts x moe_ffn_hidden_size width."""

    moe_shared_expert_gate: Annotated[bool, Reads("neox/model/moe.py")] = False
    """Scale the shared experts' output per token by sigmoid(x . w), w a learned (1, hidden)
    weight (Qwen2-MoE's shared_expert_gate); needs moe_num_shared_experts."""

    moe_loss_coeff: Annotated[float, Reads("neox/model/moe.py")] = Field(0.1, ge=0, le=1e6)
    """Weight of the load-balancing loss E * sum_e f_e P_e (f_e: fraction of assignments to
    expert e, P_e: its mean score), summed over MoE layers and added to the LM loss."""

    moe_z_loss_coeff: Annotated[float, Reads("neox/model/moe.py")] = Field(0.0, ge=0, le=1e6)
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE), added like
    moe_loss_coeff's loss."""

    moe_jitter_eps: Annotated[Optional[float], Reads("neox/model/moe.py")] = Field(None, ge=0, lt=1)
    """In training, multiply the router's input by noise uniform in [1 - eps, 1 + eps]."""

    moe_lbl_in_fp32: bool = False
    """No-op (gpt-neox key): the router's scores and both auxiliary losses are always float32."""

    moe_token_dropping: Annotated[
        bool,
        Reads("neox/model/moe.py"),
        Restricted(
            "Only with moe_type deepspeed (megablocks is dropless).",
            example={"moe_num_experts": 4, "moe_type": "deepspeed", "moe_token_dropping": True},
            broken_by=({"moe_type": "megablocks"},),
        ),
    ] = False
    """Drop the assignments past an expert's capacity, first choices before second ones, each
    in token order (DeepSpeed-MoE); a dropped token's expert output is zero."""

    moe_train_capacity_factor: Annotated[float, Reads("neox/model/moe.py")] = Field(
        1.0, gt=0, le=1e6
    )
    """With token dropping, an expert's capacity in training is ceil(factor x tokens x top_k /
    experts), at least moe_min_capacity."""

    moe_eval_capacity_factor: Annotated[float, Reads("neox/model/moe.py")] = Field(
        1.0, gt=0, le=1e6
    )
    """moe_train_capacity_factor's value in evaluation and generation."""

    moe_min_capacity: Annotated[int, Reads("neox/model/moe.py")] = Field(4, ge=0, le=1 << 40)
    """The least capacity of an expert with token dropping."""

    moe_expert_parallel_size: Annotated[int, Reads("neox/parallel/build.py")] = Field(
        1, ge=1, le=1 << 20
    )
    """Data-parallel ranks each MoE layer's experts are split over: every group of this many
    consecutive data-parallel ranks runs moe_num_experts / size experts per rank, tokens sent to
    their expert's rank and back by all-to-all. Every rank still holds all expert weights
    (ZeRO partitions them as any weight), so checkpoints do not depend on it (docs/moe.md).
    Must divide moe_num_experts and the data-parallel size."""

    moe_use_residual: Annotated[
        bool,
        Refused(
            feature="DeepSpeed's residual MoE",
            example=True,
            message=(
                "{key}={value}: DeepSpeed's residual MoE (PR-MoE) is not implemented in neox; "
                "use moe_num_shared_experts: 1 for a dense expert beside the routed ones"
            ),
        ),
    ] = False
    """DeepSpeed's residual MoE (a dense MLP mixed with the experts by a learned coefficient);
    refused: moe_num_shared_experts is neox's dense expert."""

    enable_expert_tensor_parallelism: Annotated[
        bool,
        Reads("neox/config/moe.py"),
        Restricted(
            "True needs model_parallel_size 1.",
            example={"moe_num_experts": 4, "enable_expert_tensor_parallelism": True},
            broken_by=({"model_parallel_size": 2},),
        ),
    ] = False
    """gpt-neox key splitting each expert over the tensor-parallel ranks. neox never splits
    experts (tensor-parallel ranks see the same tokens and run their experts whole), so true is
    refused under tensor parallelism and changes nothing without it."""

    @model_validator(mode="after")
    def _check_moe(self) -> "MoeFields":
        e, k = self.moe_num_experts, self.moe_top_k
        if e > 1 and k > e:
            raise ValueError(f"moe_top_k={k} exceeds moe_num_experts={e}; use 1 to {e}")
        if self.moe_shared_expert_gate and not self.moe_num_shared_experts:
            raise ValueError(
                "moe_shared_expert_gate=true gates the shared experts, but "
                "moe_num_shared_experts=0; set moe_num_shared_experts or remove the gate"
            )
        ep = self.moe_expert_parallel_size
        if ep > 1 and e % ep:
            raise ValueError(
                f"moe_expert_parallel_size={ep} does not divide moe_num_experts={e}; use a "
                f"divisor of {e}"
            )
        if self.moe_token_dropping and self.moe_type != "deepspeed":
            raise ValueError(
                "moe_token_dropping=true needs moe_type: deepspeed (megablocks is dropless); "
                "set moe_type: deepspeed or remove moe_token_dropping"
            )
        return self

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) has an MoE MLP."""
        return self.moe_num_experts > 1 and i % self.moe_expert_interval == 0

    def check_expert_parallel(self, dp: int) -> None:
        """Expert-parallel groups are cut from the data-parallel ranks (run by `derive`)."""
        ep = self.moe_expert_parallel_size
        if dp % ep:
            raise ConfigError(
                f"moe_expert_parallel_size={ep} does not divide the data-parallel size {dp} "
                "(world / (model_parallel_size x pipe_parallel_size)); use a divisor of it"
            )

    def check_moe_run(self, tp: int, pp: int) -> None:
        """MoE layers under the run's layout (run by `derive`)."""
        if self.enable_expert_tensor_parallelism and tp > 1:
            raise ConfigError(
                f"enable_expert_tensor_parallelism=true with model_parallel_size={tp}: expert "
                "tensor parallelism is not implemented in neox (experts stay whole on each "
                "tensor-parallel rank); set enable_expert_tensor_parallelism: false"
            )
        if self.moe_num_experts > 1 and pp > 1:
            raise ConfigError(
                f"moe_num_experts={self.moe_num_experts} with pipe_parallel_size={pp}: MoE "
                "layers' auxiliary losses are not carried between pipeline stages in neox (nor "
                "in gpt-neox); use pipe_parallel_size 1"
            )

"""Fused attention kernels (Triton) beside the torch references they must match."""

from neox.kernels.fused_softmax import scaled_masked_softmax, triton_available
from neox.kernels.softmax_reference import scaled_masked_softmax_reference

__all__ = ["scaled_masked_softmax", "scaled_masked_softmax_reference", "triton_available"]

"""Transforms of the built model, applied from outside like parallelism: LoRA adapters on named
linears (`lora`) and FP8 matmuls through torchao (`float8`). They wrap tensor-parallel linears
too, so they sit above neox.parallel in the layer order (tests/test_layering.py)."""

"""LoRA adapters: the base an adapter run trains on, recorded and loaded."""

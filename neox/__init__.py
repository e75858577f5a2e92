"""neox: train GPT-NeoX-family language models from YAML configs on DeepSpeed."""

__version__ = "0.1.0"

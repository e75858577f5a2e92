"""Hugging Face interop: neox checkpoints to and from transformers' model directories."""

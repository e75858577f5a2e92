"""Offline data preparation, run once before training: corpus readers and downloads, training a
tokenizer, tokenizing documents into the .bin/.idx format (neox.data reads it at run time)."""

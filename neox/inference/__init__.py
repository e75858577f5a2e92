"""Text generation: static KV cache, sampling, batched generation, the generate.py modes."""

"""generate.py's choice of decode step (neox/inference/decode_path.py) from the device, the layout
and the job's shape."""

import pytest

from neox.inference.decode_path import COMPILE_PAYS_AFTER_STEPS, choose_decode_path, decode_steps


def choose(**keys):
    args = dict(
        device_type="cuda",
        tensor_parallel=1,
        recompute=False,
        fused_decode=True,
        fused_problem=None,
        torch_compile=None,
        batch=1,
        steps=1000,
    )
    return choose_decode_path(**{**args, **keys})


def test_decode_steps_counts_one_replicas_batches_of_the_full_budget():
    assert decode_steps(prompts=10, replicas=1, batch=4, new_tokens=64) == 3 * 64
    assert decode_steps(prompts=10, replicas=2, batch=4, new_tokens=64) == 2 * 64
    assert decode_steps(prompts=1, replicas=4, batch=16, new_tokens=8) == 8


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_small_batches_take_the_fused_step_whatever_the_job_size(batch):
    for steps in (1, 10**6, None):
        path = choose(batch=batch, steps=steps)
        assert path.fused and not path.compiled
        assert path.line.startswith("decode path: the fused step") and f"batch {batch}" in path.line


def test_a_large_batch_compiles_only_when_the_job_pays_for_it():
    short = choose(batch=16, steps=COMPILE_PAYS_AFTER_STEPS - 1)
    assert not short.fused and not short.compiled
    assert (
        "captured as a CUDA graph" in short.line and f"{COMPILE_PAYS_AFTER_STEPS - 1}" in short.line
    )
    long = choose(batch=16, steps=COMPILE_PAYS_AFTER_STEPS)
    assert long.compiled and "compiled step" in long.line and "past" in long.line
    assert not choose(batch=16, steps=None).compiled  # interactive: length unknown


def test_torch_compile_decides_when_set():
    assert choose(batch=16, steps=1, torch_compile=True).compiled
    assert not choose(batch=16, steps=10**9, torch_compile=False).compiled
    # The fused step still takes small batches: it needs no compilation and is faster.
    assert choose(batch=1, torch_compile=True).fused


def test_the_line_names_why_the_fused_step_is_off():
    assert "fused_decode: false" in choose(fused_decode=False).line
    off = choose(fused_problem="ALiBi position embeddings")
    assert not off.fused and "ALiBi" in off.line
    assert "not 8" in choose(batch=8).line


def test_cpu_tensor_parallel_and_recompute_take_the_eager_paths():
    assert choose(device_type="cpu").line == "decode path: the eager step with a KV cache on cpu"
    tp = choose(tensor_parallel=2, batch=16, steps=10**9, torch_compile=True)
    assert not tp.fused and not tp.compiled and "tp=2" in tp.line
    assert "recompute" in choose(recompute=True).line


def test_a_generate_process_imports_no_compiler_before_it_compiles():
    """torch._dynamo takes seconds to import; a generate.py that decodes through the fused or
    eager step (nothing compiled) never needs it, and its first token waits for every import.
    Building the model on meta, as loading a checkpoint does, imports none either."""
    import subprocess
    import sys

    probe = (
        "import sys, neox.entry, neox.inference.modes, neox.inference.loading, neox.model; "
        "from neox.config.model import ModelConfig; "
        "neox.model.build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,"
        " pos_emb='learned', no_weight_tying=True), 64, device='meta'); "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'deepspeed', "
        "'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_mixture_of_experts_decode_eagerly_uncaptured():
    for batch in (1, 16):
        path = choose(batch=batch, steps=10**9, torch_compile=True, moe=True)
        assert not path.fused and not path.compiled and "uncaptured" in path.line

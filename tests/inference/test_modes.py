"""generate.py on CPU ranks: each text_gen_type, output rows, dp=2 and tp=2 (ranks started from
this process; interactive input through deepy.py, which pipes its stdin to rank 0)."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from neox.config import load_config
from neox.inference.generator import Generator
from neox.inference.loading import build_generation_model
from neox.inference.modes import TextGenerator
from neox.parallel.topology import Topology
from neox.tokenizer.char import CharLevelTokenizer
from tests.train_helpers import make_dataset, run_deepy, run_here, train, write_config

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "The quick brown fox", "ab"]
SPEED_KEYS = {"duration_seconds", "prefill_seconds", "tokens_per_second"}
ROW_KEYS = {"context", "text", "length", "finished", "tokens"} | SPEED_KEYS


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The config of a tiny char-level run trained for 6 steps on one rank (checkpoints 3, 6)."""
    tmp = tmp_path_factory.mktemp("gen")
    make_dataset(tmp / "data" / "chars")
    cfg = write_config(
        tmp, "tp1", num_gpus=1, gradient_accumulation_steps=1, eval_interval=100, lr=5e-3
    )
    train(cfg)
    return cfg


def gen_config(trained: Path, name: str, **keys) -> Path:
    path = trained.parent / f"{name}.yml"
    keys.setdefault("sample_output_file", str(trained.parent / f"{name}.jsonl"))
    path.write_text(yaml.safe_dump({"train_micro_batch_size_per_gpu": 2, **keys}))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def in_process(configs: list[Path], use_cache: bool) -> TextGenerator:
    """generate.py's TextGenerator built here, on one rank (the one_rank_group fixture), from
    the same configs."""
    from neox.parallel.topology import ProcessGroups

    cfg = load_config([str(c) for c in configs]).config
    groups = ProcessGroups(Topology(1, 1, 1))
    tok = CharLevelTokenizer()
    model, _ = build_generation_model(cfg, 512, groups, torch.device("cpu"), torch.float32)
    gen = Generator(model, tok.vocab_size, tok.eod, use_cache=use_cache)
    return TextGenerator(cfg, gen, tok, batch_size=2)


def test_input_file_rows_match_the_engine_over_dp2_and_tp2(trained, one_rank_group):
    prompts = trained.parent / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")  # a blank prompt is skipped
    keys = dict(
        text_gen_type="input-file",
        sample_input_file=str(prompts),
        maximum_tokens=8,
        return_logits=True,
    )
    # Two data-parallel replicas (tp=1) split the prompts; rank 0 writes them all, in order.
    one = gen_config(trained, "dp2_gen", **keys, num_gpus=2)
    run_here("generate.py", trained, one)
    rows = read_rows(trained.parent / "dp2_gen.jsonl")
    assert [r["context"] for r in rows] == PROMPTS
    tok = CharLevelTokenizer()
    for r in rows:
        assert ROW_KEYS | {"logits"} == r.keys()
        assert r["length"] == len(r["tokens"]) == len(r["logits"]) <= 8
        assert r["text"] == tok.decode(r["tokens"])
        assert r["finished"] or r["length"] == 8
    # The trained weights, not a fresh init: the same rows from the engine run here, in
    # other batches (left padding is masked, so batching does not change a continuation).
    here = list(in_process([trained, one], use_cache=True).rows(PROMPTS))
    assert [r["tokens"] for r in here] == [r["tokens"] for r in rows]

    two = gen_config(trained, "tp2_gen", **keys, model_parallel_size=2, num_gpus=2)
    run_here("generate.py", trained, two)
    rows2 = read_rows(trained.parent / "tp2_gen.jsonl")
    assert [r["text"] for r in rows2] == [r["text"] for r in rows]
    for a, b in zip(rows, rows2):
        torch.testing.assert_close(a["logits"], b["logits"], rtol=1e-4, atol=1e-5)


def test_unconditional_sampling_from_an_iteration_is_seeded(trained, one_rank_group):
    keys = dict(
        text_gen_type="unconditional",
        num_samples=3,
        maximum_tokens=12,
        temperature=1.0,
        top_k=50,
        top_p=0.95,
        recompute=True,
        iteration=3,
        seed=11,
    )
    cfg = gen_config(trained, "uncond", **keys)
    run_here("generate.py", trained, cfg)
    rows = read_rows(trained.parent / "uncond.jsonl")
    assert len(rows) == 3 and all(r["context"] == "" for r in rows)
    assert all(ROW_KEYS == r.keys() for r in rows)
    # Same seed, same checkpoint (global_step3), same batches: the same samples.
    here = list(in_process([trained, cfg], use_cache=False).rows([""] * 3))
    assert [r["tokens"] for r in here] == [r["tokens"] for r in rows]
    assert len({tuple(r["tokens"]) for r in rows}) > 1  # it samples


def test_interactive_reads_rank0_stdin_through_a_pipe(trained):
    cfg = gen_config(trained, "inter", text_gen_type="interactive", maximum_tokens=5)
    r = run_deepy("generate.py", trained, cfg, stdin="Hello\nab\n")
    texts = [
        line.split("Generated Text: ", 1)[1]
        for line in r.stdout.splitlines()
        if "Generated Text: " in line
    ]
    assert len(texts) == 2 and all(0 < len(t) <= 5 for t in texts)
    assert r.stdout.count("Context prompt >>> ") == 3  # two prompts, then end of input
    # generate.py's first line names the decode step; the first token's wait is logged.
    said = [line for line in (r.stdout + r.stderr).splitlines() if " neox." in line]
    assert "decode path: the eager step with a KV cache on cpu" in said[0], said[:3]
    assert any("first token" in line and "after this process started" in line for line in said)

"""MoE models (Mixtral, Qwen3-MoE from tests/hf_family_helpers.py) through what generate.py and eval.py
run: the KV-cache generator at batch 1 and 16 decodes transformers' greedy tokens (the fused
step declines expert MLPs, the eager step takes them), and text scoring at batch 1 and 16 gives
transformers' log-likelihood."""

import pytest
import torch
import torch.nn.functional as F

from neox.config.model import ModelConfig
from neox.hf.importer import neox_model_keys
from neox.hf.mapping import from_hf_state_dict
from neox.inference.fused_step import FusedStep
from neox.inference.generator import Generator
from neox.inference.perplexity import score_texts
from neox.model import build_model
from tests.hf_family_helpers import PADDED, VOCAB, hf_greedy, hf_model, neox_pair

MOE = ["mixtral_window_experts", "qwen3_moe_qknorm_unnormalised_tied"]
# 16 left-padded rows of 1 to 24 tokens: past Mixtral's window of 6 keys.
PROMPTS = [[(5 * r + 3 * i + 1) % VOCAB for i in range(1 + (7 * r) % 24)] for r in range(16)]
NEW = 12


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("rows", [1, 16])
def test_cached_greedy_decoding_of_experts_matches_transformers(name, rows):
    _, _, model, hf = neox_pair(name)
    prompts = PROMPTS[-rows:]
    expected = hf_greedy(hf, prompts, NEW, pad=0)
    assert FusedStep.unsupported(model) == "mixture-of-experts MLPs"  # the eager step runs
    gen = Generator(model, VOCAB, eod=PADDED - 1, fused_step=True)
    assert not gen.fused_for(rows)
    if torch.cuda.is_available():  # routing reads the host: MoE steps are never captured
        assert not Generator(model.cuda(), VOCAB, eod=PADDED - 1).cuda_graphs
        model.cpu()
    got = gen.generate(prompts, NEW)
    assert [c.tokens for c in got] == expected


@pytest.mark.parametrize("name", MOE)
def test_scoring_texts_with_experts_gives_transformers_log_likelihood(name):
    arch, config, hf = hf_model(name)
    cfg = ModelConfig(**neox_model_keys(config))
    model = build_model(cfg, VOCAB)  # HF's rows exactly, as convert_from_hf writes them
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg, VOCAB, arch))
    model.eval()
    eod = 0
    docs = [(p, len(p)) for p in PROMPTS]
    expected = 0.0
    with torch.no_grad():
        for ids, _ in docs:
            tokens = torch.tensor([[eod, *ids]])
            logits = hf(tokens[:, :-1]).logits.float()
            expected += F.cross_entropy(logits[0], tokens[0, 1:], reduction="sum").item()
    for batch in (1, 16):
        sums = score_texts(
            model, docs, eod=eod, max_len=32, stride=32, batch_size=batch, device="cpu"
        )
        assert sums.tokens == sum(len(p) for p in PROMPTS)
        assert sums.nll == pytest.approx(expected, rel=1e-5)

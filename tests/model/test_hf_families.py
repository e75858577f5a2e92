"""The model against transformers for every family with its features on (RoPE scalings, sliding
windows, QK-norm, q/k/v-only biases, head_dim, GQA/MQA, tied and untied), fp32 on CPU, over
sequences past every window and original RoPE length."""

import pytest
import torch

from neox.model import count_parameters
from tests.hf_family_helpers import FAMILIES, PADDED, VOCAB, neox_pair, token_ids


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name):
    _, cfg, model, hf = neox_pair(name)
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # Parameters: counted analytically, and HF's plus the padded vocabulary rows.
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, PADDED)
    padding = (PADDED - VOCAB) * cfg.hidden_size * (2 if cfg.no_weight_tying else 1)
    assert count_parameters(cfg, PADDED) - padding == hf.num_parameters()


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window_yarn_tied", "llama3_gqa"])
def test_left_padded_rows_match_transformers(name):
    """A padding mask and shifted positions: the window and the scaled rotary count real tokens."""
    _, _, model, hf = neox_pair(name)
    ids = token_ids(length=40)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(ids, position_ids=pos, attention_mask=mask)[..., :VOCAB]
        theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
        alone = model(ids[1:, 9:])[..., :VOCAB]
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(ours[1, 9:], alone[0], rtol=0, atol=1e-4)

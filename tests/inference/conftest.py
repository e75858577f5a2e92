import pytest
import torch

from neox.config.model import ModelConfig
from neox.model import build_model, lm_loss
from neox.tokenizer import build_tokenizer

MEMORISED_CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=48,
    max_position_embeddings=48,
    pos_emb="rotary",
)
KNOWN = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"]


@pytest.fixture(scope="session")
def chars():
    return build_tokenizer("CharLevelTokenizer", None, None)


@pytest.fixture(scope="session")
def memorised(chars):
    """A tiny char-level model trained until it reproduces KNOWN (seconds on CPU)."""
    torch.manual_seed(0)
    model = build_model(MEMORISED_CFG, 512, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # No EOD in front: LAMBADA contexts start with the passage, as the harness feeds them.
    batch = torch.tensor([chars.encode(t.ljust(44)) for t in KNOWN])
    for _ in range(160):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    return model.eval()

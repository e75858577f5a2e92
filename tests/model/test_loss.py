"""The loss inside the model, and the chunked output-layer loss, against lm_loss on full logits."""

import pytest
import torch

from neox.config.model import ModelConfig
from neox.model import build_model, lm_loss
from neox.model.loss import chunked_lm_loss

PADDED = 128
PYTHIA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
)


def grads(*tensors):
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_loss_and_grads_equal_full_logits(chunk, masked, dtype):
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(3, 9, 16, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(50, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 9), generator=g)
    mask = (torch.rand(3, 9, generator=g) > 0.3).float() if masked else None

    ref = lm_loss(torch.nn.functional.linear(h, w), labels, mask)
    ref.backward()
    ref_grads = grads(h, w)
    h.grad = w.grad = None
    out = chunked_lm_loss(h, w, labels, mask, chunk_size=chunk)
    (2 * out).backward()  # a non-unit upstream gradient scales both grads

    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(out, ref.float(), **tol)
    for got, want in zip(grads(h, w), ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), 2 * want.float(), **tol)


def test_all_masked_batch_gives_zero_loss_and_grads():
    h = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = chunked_lm_loss(h, w, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4), 3)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [0, 5])
def test_model_returns_the_loss_of_its_logits(chunk, tied):
    """model(ids, labels=...) is lm_loss(model(ids), ...), in value and in every gradient."""
    cfg = ModelConfig(**PYTHIA, no_weight_tying=not tied, lm_loss_chunk_size=chunk)
    model = build_model(cfg, PADDED, seed=3)
    ids = torch.randint(0, 100, (2, 13))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    mask = torch.ones(2, 12)
    mask[1, 5:] = 0

    ref = lm_loss(model(tokens), labels, mask)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = model(tokens, labels=labels, loss_mask=mask)
    loss.backward()

    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)

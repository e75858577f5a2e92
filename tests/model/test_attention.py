"""The three attention kernels agree; masks (causal, window, padding) and ALiBi behave."""

import math

import pytest
import torch
import torch.nn.functional as F

from neox.config.model import ModelConfig
from neox.model.attention import Attention, allowed_mask
from neox.model.positional import alibi_slopes
from neox.model.rotary import RotaryEmbedding

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)

CASES = {
    "causal_rotary": dict(pos_emb="rotary", rotary_pct=0.5),
    "gqa": dict(pos_emb="rotary", num_kv_heads=2),
    "alibi": dict(pos_emb="alibi"),
    "window": dict(pos_emb="rotary", sliding_window_width=3),
    "alibi_window_qknorm": dict(pos_emb="alibi", sliding_window_width=5, use_qk_layernorm=True),
}


def make_attention(overrides: dict, impl: str) -> Attention:
    torch.manual_seed(0)
    attn = Attention(ModelConfig(**{**TINY, **overrides, "attention_impl": impl}))
    return attn.eval()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_flash_torch_triton_agree(case, padded):
    x = torch.randn(2, 9, 32)
    mask = None
    if padded:
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :3] = 0
    outs = {}
    for impl in ("flash", "torch", "triton"):
        attn = make_attention(CASES[case], impl)
        outs[impl] = attn(x, attention_mask=mask)
    torch.testing.assert_close(outs["flash"], outs["torch"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(outs["torch"]).all()


def first_influenced(attn: Attention, T: int = 12) -> list[int]:
    """For each query i, the oldest key position whose token changes query i's output."""
    x = torch.randn(1, T, 32)
    poked = x.repeat(T, 1, 1)  # row j has token j changed
    poked[torch.arange(T), torch.arange(T)] += 1.0
    with torch.no_grad():
        changed = ~torch.isclose(attn(poked), attn(x)).all(-1)  # (j, i): poking j moved query i
    oldest = []
    for i in range(T):
        seen = changed[:, i].nonzero().flatten().tolist()
        assert max(seen) == i  # causal: nothing after the query; the query itself counts
        oldest.append(min(seen))
    return oldest


@pytest.mark.parametrize("impl", ["flash", "torch", "triton"])
def test_sliding_window_hides_old_keys(impl):
    attn = make_attention(dict(pos_emb="rotary", sliding_window_width=3), impl)
    # gpt-neox's flash-attn window (3, -1): query i sees keys i-3 .. i.
    assert first_influenced(attn) == [max(0, i - 3) for i in range(12)]


@pytest.mark.parametrize("impl", ["flash", "torch"])
def test_full_causal_sees_all_past_keys(impl):
    attn = make_attention(dict(pos_emb="alibi"), impl)
    assert first_influenced(attn) == [0] * 12


def test_alibi_slopes_and_bias():
    assert alibi_slopes(8) == [2 ** -(i + 1) for i in range(8)]
    # Non-power of two: the 4-head slopes, then every other slope of the 8-head set.
    assert alibi_slopes(6) == alibi_slopes(4) + alibi_slopes(8)[0::2][:2]
    # With identical keys and values growing with position, ALiBi pulls attention to recent keys.
    assert alibi_slopes(4) == [2**-2, 2**-4, 2**-6, 2**-8]  # 2^(-8k/n)
    attn = make_attention(dict(pos_emb="alibi"), "torch")
    q = torch.zeros(1, 4, 6, 8)
    v = torch.arange(6.0).view(1, 1, 6, 1).expand(1, 4, 6, 8)
    y = attn._attend_scores(q, q, v, None, fused=False)  # (B, nh, T, hs)
    # Query 5's weights are softmax(-slope * distance): closed form for head 0 (slope 1/4).
    w = torch.softmax(-0.25 * torch.arange(5.0, -1.0, -1.0), dim=0)
    torch.testing.assert_close(y[0, 0, 5, 0], (w * torch.arange(6.0)).sum())


def test_padding_mask_hides_padded_keys():
    mask = allowed_mask(4, 4, torch.device("cpu"), padding_mask=torch.tensor([[0, 1, 1, 1]]))
    expected = torch.tensor(
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool
    )  # the padded query still sees itself, so no row is empty
    assert torch.equal(mask[0, 0], expected)


def test_local_layers_need_a_window():
    # The model group refuses it (issue 33: the dry run and tools/estimate.py gave a traceback).
    with pytest.raises(ValueError, match="sliding_window_width"):
        ModelConfig(**TINY, attention_config=[[["global", "local"], 1]])


def test_rotary_partial_dims_and_positions():
    rope = RotaryEmbedding(dim=4, base=10000)
    q = torch.randn(1, 2, 5, 8)
    q_rot, _ = rope(q, q)
    torch.testing.assert_close(q_rot[..., 4:], q[..., 4:])  # features past rotary_pct pass
    torch.testing.assert_close(q_rot[:, :, 0], q[:, :, 0])  # position 0 is not rotated
    # Position 1 of the first pair is rotated by angle 1 (inv_freq[0] = 1).
    a, b = q[0, 0, 1, 0], q[0, 0, 1, 2]
    torch.testing.assert_close(q_rot[0, 0, 1, 0], a * math.cos(1) - b * math.sin(1))
    # Explicit position ids reproduce the default ones, and the cache serves a longer call.
    pos = torch.arange(5).unsqueeze(0)
    torch.testing.assert_close(rope(q, q, pos)[0], q_rot)
    long = torch.randn(1, 2, 9, 8)
    torch.testing.assert_close(
        rope(long, long)[0][:, :, :5], rope(long[:, :, :5], long[:, :, :5])[0]
    )


def test_document_mask_isolates_packed_documents():
    """With reset_attention_mask's (B, 1, T, T) mask and reset positions, the second document of a
    packed sample gets the logits it gets alone."""
    from neox.config import load_dict
    from neox.data.batch import build_batch
    from neox.model import build_model

    cfg = load_dict(
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "pos_emb": "rotary",
            "seq_length": 16,
        }
    ).model
    model = build_model(cfg, 64, seed=3).eval()
    first, second = torch.tensor([5, 6, 7, 0]), torch.tensor([9, 10, 11, 12, 13, 14])
    text = torch.cat([first, second, torch.tensor([0])]).unsqueeze(0)  # [1, T + 1]
    b = build_batch(text, eod_token=0, reset_position_ids=True, reset_attention_mask=True)
    packed = model(b.tokens, b.position_ids, b.attention_mask)
    alone = model(second.unsqueeze(0))
    torch.testing.assert_close(packed[:, len(first) :], alone, rtol=1e-5, atol=1e-5)
    unmasked = model(b.tokens, b.position_ids)
    assert not torch.allclose(unmasked[:, len(first) :], alone, atol=1e-3)


def packed_documents(batch: int, seq: int, seed: int) -> torch.Tensor:
    """(B, T) document ids with random boundaries (so some fall inside FlexAttention's tiles)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 0.15
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1)


def dense_document_mask(docs: torch.Tensor) -> torch.Tensor:
    """The reference (B, 1, T, T) mask written out pair by pair: causal, same document."""
    B, T = docs.shape
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(i + 1):
                mask[b, 0, i, j] = bool(docs[b, i] == docs[b, j])
    return mask


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl", ["auto", "triton", "flash"])
def test_document_mask_matches_the_dense_reference_with_gradients(impl, window):
    """Each kernel's DocumentMask path (on CPU: SDPA or the softmax on the mask built from the
    ids) against the reference softmax given the dense mask, forward and gradients."""
    from neox.kernels.flex_attention import DocumentMask

    docs = packed_documents(2, 24, seed=window or 0)
    overrides = dict(pos_emb="rotary", sliding_window_width=window)
    ours, ref = make_attention(overrides, impl).train(), make_attention(overrides, "torch").train()
    x = torch.randn(2, 24, 32, requires_grad=True)
    out = ours(x, attention_mask=DocumentMask(docs, 24))
    x_ref = x.detach().clone().requires_grad_()
    expected = ref(x_ref, attention_mask=dense_document_mask(docs))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_documents_do_not_see_each_other():
    """Changing the first document's tokens leaves the second's logits unchanged, through
    build_batch and the model, with global and sliding-window layers."""
    from neox.config import load_dict
    from neox.data.batch import build_batch
    from neox.model import build_model

    cfg = load_dict(
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "pos_emb": "rotary",
            "seq_length": 32,
            "attention_config": [[["global", "local"], 1]],
            "sliding_window_width": 6,
        }
    ).model
    model = build_model(cfg, 64, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    first = torch.randint(1, 64, (11,), generator=g)
    second = torch.randint(1, 64, (20,), generator=g)

    def logits(first):
        text = torch.cat([first, torch.tensor([0]), second, torch.tensor([5])]).unsqueeze(0)
        b = build_batch(text, eod_token=0, reset_attention_mask=True)
        assert b.attention_mask.document_ids is not None  # no (B, 1, T, T) mask in the batch
        return model(b.tokens, b.position_ids, b.attention_mask)[0]

    before, after = logits(first), logits(torch.randint(1, 64, (11,), generator=g))
    n = len(first) + 1
    torch.testing.assert_close(before[n:], after[n:], rtol=0, atol=0)
    assert not torch.allclose(before[:n], after[:n])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("local,pos_emb", [(False, "rotary"), (True, "rotary"), (True, "alibi")])
def test_flex_attention_in_the_model_matches_the_reference_on_gpu(local, pos_emb):
    """attention_impl auto takes compiled FlexAttention for packed documents (and a window, and
    ALiBi) on CUDA; in bf16 its loss and gradients match the reference softmax on the dense mask."""
    from neox.config import load_dict
    from neox.data.batch import build_batch
    from neox.model import build_model

    layers = [[["global", "local"], 1]] if local else [[["global"], 2]]
    cfg = load_dict(
        {
            "num_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "pos_emb": pos_emb,
            "seq_length": 1024,
            "attention_config": layers,
            "sliding_window_width": 200 if local else None,
        }
    ).model
    g = torch.Generator().manual_seed(0)
    text = torch.randint(1, 500, (2, 1025), generator=g)
    text[torch.rand(2, 1025, generator=g) < 0.004] = 0
    batch = build_batch(text.cuda(), eod_token=0, reset_attention_mask=True)
    results = []
    for impl in ("auto", "torch"):
        model = build_model(cfg.model_copy(update={"attention_impl": impl}), 512, seed=1)
        model = model.cuda().to(torch.bfloat16)
        assert model.layers[0].attention.kernel(batch.tokens.device, batch.attention_mask) == (
            "flex" if impl == "auto" else "torch"
        )
        mask = batch.attention_mask if impl == "auto" else batch.attention_mask.dense()
        loss = model(batch.tokens, batch.position_ids, mask, batch.labels, batch.loss_mask)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results.append((loss.float().item(), grads))
    (flex_loss, flex_grads), (ref_loss, ref_grads) = results
    assert flex_loss == pytest.approx(ref_loss, rel=1e-2)
    cos = F.cosine_similarity(flex_grads, ref_grads, dim=0)
    assert cos > 0.99, cos

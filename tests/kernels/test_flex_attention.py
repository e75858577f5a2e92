"""neox/kernels/flex_attention.py: the block masks of packed documents and sliding windows
against the dense-mask reference. FlexAttention has no CPU backward, so on CPU its eager
forward checks the masks and the model's CPU path (SDPA with the dense mask) checks gradients;
the compiled kernel, forward and backward, runs under the `gpu` marker."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from neox.kernels.flex_attention import BLOCK, DocumentMask, allowed, build_block_mask


def random_documents(batch: int, seq: int, seed: int, inside: int | None = None) -> torch.Tensor:
    """(B, T) nondecreasing document ids, boundaries at random, one at `inside` if given."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 4 / seq
    if inside is not None:
        starts[:, inside] = True
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1)


def reference(q, k, v, docs, window):
    mask = allowed(docs, q.shape[-2], k.shape[-2], q.device, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("seq,window", [(300, None), (256, None), (300, 40), (2 * BLOCK, 130)])
@pytest.mark.parametrize("packed", [True, False])
def test_block_mask_matches_dense_reference(seq, window, packed):
    # A boundary inside the second tile, not on a tile edge.
    docs = random_documents(2, seq, seed=seq, inside=BLOCK + 37) if packed else None
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, seq, 16, generator=g) for _ in range(3))
    block_mask = build_block_mask(docs, seq, window, "cpu")
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager FlexAttention warns (once) that it is unfused
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out, reference(q, k, v, docs, window), rtol=1e-5, atol=1e-5)


def test_alibi_score_mod_matches_the_dense_bias():
    from torch.nn.attention.flex_attention import flex_attention

    from neox.kernels.flex_attention import alibi_score_mod
    from neox.model.positional import alibi_bias, alibi_slopes

    seq, heads = 200, 4
    docs = random_documents(2, seq, seed=3, inside=BLOCK + 9)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, seq, 16, generator=g) for _ in range(3))
    slopes = alibi_slopes(heads)
    score_mod = alibi_score_mod(torch.tensor(slopes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=build_block_mask(docs, seq, 50, "cpu")
        )
    bias = alibi_bias(slopes, seq, seq, q.device, torch.float32)  # (nh, T, T)
    mask = bias.masked_fill(~allowed(docs, seq, seq, "cpu", 50), float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_tiles_outside_documents_and_windows_are_skipped():
    seq = 4 * BLOCK
    docs = torch.zeros(1, seq, dtype=torch.long)
    docs[:, 2 * BLOCK + 5 :] = 1  # document 1 starts inside the third tile
    mask = build_block_mask(docs, seq)
    partial, full = mask.kv_num_blocks[0, 0].tolist(), mask.full_kv_num_blocks[0, 0].tolist()
    # Query tile 3 lies in document 1: tiles 0 and 1 (document 0) are never visited.
    assert partial == [1, 1, 3, 2] and full == [0, 1, 0, 0]
    dense = allowed(docs, seq, seq, "cpu")[0, 0].reshape(4, BLOCK, 4, BLOCK)
    visited = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        for n, idx in ((partial[i], mask.kv_indices), (full[i], mask.full_kv_indices)):
            visited[i, idx[0, 0, i, :n]] = True
    assert torch.equal(visited, dense.any(dim=3).any(dim=1))  # every allowed pair is visited
    window = build_block_mask(None, seq, window=BLOCK)
    assert window.kv_num_blocks[0, 0].tolist() == [1, 2, 2, 2]  # diagonal + the tile before
    assert window.full_kv_num_blocks[0, 0].tolist() == [0, 0, 0, 0]


def test_document_mask_dense_and_prepare():
    docs = random_documents(2, 40, seed=0)
    mask = DocumentMask(docs, 40)
    dense = mask.dense()
    assert dense.shape == (2, 1, 40, 40) and torch.equal(dense, allowed(docs, 40, 40, "cpu"))
    assert DocumentMask(None, 40).dense() is None  # plain causal needs no mask
    mask.prepare({None, 8}, "cpu")
    assert set(mask.block_masks) == {None, 8}
    assert (
        DocumentMask(None, 40).prepare({8}, "cpu").block_masks[8]
        is (DocumentMask(None, 40).prepare({8}, "cpu").block_masks[8])
    )  # document-free masks are built once per (length, window, device)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("hs", [64, 128, 96])
def test_compiled_flex_matches_reference_on_gpu(window, hs):
    """Compiled FlexAttention in bf16, forward and gradients, against the float32 dense-mask
    reference, with random document boundaries (one inside a tile)."""
    from neox.kernels.flex_attention import flex_attention

    seq = 1000
    docs = random_documents(2, seq, seed=hs, inside=BLOCK + 37).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, seq, hs, device="cuda", generator=g) for _ in range(3))
    grad = torch.randn(2, 4, seq, hs, device="cuda", generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in, docs, window)
    ref.backward(grad)
    ours_in = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    mask = DocumentMask(docs, seq).prepare({window}, "cuda").block_masks[window]
    out = flex_attention(*ours_in, mask, hs**-0.5)
    out.backward(grad.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for ours, theirs in zip(ours_in, ref_in):
        err = (ours.grad.float() - theirs.grad).abs().max() / theirs.grad.abs().max()
        assert err < 2e-2, err

"""Rotary: one table per device and dtype, indexed by position ids without reading them."""

import pytest
import torch

from neox.model.rotary import RotaryEmbedding, rotate_half


def qk(T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)


def test_explicit_positions_equal_default_and_table_is_built_once():
    rot = RotaryEmbedding(dim=4, base=10000, max_positions=32)
    q, k = qk()
    default = rot(q, k)
    explicit = rot(q, k, torch.arange(6).expand(2, 6))
    for a, b in zip(default, explicit):
        torch.testing.assert_close(a, b)
    ((cos, _),) = rot._cache.values()
    assert cos.shape == (32, 4)  # sized to max_positions, not to the first batch
    rot(*qk(T=20), torch.arange(20))
    assert len(rot._cache) == 1 and next(iter(rot._cache.values()))[0] is cos


def test_offset_positions_match_the_same_tokens_in_a_longer_sequence():
    """KV-cache decoding: tokens at positions 10..12 rotate as they would inside 0..12."""
    rot = RotaryEmbedding(dim=8, base=10000, max_positions=16)
    q, k = qk(T=13)
    full_q, full_k = rot(q, k)
    tail_q, tail_k = rot(q[:, :, 10:], k[:, :, 10:], torch.arange(10, 13).expand(2, 3))
    torch.testing.assert_close(tail_q, full_q[:, :, 10:])
    torch.testing.assert_close(tail_k, full_k[:, :, 10:])


def test_per_row_positions_restart_per_document():
    rot = RotaryEmbedding(dim=4, base=10000, max_positions=8)
    q, k = qk()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    out_q, _ = rot(q, k, pos)
    ref_q, _ = rot(q[1:, :, :3], k[1:, :, :3])
    torch.testing.assert_close(out_q[1:, :, 3:], rot(q[1:, :, 3:], k[1:, :, 3:])[0])
    torch.testing.assert_close(out_q[1:, :, :3], ref_q)


def test_sequence_longer_than_max_positions_grows_the_table():
    rot = RotaryEmbedding(dim=4, base=10000, max_positions=4)
    q, k = qk(T=6)
    a, _ = rot(q, k)
    b, _ = RotaryEmbedding(dim=4, base=10000, max_positions=6)(q, k)
    torch.testing.assert_close(a, b)


def _graphs_of_compiled_rotary(prepare: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The code of the graphs torch.compile traces for one rotation, and its output vs eager."""
    graphs: list[str] = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    rot = RotaryEmbedding(dim=4, base=10000, max_positions=16)
    if prepare:
        rot.prepare(torch.device("cpu"))
    q, k = qk()
    pos = torch.arange(6).expand(2, 6)
    compiled = torch.compile(lambda q, k, p: rot(q, k, p), backend=capture, fullgraph=True)
    torch._dynamo.reset()
    out = compiled(q.bfloat16(), k.bfloat16(), pos)[0]
    eager = RotaryEmbedding(dim=4, base=10000, max_positions=16)(q.bfloat16(), k.bfloat16(), pos)
    return graphs, out, eager[0]


def test_compiled_rotation_reads_the_prepared_table_instead_of_recomputing_it():
    """Recomputed in the graph, the table costs a pow, cos and sin per element of q and k."""
    graphs, out, eager = _graphs_of_compiled_rotary(prepare=True)
    assert graphs and not any(".cos()" in code or ".sin()" in code for code in graphs)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)  # the same bf16 table values
    graphs, out, eager = _graphs_of_compiled_rotary(prepare=False)
    assert any(".cos()" in code for code in graphs)  # unprepared: built inside the graph
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.5),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=24,
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=24),
    "yarn_mscale_untruncated": dict(
        rope_type="yarn",
        factor=3.0,
        original_max_position_embeddings=32,
        beta_fast=8.0,
        beta_slow=2.0,
        mscale=0.7,
        mscale_all_dim=0.3,
        truncate=False,
    ),
}


def _both(name: str, head_dim: int = 16, max_positions: int = 96):
    """(our RotaryEmbedding, transformers' LlamaRotaryEmbedding) for one scaling."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from neox.config.model import ModelConfig

    params = {"rope_theta": 5000.0, **SCALINGS[name]}
    hf = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=head_dim * 2,
            num_attention_heads=2,
            max_position_embeddings=max_positions,
            rope_parameters=params,
        )
    )
    cfg = ModelConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        seq_length=max_positions,
        pos_emb="rotary",
        rotary_emb_base=5000,
        rope_scaling=SCALINGS[name],
    )
    return RotaryEmbedding(head_dim, 5000, max_positions, cfg.shape.rope), hf


@pytest.mark.parametrize("name", SCALINGS)
def test_scaled_tables_equal_transformers_to_the_bit(name):
    ours, hf = _both(name)
    x = torch.zeros(1, 40, 16)
    pos = torch.arange(40)[None]
    cos, sin = hf(x, pos)
    our_cos, our_sin = ours.cos_sin(40, torch.device("cpu"), torch.float32)
    assert torch.equal(our_cos[:40], cos[0]) and torch.equal(our_sin[:40], sin[0])


def test_dynamic_ntk_grows_the_base_with_the_longest_position_as_transformers():
    """Past max_positions (16) each forward's frequencies follow its largest position; a
    decode step at position p rotates as transformers' step does (its cache is stateful, ours
    decides on the device from the positions)."""
    ours, hf = _both("dynamic", max_positions=16)
    q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(0))
    for p in (3, 15, 16, 20, 45):  # below, at and past the original length, growing
        pos = torch.tensor([[p]])
        cos, sin = hf(q[:, 0], pos)
        expected = q * cos[:, None] + rotate_half(q) * sin[:, None]
        ours.prepare(torch.device("cpu"), 64)
        got, _ = ours(q, q, pos)
        assert torch.equal(got, expected), p
    # A whole sequence past the original length: every position uses the longer base.
    x = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(1))
    hf2 = _both("dynamic", max_positions=16)[1]
    cos, sin = hf2(x[:, 0], torch.arange(30)[None])
    torch.testing.assert_close(
        ours(x, x)[0], x * cos[:, None] + rotate_half(x) * sin[:, None], rtol=0, atol=0
    )


def test_layers_with_the_same_settings_share_one_table():
    a, b = RotaryEmbedding(8, 10000, 64), RotaryEmbedding(8, 10000, 64)
    ta = a.cos_sin(4, torch.device("cpu"), torch.float32)[0]
    assert b.cos_sin(4, torch.device("cpu"), torch.float32)[0] is ta


def test_compiled_partial_rotation_joins_the_passed_features_without_a_cat():
    """Under torch.compile the rotated and passed-through features are joined elementwise (one
    fused kernel with the rotation, where a cat costs a copy kernel per tensor on a GPU), with
    exactly the eager values, in bf16 through inductor too when it rounds where eager does (as
    the compiled decode step asks)."""
    graphs: list[str] = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    rot = RotaryEmbedding(dim=4, base=10000, max_positions=16)
    rot.prepare(torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 6, 16, generator=g), torch.randn(2, 1, 6, 16, generator=g)
    pos = torch.arange(6).expand(2, 6)
    eager = rot(q.bfloat16(), k.bfloat16(), pos)
    torch._dynamo.reset()
    traced = torch.compile(lambda q, k, p: rot(q, k, p), backend=capture, fullgraph=True)
    traced(q.bfloat16(), k.bfloat16(), pos)
    # rotate_half's cat of the two rotated halves stays; no cat appends the passed features.
    assert sum(code.count("torch.cat(") for code in graphs) == 2, graphs
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        fused = torch.compile(lambda q, k, p: rot(q, k, p), fullgraph=True)(
            q.bfloat16(), k.bfloat16(), pos
        )
    for got, want in zip(fused, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()

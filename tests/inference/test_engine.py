"""Greedy generation equals transformers' greedy generate; the KV cache equals recompute."""

import pytest
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from neox.checkpoint.hf_map import hf_config_for, to_hf_state_dict
from neox.config.model import ModelConfig
from neox.inference.engine import Generator, left_pad
from neox.model import build_model

VOCAB, PADDED = 97, 128
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, pos_emb="rotary")
LLAMA = dict(
    norm="rmsnorm", activation="swiglu", use_bias_in_attn_linear=False, use_bias_in_mlp=False
)
CASES = {
    "gpt_neox": ("gpt_neox", dict(gpt_j_residual=True, rotary_pct=0.25, no_weight_tying=True)),
    "llama_gqa": ("llama", dict(**LLAMA, num_kv_heads=2)),
}
PROMPTS = [[5, 17, 3, 44, 9, 12, 30], [8], [61, 2, 2, 70]]
EOD = 0


def tiny_pair(case: str, seed: int = 3):
    """Our model and the transformers model holding the same weights (HF from ours)."""
    arch, overrides = CASES[case]
    cfg = ModelConfig(**TINY, **overrides)
    model = build_model(cfg, PADDED, seed=seed).eval()
    cls, conf = {
        "gpt_neox": (GPTNeoXForCausalLM, GPTNeoXConfig),
        "llama": (LlamaForCausalLM, LlamaConfig),
    }[arch]
    hf = cls(conf(**hf_config_for(cfg, VOCAB, arch))).eval()
    hf_sd = to_hf_state_dict(model.state_dict(), cfg, VOCAB, arch)
    # transformers >= 5 calls GPTNeoX's output layer lm_head in memory (embed_out on disk).
    hf_sd = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in hf_sd.items()}
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model, hf


def hf_greedy(hf, prompts, new_tokens):
    ids, mask = left_pad(prompts, EOD, "cpu")
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=EOD,
        eos_token_id=None,
    )
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers_generate(case):
    model, hf = tiny_pair(case)
    new = 12
    expected = hf_greedy(hf, PROMPTS, new)
    # eod = an id no model picks here (the padded range), so every row runs the whole budget.
    gen = Generator(model, VOCAB, eod=PADDED - 1)
    got = [c.tokens for c in gen.generate(PROMPTS, new)]
    assert got == expected
    recomputed = Generator(model, VOCAB, eod=PADDED - 1, use_cache=False).generate(PROMPTS, new)
    assert [c.tokens for c in recomputed] == expected

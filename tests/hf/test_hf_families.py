"""Every HF family (GPTNeoX, Llama 1-3.x, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE,
OLMoE) with its features on: HF -> neox -> HF is byte-exact, the exported config rebuilds the
same transformers model, the config keys round-trip, a 150k vocabulary's padding never leaks
out, and what neox cannot express is refused by name."""

import re

import pytest
import torch

from neox.config.derived import pad_vocab_size
from neox.config.model import ModelConfig
from neox.hf.importer import HFImportError, neox_model_keys
from neox.hf.mapping import (
    MOE_ARCHS,
    check_exportable,
    from_hf_state_dict,
    hf_config_for,
    to_hf_state_dict,
)
from neox.model import count_parameters
from tests.hf_family_helpers import FAMILIES, PADDED, VOCAB, hf_model, neox_pair, token_ids


def file_names(arch: str, hf) -> dict:
    """transformers' in-memory state dict as its files spell it (GPTNeoX: lm_head -> embed_out;
    MoE: one linear per expert, as save_pretrained writes them)."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(hf, hf.state_dict())
    if arch != "gpt_neox":
        return sd
    return {k.replace("lm_head.", "embed_out."): v for k, v in sd.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_neox_to_hf_is_byte_exact(name):
    arch, config, hf = hf_model(name)
    cfg = ModelConfig(**neox_model_keys(config))
    hf_sd = file_names(arch, hf)
    ours = from_hf_state_dict(hf_sd, cfg, PADDED, arch)
    assert torch.all(ours["embed_in.weight"][VOCAB:] == 0)  # padding rows, zero
    back = to_hf_state_dict(ours, cfg, VOCAB, arch)
    if config["tie_word_embeddings"]:
        hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("lm_head.weight")}
    assert sorted(back) == sorted(hf_sd)
    for key, tensor in hf_sd.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", FAMILIES)
def test_one_layer_at_a_time_gives_the_whole_conversion(name):
    """The contract a streaming converter relies on: any subset of whole layers converts alone."""
    arch, config, hf = hf_model(name)
    cfg = ModelConfig(**neox_model_keys(config))
    hf_sd = file_names(arch, hf)
    whole = from_hf_state_dict(hf_sd, cfg, PADDED, arch)
    groups: dict[str, dict] = {}
    for key, tensor in hf_sd.items():
        layer = re.search(r"\.layers\.(\d+)\.", key)
        groups.setdefault(layer.group(1) if layer else key, {})[key] = tensor
    pieces: dict[str, torch.Tensor] = {}
    for part in groups.values():
        pieces.update(from_hf_state_dict(part, cfg, PADDED, arch, fill_untied_head=False))
    assert sorted(pieces) == sorted(whole)
    assert all(torch.equal(pieces[k], whole[k]) for k in whole)
    back: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        back.update(
            to_hf_state_dict(
                {k: v for k, v in whole.items() if k.startswith(f"layers.{i}.")}, cfg, VOCAB, arch
            )
        )
    assert all(torch.equal(back[k], hf_sd[k]) for k in back)


@pytest.mark.parametrize("name", FAMILIES)
def test_exported_config_rebuilds_the_same_transformers_model(name, tmp_path):
    """hf_config_for's config.json, loaded by transformers with the exported weights, computes
    the original model's logits: windows, scalings, biases, norms and routers all say the same
    thing."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, cfg, model, hf = neox_pair(name)
    exported = hf_config_for(cfg, VOCAB, arch)
    exported_sd = to_hf_state_dict(model.state_dict(), cfg, VOCAB, arch)
    if arch in MOE_ARCHS:
        # Per-expert files: transformers' own loading fuses them.
        AutoConfig.for_model(**exported).save_pretrained(tmp_path)
        save_file(exported_sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    else:
        again = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**exported), attn_implementation="eager"
        )
        if arch == "gpt_neox":
            exported_sd = {k.replace("embed_out.", "lm_head."): v for k, v in exported_sd.items()}
        missing, unexpected = again.load_state_dict(exported_sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    again.eval()
    assert type(again) is type(hf)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)
    # And the config reads back as the same neox keys.
    assert ModelConfig(**neox_model_keys(exported)).shape == cfg.shape


def test_a_large_vocabulary_is_padded_for_tp_and_cut_back_on_export():
    """Qwen2.5's 151,936 rows padded to make_vocab_size_divisible_by x tp (152,064 at tp=2):
    the extra rows exist only inside neox; the export has HF's rows, byte for byte."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 151_936
    hf = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=16,
            tie_word_embeddings=False,
        )
    )
    cfg = ModelConfig(**neox_model_keys(hf.config.to_dict()))
    padded = pad_vocab_size(vocab, cfg.make_vocab_size_divisible_by, 2)
    assert padded == 152_064
    ours = from_hf_state_dict(hf.state_dict(), cfg, padded, "qwen2")
    assert ours["embed_out.weight"].shape[0] == padded
    back = to_hf_state_dict(ours, cfg, vocab, "qwen2")
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back[key], tensor), key
    assert hf_config_for(cfg, vocab, "qwen2")["vocab_size"] == vocab


def _hf(arch: str, **changes):
    config = dict(hf_model(next(n for n, (a, _) in FAMILIES.items() if a == arch))[1])
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "config,words",
    [
        (_hf("llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
        (_hf("llama", attn_logit_softcapping=30.0), "unknown field attn_logit_softcapping=30.0"),
        (
            _hf("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "mrope": 1}),
            "['mrope']",
        ),
        (_hf("mistral", sliding_window=1), "sliding_window=1"),
        (_hf("qwen2", layer_types=["full_attention", "chunked_attention"]), "layer_types"),
        (_hf("qwen3", rope_theta=1.5, rope_parameters=None), "rope_theta=1.5"),
        (_hf("qwen3", model_type="gemma"), "model_type='gemma'"),
        (_hf("qwen3_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
        (_hf("qwen3_moe", mlp_only_layers=[0]), "mlp_only_layers=[0]"),
        (_hf("mixtral", num_local_experts=1), "experts=1"),
        (_hf("qwen2_moe", shared_expert_intermediate_size=24), "a multiple of"),
        (_hf("qwen2_moe", use_sliding_window=True), "without windows"),
        (_hf("olmoe", clip_qkv=8.0), "clip_qkv=8.0"),
    ],
)
def test_configs_neox_cannot_express_are_refused_by_field(config, words):
    with pytest.raises(HFImportError) as e:
        neox_model_keys(config)
    assert words in str(e.value)


LLAMA_LIKE = dict(
    pos_emb="rotary",
    norm="rmsnorm",
    activation="swiglu",
    use_bias_in_attn_linear=False,
    use_bias_in_mlp=False,
)
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
MOE = dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk", moe_norm_topk_prob=True)


@pytest.mark.parametrize(
    "arch,overrides,words",
    [
        ("llama", dict(sliding_window_width=4), "has no window"),
        ("llama", dict(use_qk_layernorm=True), "has no q/k norm"),
        ("llama", dict(use_bias_in_attn_linear=True, use_bias_in_attn_dense=False), "covers"),
        ("mistral", dict(use_bias_in_attn_linear=True), "no biases"),
        (
            "mistral",
            dict(sliding_window_width=3, attention_config=[[["global", "local"], 1]]),
            "mixing local and global",
        ),
        ("qwen2", dict(), "true and false"),
        ("qwen3", dict(), "always normalises"),
        ("qwen3", dict(use_qk_layernorm=True, use_bias_in_mlp=True), "MLP has no biases"),
        ("gpt_neox", dict(head_dim=16, norm="layernorm", activation="gelu"), "head_dim=16"),
        ("llama", MOE, "LlamaForCausalLM has no experts"),
        ("mixtral", dict(), "needs experts"),
        ("mixtral", dict(MOE, moe_norm_topk_prob=False), "renormalises"),
        ("mixtral", dict(MOE, moe_num_shared_experts=1), "moe_num_shared_experts=1"),
        ("qwen3_moe", dict(MOE, moe_router_type="sinkhorn"), "scores by sigmoid"),
        ("qwen3_moe", dict(MOE, use_qk_layernorm=True, moe_expert_interval=2), "every layer"),
        ("qwen2_moe", dict(MOE, use_bias_in_attn_linear=True), "gated shared expert"),
        ("olmoe", dict(MOE, use_qk_layernorm=True), "normalises the whole projections"),
        ("qwen3", dict(use_qk_layernorm=True, qk_layernorm_scope="projection"), "each head"),
    ],
)
def test_inexpressible_models_are_refused_by_name(arch, overrides, words):
    cfg = ModelConfig(**{**TINY, **LLAMA_LIKE, **overrides})
    with pytest.raises(ValueError, match=words):
        check_exportable(cfg, arch)


# config.json of released models (as published with their weights) and their published sizes.
RELEASED = {
    "Llama-3.1-8B": (
        dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=128000,
            eos_token_id=[128001, 128008, 128009],
            hidden_act="silu",
            hidden_size=4096,
            initializer_range=0.02,
            intermediate_size=14336,
            max_position_embeddings=131072,
            mlp_bias=False,
            num_attention_heads=32,
            num_hidden_layers=32,
            num_key_value_heads=8,
            pretraining_tp=1,
            rms_norm_eps=1e-05,
            rope_scaling=dict(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
                rope_type="llama3",
            ),
            rope_theta=500000.0,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            transformers_version="4.43.0.dev0",
            use_cache=True,
            vocab_size=128256,
        ),
        8_030_261_248,
    ),
    "Mistral-7B-v0.1": (
        dict(
            model_type="mistral",
            architectures=["MistralForCausalLM"],
            bos_token_id=1,
            eos_token_id=2,
            hidden_act="silu",
            hidden_size=4096,
            initializer_range=0.02,
            intermediate_size=14336,
            max_position_embeddings=32768,
            num_attention_heads=32,
            num_hidden_layers=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-05,
            rope_theta=10000.0,
            sliding_window=4096,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            transformers_version="4.34.0.dev0",
            use_cache=True,
            vocab_size=32000,
        ),
        7_241_732_096,
    ),
    "Qwen2.5-7B": (
        dict(
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            attention_dropout=0.0,
            bos_token_id=151643,
            eos_token_id=151643,
            hidden_act="silu",
            hidden_size=3584,
            initializer_range=0.02,
            intermediate_size=18944,
            max_position_embeddings=131072,
            max_window_layers=28,
            num_attention_heads=28,
            num_hidden_layers=28,
            num_key_value_heads=4,
            rms_norm_eps=1e-06,
            rope_theta=1000000.0,
            sliding_window=131072,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            transformers_version="4.43.1",
            use_cache=True,
            use_sliding_window=False,
            vocab_size=152064,
        ),
        7_615_616_512,
    ),
}


@pytest.mark.parametrize("name", RELEASED)
def test_released_configs_import_with_their_published_size(name):
    config, size = RELEASED[name]
    cfg = ModelConfig(**neox_model_keys(config))
    assert count_parameters(cfg, config["vocab_size"]) == size
    if name.startswith("Mistral"):
        assert cfg.sliding_window_width == 4095  # HF's 4096 keys include the query
    if name.startswith("Llama"):
        assert (
            cfg.shape.rope.rope_type == "llama3" and cfg.shape.rope.original_max_positions == 8192
        )

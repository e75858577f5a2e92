"""convert_from_hf: a random transformers model (one file or sharded, safetensors or .bin, any
dtype) -> neox checkpoint at any TP/PP -> HF again is byte-exact, with its family, tokenizer,
generation config and chat template; a finetune run through deepy.py starts from exactly those
weights and exports back as the family it came from."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from neox.checkpoint.consolidate import load_model, load_model_state
from neox.data.indexed import IndexedDatasetBuilder
from neox.hf.export import export_to_hf
from neox.hf.importer import HFImportError, convert_from_hf
from neox.model import lm_loss
from neox.plan.estimate import active_parameters, count_parameters
from tests.train_helpers import ROOT, losses, train, write_config

SIZES = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
GENERATION = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True, "temperature": 0.7}
# Files an HF directory holds besides the weights, given back byte for byte.
CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def random_hf_model(
    arch: str,
    tokenizer_json,
    out,
    max_shard_size=None,
    safe_serialization=True,
    dtype=torch.float32,
    **overrides,
):
    """A randomly initialised transformers model saved with the BPE tokenizer, a chat template
    and a generation config (no downloads); max_shard_size small gives several shards."""
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    if arch == "gpt_neox":
        config = GPTNeoXConfig(**SIZES, intermediate_size=64, rotary_pct=0.5, **overrides)
        model = GPTNeoXForCausalLM(config)
    else:
        config = LlamaConfig(**SIZES, intermediate_size=48, num_key_value_heads=2, **overrides)
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    if not safe_serialization:
        # transformers 5 writes only safetensors: the older PyTorch file, by hand.
        weights = Path(out) / "model.safetensors"
        torch.save(load_file(weights), Path(out) / "pytorch_model.bin")
        weights.unlink()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    (Path(out) / "generation_config.json").write_text(json.dumps(GENERATION, indent=1))
    return model.eval()


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files, whether one file or shards."""
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        out.update(load_file(directory / name))
    return out


def assert_same_tensors(back: dict, original: dict) -> None:
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


# name: (HF family, config overrides, tp, pp, how the HF files are saved)
CASES = {
    "neox_tp2": ("gpt_neox", dict(use_parallel_residual=True), 2, 1, {}),
    "neox_tied_pp2_bin": (
        "gpt_neox",
        dict(use_parallel_residual=False, tie_word_embeddings=True),
        1,
        2,
        dict(safe_serialization=False),
    ),
    "llama_sharded_tp1": ("llama", dict(), 1, 1, dict(max_shard_size="20KB")),
    "llama_sharded_tp2": ("llama", dict(), 2, 1, dict(max_shard_size="20KB")),
    "llama_sharded_pp2": ("llama", dict(), 1, 2, dict(max_shard_size="20KB")),
    "llama_gqa_tp2_pp2": ("llama", dict(), 2, 2, dict(max_shard_size="20KB")),
}


@pytest.mark.parametrize("case", CASES)
def test_hf_to_neox_to_hf_is_byte_exact(case, bpe_tokenizer, tmp_path):
    arch, overrides, tp, pp, saving = CASES[case]
    hf = random_hf_model(arch, bpe_tokenizer, tmp_path / "hf", **saving, **overrides)
    sharded = "max_shard_size" in saving
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == sharded
    config, note = convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=tp, pp=pp)
    assert note is None
    keys = yaml.safe_load(config.read_text())
    assert keys["model_parallel_size"] == tp and keys["finetune"] is True
    assert keys["hf_architecture"] == {"gpt_neox": "neox"}.get(arch, arch)

    # No --architecture: the family it came from; sharded again at a small size.
    export_to_hf(tmp_path / "neox", tmp_path / "back", max_shard_size="30KB" if sharded else "5GB")
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file() == sharded
    if saving.get("safe_serialization") is False:
        original = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    else:
        original = hf_weights(tmp_path / "hf")
    assert_same_tensors(hf_weights(tmp_path / "back"), original)
    for name in CARRIED:
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    back_config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_config["eos_token_id"] == hf.config.eos_token_id

    # The neox model of the checkpoint and the exported HF model compute the HF model's logits.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, _ = load_model(tmp_path / "neox")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(exported) is type(hf)
    tok = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template == CHAT_TEMPLATE
    assert exported.generation_config.temperature == 0.7
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids)[..., :320], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(exported(ids).logits, expected, rtol=0, atol=0)


def test_dtype_options(bpe_tokenizer, tmp_path):
    """bf16 files stay bf16 (auto) and come back byte-exact; --dtype casts them on the way."""
    random_hf_model(
        "llama", bpe_tokenizer, tmp_path / "hf", max_shard_size="20KB", dtype=torch.bfloat16
    )
    original = hf_weights(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "auto", tp=2)
    _, sd = load_model_state(tmp_path / "auto")
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    export_to_hf(tmp_path / "auto", tmp_path / "back", precision="bf16")
    assert_same_tensors(hf_weights(tmp_path / "back"), original)

    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        convert_from_hf(tmp_path / "hf", tmp_path / dtype, dtype=dtype)
        _, sd = load_model_state(tmp_path / dtype)
        assert {t.dtype for t in sd.values()} == {torch_dtype}
        export_to_hf(tmp_path / dtype, tmp_path / f"back-{dtype}", precision=dtype)
        cast = {k: v.to(torch_dtype) for k, v in original.items()}
        assert_same_tensors(hf_weights(tmp_path / f"back-{dtype}"), cast)
    with pytest.raises(HFImportError, match="dtype='int8' is not one of auto, fp32"):
        convert_from_hf(tmp_path / "hf", tmp_path / "int8", dtype="int8")
    assert not (tmp_path / "int8").exists()


def convert_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_from_hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
    )


def test_unsupported_hf_models_are_refused_before_writing(bpe_tokenizer, tmp_path, capsys):
    longrope = {
        "rope_type": "longrope",
        "factor": 2.0,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 16,
    }
    random_hf_model("llama", bpe_tokenizer, tmp_path / "hf", rope_scaling=longrope)
    with pytest.raises(HFImportError, match="rope_type='longrope'"):
        convert_from_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    # Fields neox does not know are named, each with its value, whatever else is wrong.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(attn_logit_softcapping=30.0, quantization_config={"quant_method": "gptq"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    r = convert_cli("--input_dir", tmp_path / "hf", "--output_dir", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown field attn_logit_softcapping=30.0 (neox does not know" in r.stderr
    assert "unknown field quantization_config={'quant_method': 'gptq'}" in r.stderr
    assert not (tmp_path / "out").exists()

    # The same exit in process (the tool's own process: the refusal above).
    from tools.convert_from_hf import main

    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 2
    assert (
        "has no config.json; pass a local Hugging Face model directory" in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def write_constant_dataset(prefix, doc: list[int]) -> None:
    """Documents all equal and seq_length tokens long: every training sample is the same."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for _ in range(40):
        builder.add_item(np.array(doc, dtype=np.uint16))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


@pytest.mark.slow
def test_finetune_from_import_then_export(bpe_tokenizer, tmp_path):
    """The one end-to-end run: import a sharded Llama at tp 2, train 10 steps on 2 ranks
    (train.py started from here, as deepy.py would: finetune: true) from exactly its weights,
    export without --architecture: transformers loads a Llama with the run's logits and the
    imported tokenizer files."""
    hf = random_hf_model("llama", bpe_tokenizer, tmp_path / "hf", max_shard_size="20KB")
    config, _ = convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=2)
    doc = torch.randint(1, 320, (31,), generator=torch.Generator().manual_seed(2)).tolist() + [0]
    (tmp_path / "data").mkdir()
    write_constant_dataset(tmp_path / "data" / "chars", doc)
    save = tmp_path / "finetune" / "ckpt"
    run = write_config(
        tmp_path,
        "finetune",
        train_iters=10,
        eval_interval=100,
        do_test=False,
        save=str(save),
        checkpoint_factor=10,
        num_gpus=2,
        model_parallel_size=2,
        seq_length=32,
        gpt_j_residual=False,  # write_config's default; model.yml leaves Llama's unset
    )
    train(run, config)
    sample = torch.tensor([doc + doc[:1]])
    with torch.no_grad():
        expected = lm_loss(hf(sample[:, :-1]).logits, sample[:, 1:]).item()
    trained = losses(tmp_path / "finetune" / "logs")
    assert trained[1] == pytest.approx(expected, rel=1e-5)
    assert trained[10] < trained[1]  # it trained

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_to_hf(save, tmp_path / "back")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(exported) is type(hf)
    assert AutoTokenizer.from_pretrained(tmp_path / "back").chat_template == CHAT_TEMPLATE
    ours, _ = load_model(save)
    with torch.no_grad():
        torch.testing.assert_close(
            exported(sample).logits, ours(sample)[..., :320], rtol=0, atol=1e-4
        )


# The real config.json of each shipped family config (public values, tests/hf/hf_configs).
SHIPPED = {
    "Llama-3.2-1B": "configs/llama3/1B.yml",
    "Llama-3.2-3B": "configs/llama3/3B.yml",
    "Llama-3.1-8B": "configs/llama3/8B.yml",
    "Mistral-7B-v0.1": "configs/mistral/7B.yml",
    "Qwen2.5-0.5B": "configs/qwen2.5/0-5B.yml",
    "Qwen2.5-7B": "configs/qwen2.5/7B.yml",
    "Qwen3-0.6B": "configs/qwen3/0-6B.yml",
    "Qwen3-8B": "configs/qwen3/8B.yml",
    "Mixtral-8x7B-v0.1": "configs/mixtral/8x7B.yml",
    "Qwen3-30B-A3B": "configs/qwen3/30B-A3B.yml",
    "OLMoE-1B-7B-0924": "configs/olmoe/1B-7B.yml",
}


@pytest.mark.parametrize("model", SHIPPED)
def test_shipped_config_is_what_importing_the_real_model_gives(model):
    """The shipped config has the keys convert_from_hf derives from the real config.json, and
    the real model's weights (transformers, on the meta device) pass the import's plan: every
    name converts and every shape fits the model the config builds; the estimate counts the real
    model's parameters, total and active (MoE: the router, top-k of E experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from neox.checkpoint.consolidate import check_state_dict
    from neox.config import load_config
    from neox.hf.importer import neox_model_keys, without_neutral_values
    from neox.hf.mapping import from_hf_state_dict
    from neox.model import build_model

    hf = json.loads((Path(__file__).parent / "hf_configs" / f"{model}.json").read_text())
    shipped = yaml.safe_load((ROOT / SHIPPED[model]).read_text())
    keys = neox_model_keys(without_neutral_values(hf))
    keys.pop("seq_length")  # the shipped file trains at a shorter context
    assert {k: shipped.get(k) for k in keys} == keys
    assert shipped["padded_vocab_size"] == hf["vocab_size"]

    cfg = load_config([str(ROOT / SHIPPED[model])]).config
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **fields))
    sd = from_hf_state_dict(real.state_dict(), cfg.model, hf["vocab_size"], hf["model_type"])
    ours = build_model(cfg.model, hf["vocab_size"], device="meta")
    check_state_dict(sd, ours, Path(model))
    assert sum(p.numel() for p in ours.parameters()) == real.num_parameters()
    # The estimate's total, and its active count: all but the experts a token is not sent to.
    assert count_parameters(cfg.model, hf["vocab_size"]) == real.num_parameters()
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    top_k, num = hf.get("num_experts_per_tok", 1), cfg.model.moe_num_experts
    active = real.num_parameters() - experts + experts * top_k // num
    assert active_parameters(cfg.model, hf["vocab_size"]) == active


# Every family of tests/hf_family_helpers.py through the files, each at a layout its heads allow.
FAMILY_LAYOUTS = {
    "gpt_neox_partial_dynamic_untied": (2, 2),
    "llama3_gqa": (2, 2),
    "llama_linear_biases_tied": (2, 1),
    "llama_dynamic_mqa": (1, 2),  # one kv head: no tp
    "mistral_window": (2, 1),
    "qwen2_window_yarn_tied": (2, 2),
    "qwen3_qknorm_head_dim_yarn": (2, 1),
    "qwen3_window_linear_tied": (1, 2),
    "mixtral_window_experts": (2, 1),  # MoE: no pipeline (moe.py)
    "qwen3_moe_qknorm_unnormalised_tied": (2, 1),
    "qwen2_moe_shared_expert": (2, 1),
    "olmoe_projection_qknorm": (1, 1),  # a norm over all heads: no tp
}


@pytest.mark.parametrize("name", FAMILY_LAYOUTS)
def test_every_family_round_trips_through_sharded_files(name, tmp_path):
    """A sharded HF directory of each family (no tokenizer neox can build) -> neox files at
    tp/pp -> export without --architecture: the same tensors, the same family, the same
    logits past every window and original RoPE length."""
    from transformers import AutoModelForCausalLM

    from tests.hf_family_helpers import FAMILIES, VOCAB, hf_model, token_ids

    assert set(FAMILY_LAYOUTS) == set(FAMILIES)
    tp, pp = FAMILY_LAYOUTS[name]
    arch, _, hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    _, note = convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=tp, pp=pp)
    assert "no tokenizer keys written" in note
    export_to_hf(tmp_path / "neox", tmp_path / "back", max_shard_size="30KB")
    assert_same_tensors(hf_weights(tmp_path / "back"), hf_weights(tmp_path / "hf"))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == arch and back["vocab_size"] == VOCAB

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert type(exported) is type(hf)
    ours, _ = load_model(tmp_path / "neox")
    ids = token_ids()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(exported.eval()(ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(ours(ids)[..., :VOCAB], expected, rtol=0, atol=1e-4)


def test_a_layout_the_model_cannot_take_is_refused_before_writing(tmp_path):
    """OLMoE's q/k norms span all heads: tensor parallelism is refused by name, nothing written."""
    from tests.hf_family_helpers import hf_model

    _, _, hf = hf_model("olmoe_projection_qknorm")
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(HFImportError, match="qk_layernorm_scope=projection with model_parallel"):
        convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=2)
    assert not (tmp_path / "neox").exists()


def test_untied_model_without_a_head_in_the_files_starts_from_the_embedding(tmp_path):
    """Converted one tensor at a time, the head still comes out as from_hf_state_dict makes it
    from a whole state dict: a copy of the embedding when the files hold no head."""
    from safetensors.torch import save_file

    from tests.hf_family_helpers import hf_model

    _, _, hf = hf_model("llama3_gqa")  # untied
    hf.save_pretrained(tmp_path / "hf")
    files = tmp_path / "hf" / "model.safetensors"
    weights = {k: v for k, v in load_file(files).items() if k != "lm_head.weight"}
    save_file(weights, str(files), metadata={"format": "pt"})
    convert_from_hf(tmp_path / "hf", tmp_path / "neox", tp=2)
    _, sd = load_model_state(tmp_path / "neox")
    assert torch.equal(sd["embed_out.weight"], sd["embed_in.weight"])
    assert torch.equal(sd["embed_in.weight"][:100], weights["model.embed_tokens.weight"])

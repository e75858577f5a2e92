"""LoRA runs on 2 CPU ranks: adapter-only checkpoints that name their base, exact resume, and
generate/eval/export reading the base through that reference."""

import json
import shutil

import pytest
import torch

from neox.adapters.base_record import REFERENCE_FILE, manifest_sha256
from neox.checkpoint.consolidate import load_model, load_model_state
from neox.checkpoint.plain_state import PlainState, plain_state_dict
from tests.train_helpers import losses, make_dataset, train, write_config

pytestmark = pytest.mark.slow

LORA = dict(lora_rank=4, lora_alpha=8.0, optimizer={"type": "Adam", "params": {"lr": 1.0e-2}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base trained 3 steps; LoRA on it for 6 steps, uninterrupted and stopped at 3 + resumed."""
    tmp = tmp_path_factory.mktemp("lora")
    make_dataset(tmp / "data" / "chars")
    train(write_config(tmp, "base", train_iters=3))
    base = str(tmp / "base" / "ckpt")
    train(write_config(tmp, "full", lora_base=base, **LORA))
    train(write_config(tmp, "part", lora_base=base, exit_interval=3, **LORA))
    shutil.copytree(tmp / "part" / "ckpt", tmp / "part3")
    r = train(write_config(tmp, "part", lora_base=base, **LORA))
    assert "resuming from" in r.stdout
    # The same at tp=2 (DeepSpeed's engine; same global batch), stopped at 3 and resumed.
    tp2 = dict(LORA, model_parallel_size=2, gradient_accumulation_steps=4, lora_base=base)
    train(write_config(tmp, "tp2", exit_interval=3, **tp2))
    train(write_config(tmp, "tp2", **tp2))
    return tmp


def test_resumed_lora_run_logs_the_losses_of_an_uninterrupted_one(runs):
    full, part = losses(runs / "full" / "logs"), losses(runs / "part" / "logs")
    assert sorted(full) == sorted(part) == [1, 2, 3, 4, 5, 6]
    for step in full:
        assert part[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step


def test_tp2_lora_run_resumes_and_matches_the_data_parallel_one(runs):
    """DeepSpeed's engine saves the adapters alone and resumes them; the tp=2 run's losses are
    the dp=2 run's (same base, adapters, global batch), and its checkpoint consolidates."""
    dp, tp = losses(runs / "full" / "logs"), losses(runs / "tp2" / "logs")
    assert sorted(tp) == [1, 2, 3, 4, 5, 6]
    for step in dp:
        assert tp[step] == pytest.approx(dp[step], rel=1e-4), step
    saved = PlainState(runs / "tp2" / "ckpt" / "global_step6").entries
    assert saved and all(".lora_" in k for k in saved)
    _, merged_tp = load_model_state(runs / "tp2" / "ckpt")
    _, merged_dp = load_model_state(runs / "full" / "ckpt")
    for k in merged_dp:
        torch.testing.assert_close(merged_tp[k], merged_dp[k], rtol=1e-3, atol=1e-4, msg=k)


def test_checkpoint_holds_the_adapters_alone_and_names_its_base(runs):
    step = runs / "full" / "ckpt" / "global_step6"
    module = plain_state_dict(step)
    assert module and all(".lora_A." in k or ".lora_B." in k for k in module)
    # 2 layers x 4 targets x (A, B)
    assert len(module) == 16
    ref = json.loads((step / REFERENCE_FILE).read_text())
    base = runs / "base" / "ckpt" / "global_step3"
    assert ref["base"] == str(base.resolve())
    assert ref["manifest_sha256"] == manifest_sha256(base)
    # The optimizer's state is the adapters' alone: their fp32 masters and both moments.
    kinds = {}
    for key in PlainState(step).entries:
        kind, _, name = key.partition("/")
        kinds.setdefault(kind, set()).add(name)
    assert kinds == {k: set(module) for k in ("fp32", "exp_avg", "exp_avg_sq")}


def test_load_model_applies_the_adapter_onto_the_base(runs):
    _, base = load_model_state(runs / "base" / "ckpt")
    cfg, merged = load_model_state(runs / "full" / "ckpt")
    assert cfg.lora.lora_rank == 4 and merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(".weight") for k in changed)
    assert all(any(t in k for t in ("query_key_value", "dense")) for k in changed)
    model, _ = load_model(runs / "full" / "ckpt")
    assert not any(".lora_" in k for k in model.state_dict())


def test_a_changed_base_is_refused(runs):
    from neox.checkpoint.errors import CheckpointError
    from neox.checkpoint.manifest import MANIFEST

    manifest = runs / "base" / "ckpt" / "global_step3" / MANIFEST
    original = manifest.read_bytes()
    manifest.write_bytes(original + b"\n")  # any rewrite of the base changes its manifest
    try:
        with pytest.raises(CheckpointError, match="the base changed"):
            load_model_state(runs / "full" / "ckpt")
    finally:
        manifest.write_bytes(original)


def neox_lora_model(ckpt):
    """The LoRA model as training runs it: the base with live (unmerged) adapters, fp32."""
    from neox.checkpoint.consolidate import (
        read_checkpoint_config,
        read_lora_checkpoint,
        resolve_checkpoint,
    )
    from neox.model import build_model
    from neox.model.transforms.lora import apply_lora

    tag_dir = resolve_checkpoint(ckpt)
    cfg = read_checkpoint_config(tag_dir)
    base, adapters = read_lora_checkpoint(tag_dir, cfg)
    model = build_model(cfg.model, base["embed_in.weight"].shape[0], device="meta")
    model.load_state_dict(base, assign=True)
    apply_lora(model, cfg.lora)
    missing = model.load_state_dict(adapters, strict=False).missing_keys
    assert not any(".lora_" in k for k in missing)
    return model.float().eval(), cfg


def test_exports_merged_and_peft_give_the_lora_models_logits(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from neox.hf.export import export_to_hf
    from neox.tokenizer import build_tokenizer

    ckpt = runs / "full" / "ckpt"
    model, cfg = neox_lora_model(ckpt)
    vocab = build_tokenizer(cfg.tokenizer.tokenizer_type).vocab_size
    ids = torch.randint(1, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[..., :vocab]
        base_model, _ = load_model(runs / "base" / "ckpt", dtype=torch.float32)
        assert (ours - base_model(ids)[..., :vocab]).abs().max() > 1e-3  # the adapter matters

    export_to_hf(ckpt, tmp_path / "merged", precision="fp32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        theirs = merged.eval()(ids).logits[..., :vocab]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    export_to_hf(ckpt, tmp_path / "peft", precision="fp32", lora_format="peft")
    adapter = tmp_path / "peft" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    )
    base_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "peft", dtype=torch.float32)
    with torch.no_grad():
        # The directory's own model is the base; the adapter loads onto it through peft.
        plain = base_hf.eval()(ids).logits[..., :vocab]
        torch.testing.assert_close(plain, base_model(ids)[..., :vocab], rtol=0, atol=1e-4)
        peft_model = PeftModel.from_pretrained(base_hf, str(adapter)).eval()
        theirs = peft_model(ids).logits[..., :vocab]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_a_peft_export_of_an_import_names_the_imported_base(runs, tmp_path):
    """An adapter on an imported model (hf_source, exported as the family it came from) names
    that model as its base_model_name_or_path, not the export's own directory, so it can be
    shared alone; without a source, the export's directory, which holds the base."""
    import yaml

    from neox.hf.export import export_to_hf

    ckpt = runs / "full" / "ckpt"
    saved = yaml.safe_load((ckpt / (ckpt / "latest").read_text() / "config.yml").read_text())
    imported = tmp_path / "imported.yml"
    source = {"hf_architecture": "neox", "hf_source": "EleutherAI/pythia-14m"}
    imported.write_text(yaml.safe_dump({**saved, **source}))
    for name, config_file, base in (
        ("imported", imported, "EleutherAI/pythia-14m"),
        ("own", None, str((tmp_path / "own").resolve())),
    ):
        export_to_hf(ckpt, tmp_path / name, lora_format="peft", config_file=config_file)
        adapter = json.loads((tmp_path / name / "adapter" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == base


def test_convert_to_hf_verifies_a_peft_export(runs, tmp_path):
    from tools.convert_to_hf import main

    out = tmp_path / "hf"
    main(
        [
            "--input_dir",
            str(runs / "full" / "ckpt"),
            "--output_dir",
            str(out),
            "--lora_format",
            "peft",
            "--verify",
        ]
    )
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    with pytest.raises(SystemExit):
        main(
            [
                "--input_dir",
                str(runs / "base" / "ckpt"),
                "--output_dir",
                str(tmp_path / "x"),
                "--lora_format",
                "peft",
            ]
        )


def test_peft_adapter_for_llama_splits_the_fused_qkv(tmp_path):
    """A Llama-style model (GQA, gated MLP): the adapter on our fused query_key_value becomes
    q/k/v_proj adapters sharing A, and `gate` becomes gate_proj; peft's logits are ours."""
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from neox.config import NeoXConfig
    from neox.hf.export import write_peft_adapter
    from neox.hf.mapping import hf_config_for, to_hf_state_dict, to_peft_state_dict
    from neox.model import build_model
    from neox.model.transforms.lora import apply_lora

    flat = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        seq_length=16,
        max_position_embeddings=16,
        norm="rmsnorm",
        activation="swiglu",
        intermediate_size=96,
        pos_emb="rotary",
        rotary_pct=1.0,
        no_weight_tying=True,
        use_bias_in_attn_linear=False,
        use_bias_in_mlp=False,
        use_bias_in_norms=False,
        lora_rank=4,
        lora_alpha=6.0,
        lora_target_modules=["qkv", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    cfg = NeoXConfig.from_flat(flat)
    vocab = 64
    model = build_model(cfg.model, vocab, seed=5)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, cfg.lora, None, seed=5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)

    hf = LlamaForCausalLM(LlamaConfig(**hf_config_for(cfg.model, vocab, "llama")))
    hf.load_state_dict(to_hf_state_dict(base, cfg.model, vocab, "llama"), strict=True)
    hf.save_pretrained(tmp_path / "base")
    peft_sd = to_peft_state_dict(adapters, cfg.model, "llama")
    write_peft_adapter(tmp_path / "adapter", peft_sd, cfg, str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    loaded = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        str(tmp_path / "adapter"),
    ).eval()
    with torch.no_grad():
        theirs = loaded(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

"""neox/model/transforms/float8.py on CPU: which linears FP8 takes, the torchao settings the config and
gpt-neox's te_* keys map to, that nothing else of the model changes (names, dtypes: checkpoints
and export stay as in bf16), torchao's emulated float8 training beside bf16 at tp=1 and tp=2,
and the refusals before launch where there is no float8 hardware. Real float8 matmuls:
tests/model/transforms/test_float8_gpu.py."""

import json

import pytest
import torch

pytest.importorskip("torchao.float8")

from neox.config import derive, load_dict  # noqa: E402
from neox.config.errors import ConfigError  # noqa: E402
from neox.model import build_model, lm_loss  # noqa: E402
from neox.model.transforms.float8 import apply_float8, module_filter, torchao_config  # noqa: E402
from tests.parallel.rank_helpers import run_ranks  # noqa: E402

PYTHIA = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
)
LLAMA = dict(
    PYTHIA,
    norm="rmsnorm",
    activation="swiglu",
    gpt_j_residual=False,
    num_kv_heads=2,
    intermediate_size=192,
)
BLOCK = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def fp8_config(model=PYTHIA, **fp8):
    return load_dict({**model, "bf16": {"enabled": True}, "fp8": {"enabled": True, **fp8}})


def converted(cfg, vocab=512):
    model = build_model(cfg.model, vocab, seed=0).to(torch.bfloat16)
    names = apply_float8(model, cfg.float8.resolved(), cfg.model.num_layers, "cpu", emulate=True)
    return model, names


def test_default_keeps_first_and_last_blocks_embedding_and_head_in_bf16():
    from torchao.float8.float8_linear import Float8Linear

    model, names = converted(fp8_config())
    assert names == [f"layers.{i}.{m}" for i in (1, 2) for m in BLOCK]
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert float8 == set(names)
    assert not isinstance(model.embed_in, Float8Linear) and model.embed_out is None


def test_filter_takes_the_named_modules_and_layers_and_the_gate():
    _, names = converted(
        fp8_config(LLAMA, modules=["mlp.gate", "attention.dense"], skip_first_layers=0)
    )
    assert names == [f"layers.{i}.{m}" for i in (0, 1, 2) for m in ("attention.dense", "mlp.gate")]
    _, names = converted(fp8_config(skip_first_layers=0, skip_last_layers=0))
    assert len(names) == 4 * len(BLOCK)
    _, names = converted(fp8_config(skip_first_layers=3, skip_last_layers=2))
    assert names == []


def test_filter_skips_linears_float8_matmuls_cannot_take():
    """torch._scaled_mm needs both weight dimensions divisible by 16: 40 wide is left out."""
    cfg = fp8_config()
    keep = module_filter(cfg.float8.resolved(), 4)
    assert keep(torch.nn.Linear(64, 192), "layers.1.attention.query_key_value")
    assert not keep(torch.nn.Linear(40, 64), "layers.1.attention.dense")
    assert not keep(torch.nn.Linear(64, 64), "layers.1.attention.other")
    assert not keep(torch.nn.Linear(64, 512), "embed_out")


def test_state_dict_names_and_dtypes_do_not_change_and_training_matches_bf16():
    cfg = fp8_config(skip_first_layers=0, skip_last_layers=0)
    ref = build_model(cfg.model, 512, seed=0).to(torch.bfloat16)
    model, names = converted(cfg)
    assert names
    want = ref.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32).expand_as(ids)
    losses = []
    for m in (ref, model):
        loss = lm_loss(m(ids, pos), ids)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    # Every weight gets a gradient of the bf16 one's size and direction.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        cos = torch.nn.functional.cosine_similarity(
            p.grad.flatten().float(), q.grad.flatten().float(), 0
        )
        assert cos > 0.98, (name, cos)


def test_recipes_and_te_keys_map_onto_torchao():
    from torchao.float8.config import ScalingGranularity, ScalingType

    tensorwise = torchao_config(fp8_config().float8.resolved())
    assert tensorwise.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    assert tensorwise.cast_config_grad_output.target_dtype == torch.float8_e5m2  # hybrid
    rowwise = torchao_config(fp8_config(recipe="rowwise").float8.resolved())
    assert rowwise.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    assert rowwise.cast_config_grad_output.target_dtype == torch.float8_e4m3fn

    te = load_dict(
        {
            **PYTHIA,
            "fp8": {"enabled": True},
            "te_fp8_format": "e4m3",
            "te_fp8_wgrad": False,
            "te_fp8_amax_history_len": 1,
            "te_fp8_amax_compute_algo": "max",
            "te_fp8_margin": 0,
            "te_fp8_mha": False,
        }
    )
    spec = te.float8.resolved()
    assert (spec.format, spec.wgrad) == ("e4m3", False)
    c = torchao_config(spec)
    assert c.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert c.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert c.cast_config_grad_output_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert c.cast_config_input.scaling_type is ScalingType.DYNAMIC  # forward stays float8
    assert load_dict({"te_fp8_format": "e4m3"}).float8.resolved() is None  # fp8 off


def test_output_layer_takes_a_float8_matmul_on_request_tied_or_not():
    """fp8.output_layer: the head's matmul (not a module) computes in float8, the weights and
    their names stay; the logits and the head's gradient follow the bf16 model's."""
    from neox.model.transforms.float8 import Float8Matmul

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    for untied in (False, True):
        model_cfg = {**PYTHIA, "no_weight_tying": untied}
        cfg = fp8_config(model_cfg, output_layer=True, skip_first_layers=0, skip_last_layers=0)
        model, names = converted(cfg)
        assert names[-1] == "head" and len(names) == 4 * len(BLOCK) + 1
        assert isinstance(model.head_linear, Float8Matmul)
        ref = build_model(cfg.model, 512, seed=0).to(torch.bfloat16)
        assert list(model.state_dict()) == list(ref.state_dict())
        only_blocks, _ = converted(fp8_config(model_cfg, skip_first_layers=0, skip_last_layers=0))
        assert only_blocks.head_linear is None  # off by default: F.linear at each call
        with torch.no_grad():
            a, b = model(ids).float(), only_blocks(ids).float()
        assert not torch.equal(a, b)  # the head's float8 rounding shows
        assert torch.allclose(a, b, atol=0.1, rtol=0.1)
        for m in (model, ref):
            lm_loss(m(ids), ids).backward()
        head = model.head_weight().grad.float().flatten()
        cos = torch.nn.functional.cosine_similarity(
            head, ref.head_weight().grad.float().flatten(), 0
        )
        assert cos > 0.98


def test_float8_head_and_blocks_compile_as_one_graph_each():
    """The float8 casts run inside the compiled graphs (a block's, the loss's), not in eager
    code between them: no graph break around torchao's matmul (aot_eager: the same capture
    inductor gets, without code generation)."""
    cfg = fp8_config(output_layer=True)
    model, _ = converted(cfg)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    x = model.embed(ids)
    pos = torch.arange(32).expand_as(ids)
    torch._dynamo.reset()
    block = torch._dynamo.explain(model.layers[1].forward)(x, pos, None, None)
    loss = torch._dynamo.explain(model.loss)(x, ids)
    assert (block.graph_count, block.graph_break_count) == (1, 0)
    assert (loss.graph_count, loss.graph_break_count) == (1, 0)
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    assert compiled(x, ids).item() == pytest.approx(model.loss(x, ids).item(), rel=1e-3)
    torch._dynamo.reset()


def test_fast_accum_backward_maps_onto_the_gradient_matmuls():
    default = torchao_config(fp8_config().float8.resolved())
    fast = torchao_config(fp8_config(fast_accum_backward=True).float8.resolved())
    assert default.gemm_config_output.use_fast_accum and fast.gemm_config_output.use_fast_accum
    assert not default.gemm_config_grad_input.use_fast_accum
    assert not default.gemm_config_grad_weight.use_fast_accum
    assert (
        fast.gemm_config_grad_input.use_fast_accum and fast.gemm_config_grad_weight.use_fast_accum
    )
    model, _ = converted(fp8_config(fast_accum_backward=True))
    mm = model.layers[1].attention.dense.linear_mm_config
    assert mm.grad_input.use_fast_accum and mm.grad_weight.use_fast_accum


@pytest.mark.parametrize(
    "flat, words",
    [
        ({"te_fp8_amax_history_len": 16}, "te_fp8_amax_history_len=16"),
        ({"te_fp8_margin": 2}, "te_fp8_margin=2"),
        ({"te_fp8_mha": True}, "te_fp8_mha=True"),
        ({"te_columnparallel": True}, "te_columnparallel=True"),
        ({"fp8": {"enabled": True, "format": "hybrid"}, "te_fp8_format": "e4m3"}, "te_fp8_format"),
        ({"fp8": {"enabled": True, "modules": []}}, "fp8.modules"),
    ],
)
def test_te_keys_without_a_torchao_meaning_are_refused_by_name(flat, words):
    with pytest.raises(ConfigError, match=words):
        load_dict(flat)


def test_runs_float8_cannot_take_are_refused_before_launch():
    with pytest.raises(ConfigError, match="fp8.enabled with pipe_parallel_size=2"):
        flat = {
            **PYTHIA,
            "fp8": {"enabled": True},
            "pipe_parallel_size": 2,
            "bf16": {"enabled": True},
        }
        derive(load_dict(flat), 2)
    with pytest.raises(ConfigError, match="fp8.enabled with fp16"):
        derive(load_dict({**PYTHIA, "fp8": {"enabled": True}, "fp16": {"enabled": True}}), 1)
    with pytest.raises(ConfigError, match="fp8.output_layer with lm_loss_chunk_size=16"):
        fp8 = {"enabled": True, "output_layer": True}
        derive(load_dict({**PYTHIA, "fp8": fp8, "lm_loss_chunk_size": 16}), 1)
    derive(load_dict({**PYTHIA, "fp8": {"enabled": True}, "lm_loss_chunk_size": 16}), 1)


def test_cpu_ranks_are_refused_naming_the_key(tmp_path):
    from neox.config import load_config
    from neox.plan.preflight import fp8_problem

    path = tmp_path / "fp8.yml"
    path.write_text("fp8: {enabled: true}\n")
    loaded = load_config([str(path)])
    problem = fp8_problem(loaded, cpu_ranks=True)
    assert problem and "fp8.enabled" in problem and str(path) in problem
    assert fp8_problem(load_config([str(tmp_path / "fp8.yml")]), cpu_ranks=True)
    path.write_text("fp8: {enabled: false}\n")
    assert fp8_problem(load_config([str(path)]), cpu_ranks=True) is None
    # A rank on a device without float8 matmuls stops before building its engine.
    model = build_model(fp8_config().model, 512, seed=0)
    with pytest.raises(RuntimeError, match="fp8.enabled needs a GPU"):
        apply_float8(model, fp8_config().float8.resolved(), 4, "cpu")


@pytest.mark.slow
def test_tensor_parallel_linears_compute_in_float8(tmp_path):
    """At tp=2 the column/row-parallel linears keep their class and collectives and take the
    float8 matmul, as does the vocab-split output layer (fp8.output_layer); the loss is the
    tp=1 bf16 model's within float8's rounding (tensorwise scales are per shard)."""
    from tests.model.transforms.float8_helpers import tp_float8

    fp8 = {"enabled": True, "output_layer": True}
    flat = {**PYTHIA, "fp8": fp8, "padded_vocab_size": 512}
    flat["tokenizer_type"] = "CharLevelTokenizer"
    out = tmp_path / "tp.json"
    run_ranks(tp_float8, 2, flat, str(out))
    tp2 = json.loads(out.read_text())
    run_ranks(tp_float8, 1, {**flat, "fp8": {"enabled": False}}, str(out))
    dense = json.loads(out.read_text())
    assert tp2["float8"] == sorted(f"layers.{i}.{m}" for i in (1, 2) for m in BLOCK)
    assert tp2["converted"][-1] == "head" and tp2["float8_head"] and not dense["float8_head"]
    assert sorted(tp2["converted"][:-1]) == tp2["float8"] and dense["converted"] == []
    assert tp2["same_state"] and tp2["grads"]
    assert tp2["loss"] == pytest.approx(dense["loss"], rel=2e-2)

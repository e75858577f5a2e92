"""Speed options on GPUs through deepy.py give the loss curve of DeepSpeed's eager engine: the
defaults (the flat engine with its Triton AdamW, compiled blocks and loss), the chunked loss,
and compiled blocks under tensor parallelism (TP=2, 2 GPUs)."""

import pytest

from tests.train_helpers import SHORT_RUN, TWO_GPUS, losses, make_dataset, run_deepy, write_config

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

COMMON = dict(SHORT_RUN, distributed_backend="nccl", train_iters=10, num_gpus=1)
EAGER_DEEPSPEED = dict(flat_engine=False, torch_compile=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speed_gpu")
    make_dataset(tmp / "data" / "chars")
    return tmp


BF16 = {"bf16": {"enabled": True}}


def curve(data, name: str, **options) -> dict[int, float]:
    run_deepy("train.py", write_config(data, name, **{**COMMON, **options}), cpu=False)
    return losses(data / name / "logs")


@pytest.fixture(scope="module")
def bf16_reference(data):
    return curve(data, "bf16_ref", **BF16, **EAGER_DEEPSPEED)


@pytest.mark.parametrize("option", [{}, {"lm_loss_chunk_size": 16}], ids=["defaults", "chunked"])
def test_bf16_speed_options_follow_deepspeeds_eager_curve(data, bf16_reference, option):
    ref = bf16_reference
    got = curve(data, "bf16_" + ("_".join(option) or "defaults"), **BF16, **option)
    assert sorted(got) == sorted(ref)
    for step in ref:  # bf16 rounds differently in fused and unfused kernels
        assert got[step] == pytest.approx(ref[step], rel=2e-2), (step, got, ref)


@TWO_GPUS
def test_compiled_blocks_under_tensor_parallelism_follow_one_eager_gpu(data):
    ref = curve(data, "fp32_ref", **EAGER_DEEPSPEED)
    got = curve(data, "fp32_tp2_compiled", num_gpus=2, model_parallel_size=2, torch_compile=True)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-3), (step, got, ref)

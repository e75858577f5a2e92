"""neox/plan/preflight.py: what deepy.py checks on disk before launch, from headers and sizes."""

import sys

import pytest

from neox.config import ConfigError, load_config
from neox.plan.preflight import (
    check_data,
    check_script,
    check_tokenizer_files,
    checkpoint_problem,
    drawn_splits,
    empty_path_problems,
    optional_package_problems,
    precision_problem,
    preflight,
    split_problems,
)
from tests.train_helpers import make_dataset


def loaded(tmp_path, text: str):
    path = tmp_path / "run.yml"
    path.write_text(text)
    return load_config([path])


def test_a_short_bin_is_named_with_its_key_and_file(tmp_path):
    make_dataset(tmp_path / "chars")
    cfg = loaded(tmp_path, f"data_path: {tmp_path}/chars\n")
    check_data(cfg)  # intact: nothing to say
    bin_file = tmp_path / "chars.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-10])
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert "run.yml: data_path=" in message and "chars.bin" in message, message


def test_missing_halves_of_a_dataset_are_named(tmp_path):
    make_dataset(tmp_path / "a")
    (tmp_path / "a.idx").unlink()
    cfg = loaded(tmp_path, f"train_data_paths: [{tmp_path}/a, {tmp_path}/b]\n")
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert f"{tmp_path}/a.idx not found" in message
    assert f"{tmp_path}/b.bin and {tmp_path}/b.idx not found" in message
    assert "tools/preprocess_data.py" in message


def test_a_label_dataset_must_match_its_text_dataset(tmp_path):
    make_dataset(tmp_path / "text", docs=20, seed=0)
    make_dataset(tmp_path / "same", docs=20, seed=0)  # same lengths, but uint16: no -100
    make_dataset(tmp_path / "other", docs=20, seed=1)
    data = f"train_data_paths: [{tmp_path}/text]\nvalid_data_paths: [{tmp_path}/text]\n"
    cfg = loaded(tmp_path, data + f"train_label_data_paths: [{tmp_path}/other]\n")
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert "run.yml: train_label_data_paths (of train_data_paths=" in message, message
    assert f"{tmp_path}/other.bin/.idx does not match its text dataset {tmp_path}/text" in message
    assert "document 0 has" in message
    cfg = loaded(tmp_path, data + f"train_label_data_paths: [{tmp_path}/same]\n")
    with pytest.raises(ConfigError, match="cannot be -100"):
        check_data(cfg)
    with pytest.raises(ConfigError, match="label dataset per data path"):
        loaded(tmp_path, data + f"valid_label_data_paths: [{tmp_path}/a, {tmp_path}/b]\n")
    with pytest.raises(ConfigError, match="label dataset of data_path, which is not set"):
        loaded(tmp_path, data + f"label_data_paths: [{tmp_path}/other]\n")


def test_missing_entry_script_and_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match="entry script 'nope.py' does not exist"):
        check_script("nope.py")
    cfg = loaded(tmp_path, f"tokenizer_type: GPT2BPETokenizer\nvocab_file: {tmp_path}/v.json\n")
    with pytest.raises(ConfigError) as e:
        check_tokenizer_files(cfg)
    assert "vocab_file=" in str(e.value) and "does not exist" in str(e.value)
    assert "needs merge_file" in str(e.value)


def test_preflight_collects_every_problem_at_once(tmp_path):
    cfg = loaded(tmp_path, f"data_path: {tmp_path}/none\nvocab_file: {tmp_path}/v.json\n")
    _, problems = preflight(cfg, "train.py")
    text = "\n".join(problems)
    assert "none.bin and" in text and "v.json" in text, text


def test_checkpoint_problem_names_what_is_missing(tmp_path):
    assert checkpoint_problem(None).startswith("no trained weights")
    assert "holds no checkpoint (no `latest` file)" in checkpoint_problem(str(tmp_path))
    (tmp_path / "global_step3").mkdir()
    assert "(it has global_step3)" in checkpoint_problem(str(tmp_path), iteration=5)
    assert checkpoint_problem(str(tmp_path), iteration=3) is None


def test_split_problems_name_the_empty_split_a_run_needs(tmp_path):
    make_dataset(tmp_path / "chars", docs=10)
    cfg = loaded(tmp_path, f"data_path: {tmp_path}/chars\nsplit: '98,1,1'\n")
    # 10 documents: valid and test round to none.
    problems = split_problems(cfg, drawn_splits((100, 20, 20)))
    assert len(problems) == 2, problems
    assert "run.yml: split='98,1,1' gives the valid split no documents" in problems[0]
    assert (
        "(train/valid/test get 10/0/0 of the 10" in problems[0] and "eval_iters: 0" in problems[0]
    )
    assert "gives the test split no documents" in problems[1] and "do_test: false" in problems[1]
    # No samples drawn from an empty split (eval_iters: 0, do_test: false): nothing to say.
    assert split_problems(cfg, drawn_splits((100, 0, 0))) == []
    assert split_problems(loaded(tmp_path, "data_path: null\n"), drawn_splits((1, 1, 1))) == []
    # eval.py's eval_split reads one split: an empty one would score no text at all.
    problems = split_problems(cfg, {"test": "eval_split='test' evaluates it"})
    assert "gives the test split no documents" in problems[0]
    assert "but eval_split='test' evaluates it" in problems[0]


def test_split_problems_cut_documents_as_the_loader_does(tmp_path):
    """deepy's count and the loader's ranges come from one function: checked on many splits."""
    from neox.config.data import split_ranges
    from neox.data.loader import split_documents

    for split in ("949,50,1", "1,1,1", "900,80,20", "2/1", "0.5,0.25,0.25", "1,0,0", "7"):
        for n in (0, 1, 2, 3, 7, 10, 59, 60, 1000):
            assert [b - a for a, b in split_ranges(split, n)] == [
                r.size for r in split_documents(split, n)
            ]


def test_empty_save_and_load_paths_are_problems(tmp_path):
    problems = empty_path_problems(loaded(tmp_path, "save: ''\nload: ' '\n"))
    assert len(problems) == 2
    assert "run.yml: save='' is an empty path" in problems[0]
    assert "load=' ' is an empty path, which would silently start from scratch" in problems[1]
    assert empty_path_problems(loaded(tmp_path, "save: null\n")) == []


def test_missing_optional_package_is_named_with_its_extra(tmp_path, monkeypatch):
    cfg = loaded(tmp_path, "use_wandb: true\ntokenizer_type: HFGPT2Tokenizer\n")
    assert optional_package_problems(cfg, "train.py") == []  # installed here
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    problems = optional_package_problems(cfg, "train.py")
    assert problems[0].endswith(
        "/run.yml: use_wandb=True needs the wandb package, not installed here: pip install "
        "'neox[wandb]' (or set use_wandb: false)"
    )
    assert "tokenizer_type=HFGPT2Tokenizer needs the transformers package" in problems[1]
    # generate.py never starts wandb: only the tokenizer's package matters there.
    assert len(optional_package_problems(cfg, "generate.py")) == 1


def test_fp16_is_a_problem_only_on_cpu_ranks_without_it(tmp_path):
    import torch

    cfg = loaded(tmp_path, "fp16: {enabled: true}\n")
    assert precision_problem(cfg, "fp16", cpu_ranks=False) is None
    assert precision_problem(cfg, "bf16", cpu_ranks=True) is None
    problem = precision_problem(cfg, "fp16", cpu_ranks=True)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert problem is None
    else:
        assert "run.yml: precision fp16" in problem and "configs/cpu.yml" in problem


def test_fit_refusal_only_past_twice_the_memory_and_only_without_the_override():
    from pathlib import Path

    from neox.config import derive, load_dict
    from neox.plan.memory import GiB, estimate_memory, training_shape
    from neox.plan.report import fit_refusal

    root = Path(__file__).resolve().parents[2]
    cfg = load_config([root / "configs/pythia/1-4B.yml"]).config
    derived = derive(cfg, 8, 50277)
    need = estimate_memory(cfg.model, training_shape(cfg, derived, 50304)).total
    assert (
        fit_refusal(cfg, derived, 50304, need // 2 + GiB, "the GPU has") is None
    )  # tight: a warning
    refusal = fit_refusal(cfg, derived, 50304, need // 3, "the GPU has")
    assert refusal.startswith(f"estimated {need / GiB:.1f} GiB per rank is over 2x the ")
    assert "the GPU has (seq_length=2048" in refusal and "skip_memory_check: true" in refusal
    skip = load_dict({**cfg.to_flat(), "skip_memory_check": True})
    assert fit_refusal(skip, derive(skip, 8, 50277), 50304, need // 3, "the GPU has") is None


def test_preference_data_files_are_checked_and_a_reward_model_does_not_generate(tmp_path):
    make_dataset(tmp_path / "c")
    pairs = (
        "train_impl: rm\ndataset_impl: pairwise\ndo_valid: false\ndo_test: false\n"
        f"pos_train_data_paths: [{tmp_path}/c]\nneg_train_data_paths: [{tmp_path}/r]\n"
        f"pos_train_label_data_paths: [{tmp_path}/c]\n"
    )
    cfg = loaded(tmp_path, pairs)
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert f"{tmp_path}/r.bin and {tmp_path}/r.idx not found" in str(e.value)
    assert "pos_train" not in str(e.value)
    _, problems = preflight(cfg, "generate.py")
    assert any("train_impl='rm' is a reward model" in p for p in problems), problems


def test_preference_data_is_pointed_at_the_chat_template_tool(tmp_path):
    """DPO's pairs and KTO's labelled, rewarded answers are written by the chat-template tool:
    the hint for a missing file names it, never tools/preprocess_data.py."""
    pairs = f"pos_train_data_paths: [{tmp_path}/p]\nneg_train_data_paths: [{tmp_path}/n]\n"
    with pytest.raises(ConfigError) as e:
        check_data(loaded(tmp_path, "train_impl: dpo\ndataset_impl: pairwise\n" + pairs))
    message = str(e.value)
    tool = "run tools/preprocess_data_with_chat_template.py --jsonl-keys chosen rejected"
    assert message.count(tool) == 2 and "tools/preprocess_data.py" not in message, message
    kto = f"train_impl: kto\ntrain_data_paths: [{tmp_path}/t]\n"
    kto += f"train_label_data_paths: [{tmp_path}/l]\ntrain_reward_data_paths: [{tmp_path}/r]\n"
    with pytest.raises(ConfigError) as e:
        check_data(loaded(tmp_path, kto))
    message = str(e.value)
    assert "tools/preprocess_data.py" not in message
    assert "--reward-key <its field>" in message
    assert message.count("tools/preprocess_data_with_chat_template.py") == 3, message


def make_ids_dataset(prefix, docs):
    """A .bin/.idx pair of the given documents (lists of token ids), uint16."""
    import numpy as np

    from neox.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def test_directories_the_ranks_write_are_checked_without_leaving_anything(tmp_path):
    """Issue 33 (defect 8): an unwritable log_dir or data_cache_dir, or a tensorboard_dir naming
    a file, passed preflight and crashed every rank with a traceback."""
    from neox.plan.preflight import output_dir_problems

    (tmp_path / "afile").write_text("x")
    ok = f"log_dir: {tmp_path}/logs\ntensorboard_dir: {tmp_path}/tb\n"
    assert output_dir_problems(loaded(tmp_path, ok)) == []
    bad = (
        "log_dir: /sys/neox_cannot_write_here/logs\n"  # sysfs refuses mkdir, even to root
        f"tensorboard_dir: {tmp_path}/afile\n"
        f"data_cache_dir: {tmp_path}/afile/cache\n"
    )
    problems = output_dir_problems(loaded(tmp_path, bad))
    assert len(problems) == 3, problems
    assert (
        "run.yml: log_dir='/sys/neox_cannot_write_here/logs': the directory cannot be written"
        in problems[0]
    )
    assert f"tensorboard_dir='{tmp_path}/afile' is a file, not a directory" in problems[1]
    assert (
        f"data_cache_dir='{tmp_path}/afile/cache' is inside {tmp_path}/afile, a file"
        in (problems[2])
    )
    save = output_dir_problems(loaded(tmp_path, f"save: {tmp_path}/afile\n"))
    assert save == [f"{tmp_path}/run.yml: save='{tmp_path}/afile' is a file, not a directory; "
                    "point save at a directory"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "run.yml"]  # nothing made


def test_token_ids_beyond_the_tokenizer_are_named_with_the_file(tmp_path):
    """Issue 33 (defect 8): data tokenized with a larger vocabulary than CharLevelTokenizer's
    512 passed preflight and crashed mid-run naming neither file nor id."""
    from neox.plan.preflight import token_id_problems

    make_ids_dataset(tmp_path / "big", [[1, 2, 3, 0], [5, 40000, 7, 0]])
    cfg = loaded(tmp_path, f"tokenizer_type: CharLevelTokenizer\ndata_path: {tmp_path}/big\n")
    [problem] = token_id_problems(cfg, vocab_size=512)
    assert f"run.yml: data_path='{tmp_path}/big': {tmp_path}/big.bin holds token id 40000" in (
        problem
    )
    assert "ids 0..511" in problem and "tools/preprocess_data.py" in problem
    make_dataset(tmp_path / "chars")
    fine = loaded(tmp_path, f"tokenizer_type: CharLevelTokenizer\ndata_path: {tmp_path}/chars\n")
    assert token_id_problems(fine, vocab_size=512) == []


def test_a_large_bin_is_sampled_and_still_finds_a_dense_foreign_vocabulary(tmp_path):
    """Past the whole-file budget only windows are read; data of another tokenizer has large ids
    everywhere, so a window finds one."""
    import numpy as np

    from neox.data.indexed import IndexedDataset

    rng = np.random.default_rng(0)
    make_ids_dataset(tmp_path / "wide", [rng.integers(0, 50000, 1000) for _ in range(200)])
    dataset = IndexedDataset(str(tmp_path / "wide"))
    largest, whole = dataset.largest_token(budget=10_000)
    assert not whole and 512 <= largest < 50000
    assert dataset.largest_token() == (int(np.max(dataset._bin_map.view(np.uint16))), True)
    dataset.close()


def test_unpacked_data_with_every_document_too_long_is_refused(tmp_path):
    """Issue 33 (defect 8): pack_impl unpacked with allow_chopped false and no document that
    fits seq_length + 1 crashed every rank building its index."""
    from neox.plan.preflight import packing_problems

    make_ids_dataset(tmp_path / "long", [[1] * 40 + [0] for _ in range(10)])
    base = f"tokenizer_type: CharLevelTokenizer\ndata_path: {tmp_path}/long\nseq_length: 16\n"
    cfg = loaded(tmp_path, base + "pack_impl: unpacked\nallow_chopped: false\n")
    [problem] = packing_problems(cfg)
    assert "data_path=" in problem and "none of its 10 documents fits seq_length + 1 = 17" in (
        problem
    )
    assert "allow_chopped: true" in problem
    assert packing_problems(loaded(tmp_path, base + "pack_impl: unpacked\n")) == []
    assert packing_problems(loaded(tmp_path, base.replace("16", "64") + "pack_impl: unpacked\n"
                                      "allow_chopped: false\n")) == []  # fmt: skip


def test_an_optimizer_the_ranks_cannot_build_is_named(tmp_path):
    """Issue 33 (defect 8): Lion on CPU ranks (DeepSpeed's FusedLion has no CPU kernel) crashed
    every rank; so did Adam's `maximize` once ZeRO-Offload swaps in DeepSpeed's CPU Adam."""
    from neox.config import derive
    from neox.plan.preflight import optimizer_problems

    lion = loaded(tmp_path, "optimizer: {type: Lion, params: {lr: 0.0001}}\n")
    derived = derive(lion.config, world_size=1)
    [problem] = optimizer_problems(lion, derived, cpu_ranks=True)
    assert "optimizer type lion" in problem and "no CPU implementation" in problem
    assert optimizer_problems(lion, derived, cpu_ranks=False) == []
    offload = loaded(
        tmp_path,
        "optimizer: {type: Adam, params: {lr: 0.001, maximize: true}}\n"
        "zero_optimization: {stage: 1, offload_optimizer: {device: cpu}}\n",
    )
    [problem] = optimizer_problems(offload, derive(offload.config, world_size=1), cpu_ranks=False)
    assert "optimizer.params.maximize is not a parameter of DeepSpeed's CPU Adam" in problem


def test_local_attention_without_a_window_is_a_config_error(tmp_path):
    """Issue 33 (defect 8): --dry-run and tools/estimate.py printed a traceback for it."""
    with pytest.raises(ConfigError, match="`local` layers but sliding_window_width is unset"):
        loaded(tmp_path, 'attention_config: [[["local"], 2]]\n')

import shlex

from neox.config import config_from_argv, decode, encode, load_dict, read_saved_config, write_config


def test_encode_decode_round_trip_with_hostile_values():
    cfg = load_dict({"save": "/tmp/with space/$(rm -rf x)/'q'\"", "hidden_size": 128, "seed": 9})
    blob = encode(cfg)
    assert shlex.quote(blob) == blob  # nothing a shell would interpret
    assert decode(blob) == cfg


def test_config_from_argv():
    cfg = load_dict({"num_layers": 3})
    assert config_from_argv(["--local_rank=0", "--neox_config", encode(cfg)]) == cfg
    assert config_from_argv([f"--neox_config={encode(cfg)}"]) == cfg
    assert config_from_argv(["x.yml"]) is None


def test_written_config_reloads_identically(tmp_path):
    cfg = load_dict({"num_layers": 3, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    path = write_config(cfg, tmp_path / "run" / "config.yml")
    assert read_saved_config(path.parent) == cfg

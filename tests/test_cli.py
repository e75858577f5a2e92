"""neox/cli.py and the checkpoint tools built on it: a user's mistake is one line and exit 1."""

import importlib
from pathlib import Path

import pytest

from neox.cli import exit_on

ROOT = Path(__file__).resolve().parents[1]


def test_exit_on_turns_only_the_named_errors_into_one_line():
    with pytest.raises(SystemExit) as e:
        with exit_on("tool", FileNotFoundError):
            raise FileNotFoundError("no such file x.yml")
    assert str(e.value) == "tool: error: no such file x.yml"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        with exit_on("tool", FileNotFoundError):
            raise KeyError("bug")


@pytest.mark.parametrize(
    "tool, args",
    [
        ("convert_to_hf", []),
        ("reshape_checkpoint", ["--tp", "1"]),
        ("convert_from_hf", []),
    ],
)
def test_checkpoint_tools_name_a_missing_input(tool, args, tmp_path, monkeypatch, capsys):
    """Each tool's main in this process: SystemExit(1) after one line on stderr, which is all
    its process would print (the interpreter adds nothing to an int status)."""
    missing, out = tmp_path / "no such dir", tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"tools.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(missing), "--output_dir", str(out), *args])
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"{tool}: error: ") and str(missing) in last, last
    assert not out.exists()

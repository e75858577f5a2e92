import subprocess
import sys

import pytest
from deepspeed.launcher import runner as ds_runner
from deepspeed.launcher.multinode_runner import PDSHRunner

from neox.config.launcher import LauncherConfig
from neox.launcher import HostfileError, build_launch

NASTY = [
    "two words",
    'say "hi"',
    "$(echo injected)",
    "`id`",
    "it's",
    'back\\slash \\" end',
    "$HOME and ${PATH}",
    "semi;colon|pipe&amp",
    "tab\there",
    "eyJhIjogImIgYyAkKHgpIn0=",
]
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root"}


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node-a slots=4\nnode-b slots=4\n")
    return str(path)


def ds_args(plan):
    """The runner's own parse of the planned command line."""
    assert plan.argv[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    return ds_runner.parse_args(plan.argv[4:])


def test_cpu_without_hostfile_is_local_ranks():
    plan = build_launch(LauncherConfig(num_gpus=3), "train.py", ["--x", "1"], cpu=True, environ=ENV)
    args = ds_args(plan)
    assert (args.num_gpus, args.user_script, args.user_args) == (3, "train.py", ["--x", "1"])
    assert plan.launcher == "local" and not plan.multi_node
    assert plan.hosts == {"localhost": [0, 1, 2]} and plan.world_size == 3
    assert plan.env["DS_ACCELERATOR"] == "cpu"
    assert plan.env["PYTHONPATH"].split(":")[0] == plan.cwd
    assert plan.command.startswith(f"{sys.executable} -u -m deepspeed.launcher.runner")
    assert build_launch(LauncherConfig(), "t.py", [], cpu=True, environ=ENV).world_size == 1


def test_gpu_layout_is_planned_without_gpus():
    plan = build_launch(LauncherConfig(num_gpus=8), "train.py", [], cpu=False, environ=ENV)
    assert plan.world_size == 8 and ds_args(plan).num_gpus == 8
    assert "DS_ACCELERATOR" not in plan.env
    with pytest.raises(HostfileError, match="no GPU found"):
        build_launch(LauncherConfig(), "train.py", [], cpu=False, environ=ENV)


def test_hostfile_flags_reach_the_runner(hostfile):
    cfg = LauncherConfig(
        hostfile=hostfile,
        num_nodes=2,
        num_gpus=2,
        master_addr="node-a",
        master_port=1234,
        ssh_port=2222,
        no_ssh_check=True,
        force_multi=True,
    )
    plan = build_launch(cfg, "train.py", [], cpu=True, environ=ENV)
    args = ds_args(plan)
    assert (args.hostfile, args.num_nodes, args.num_gpus, args.launcher) == (hostfile, 2, 2, "pdsh")
    assert (args.master_addr, args.master_port, args.ssh_port) == ("node-a", 1234, 2222)
    assert args.no_ssh_check and args.force_multi
    assert plan.hosts == {"node-a": [0, 1], "node-b": [0, 1]} and plan.world_size == 4
    assert "DS_ACCELERATOR=cpu\n" in plan.env_file_text


def test_include_and_slurm_account(hostfile):
    cfg = LauncherConfig(
        hostfile=hostfile, include="node-b:1,3", launcher="slurm", comment="a b", account="proj"
    )
    plan = build_launch(cfg, "train.py", ["x y"], cpu=True, environ=ENV)
    args = ds_args(plan)
    assert args.include == "node-b:1,3" and args.launcher == "slurm"
    assert args.launcher_args == "--comment 'a b' --account proj"
    assert args.user_args == ["x y"]  # srun takes an argv, no shell: no extra quoting
    assert plan.hosts == {"node-b": [1, 3]} and plan.launcher == "local"  # one host: launch.py


def test_bad_settings_fail_before_launch(hostfile):
    with pytest.raises(ValueError, match="comment is set but launcher='pdsh'"):
        build_launch(LauncherConfig(hostfile=hostfile, comment="x"), "t.py", [], environ=ENV)
    with pytest.raises(HostfileError, match="openmpi runs every slot.*include"):
        build_launch(
            LauncherConfig(hostfile=hostfile, launcher="openmpi", include="node-a"), "t.py", []
        )
    with pytest.raises(HostfileError, match="host 'node-z', which is not in"):
        build_launch(LauncherConfig(hostfile=hostfile, exclude="node-z"), "t.py", [])
    with pytest.raises(ValueError, match="export_env names NOT_SET_ANYWHERE"):
        build_launch(LauncherConfig(export_env=["NOT_SET_ANYWHERE"]), "t.py", [], environ=ENV)
    with pytest.raises(HostfileError, match="num_nodes=2 but no launcher.hostfile"):
        build_launch(LauncherConfig(num_nodes=2), "t.py", [], cpu=True, environ=ENV)
    with pytest.raises(ValueError, match="working directory .* spaces"):
        build_launch(LauncherConfig(hostfile=hostfile), "t.py", [], environ=ENV, cwd="/tmp/a b")


def remote_shell(command: str) -> str:
    """What a node's shell makes of a command, as pdsh would hand it over ssh."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout


def test_pdsh_args_and_exports_stay_literal_through_deepspeed_and_a_shell(hostfile, tmp_path):
    environ = dict(ENV, **{f"NEOX_T{i}": v for i, v in enumerate(NASTY)})
    cfg = LauncherConfig(hostfile=hostfile, export_env=[f"NEOX_T{i}" for i in range(len(NASTY))])
    script = str(tmp_path / "my dir" / "it's.py")
    plan = build_launch(cfg, script, NASTY, cpu=True, environ=environ)
    assert plan.launcher == "pdsh"

    # DeepSpeed's own handling of script arguments and .deepspeed_env lines, then a real shell.
    args = ds_args(plan)
    pdsh = PDSHRunner(args, "world")
    words = [args.user_script, *pdsh.user_arguments]
    printed = remote_shell("printf '%s\\n' " + " ".join(words))
    assert printed.split("\n")[:-1] == [script, *NASTY]

    for line in plan.env_file_text.splitlines():
        key, value = line.split("=", maxsplit=1)
        pdsh.add_export(key, value)
    exports = "".join(f"export {k}={v}; " for k, v in pdsh.exports.items())
    for i, value in enumerate(NASTY):
        assert remote_shell(exports + f'printf %s "$NEOX_T{i}"') == value
    assert remote_shell(exports + 'printf %s "$DS_ACCELERATOR"') == "cpu"
    assert remote_shell(exports + 'printf %s "$NEOX_LAUNCH_ID"') == plan.launch_id


def test_users_deepspeed_env_is_merged_not_overwritten(hostfile, tmp_path):
    home_file = tmp_path / "mine.env"
    home_file.write_text("MY_SETTING=1\n\nOTHER=x y\n")
    environ = dict(ENV, DS_ENV_FILE=str(home_file))
    plan = build_launch(LauncherConfig(hostfile=hostfile), "t.py", [], cpu=True, environ=environ)
    assert plan.env_file_text.startswith("MY_SETTING=1\nOTHER=x y\n")
    assert home_file.read_text() == "MY_SETTING=1\n\nOTHER=x y\n"
    assert "DS_ENV_FILE" not in plan.env  # run_launch points it at the merged copy

import shlex
import subprocess
import sys

import pytest

from neox.config.launcher import LauncherConfig
from neox.launcher import HostfileError, build_launch
from neox.launcher.agent import parse_args
from neox.launcher.plan import NEOX_ROOT

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


def agent_args(argv: list[str]):
    """The agent's own parse of a planned agent command line."""
    assert argv[1:4] == ["-u", "-m", "neox.launcher.agent"]
    return parse_args(argv[4:])


def launched(plan):
    """An mpirun/srun plan's launcher part and the agent's parse of the command it starts."""
    [argv] = plan.argvs
    start = argv.index(sys.executable)
    return argv[:start], agent_args(argv[start:])


def test_cpu_without_hostfile_is_local_ranks():
    plan = build_launch(LauncherConfig(num_gpus=3), "train.py", ["--x", "1"], cpu=True, environ=ENV)
    [argv] = plan.argvs
    args = agent_args(argv)
    assert (args.nodes, args.devices, args.node_rank) == ("3", "0,1,2", 0)
    assert (args.script, args.script_args) == ("train.py", ["--x", "1"])
    assert args.master_addr == "127.0.0.1" and args.master_port == plan.master_port
    assert args.stop_grace_s == 600 and args.control
    assert plan.launcher == "local" and not plan.multi_node
    assert plan.hosts == {"localhost": [0, 1, 2]} and plan.world_size == 3
    assert plan.env["DS_ACCELERATOR"] == "cpu"
    assert plan.env["PYTHONPATH"].split(":")[0] == NEOX_ROOT  # never the cwd: issue 33
    assert plan.command.startswith(f"{sys.executable} -u -m neox.launcher.agent")
    assert build_launch(LauncherConfig(), "t.py", [], cpu=True, environ=ENV).world_size == 1


def test_gpu_layout_is_planned_without_gpus():
    plan = build_launch(LauncherConfig(num_gpus=8), "train.py", [], cpu=False, environ=ENV)
    assert plan.world_size == 8 and agent_args(plan.argvs[0]).devices == "0,1,2,3,4,5,6,7"
    assert "DS_ACCELERATOR" not in plan.env
    with pytest.raises(HostfileError, match="no GPU found"):
        build_launch(LauncherConfig(), "train.py", [], cpu=False, environ=ENV)


def test_hostfile_gives_an_agent_per_node_over_ssh(hostfile):
    cfg = LauncherConfig(
        hostfile=hostfile,
        num_nodes=2,
        num_gpus=2,
        master_addr="node-a",
        master_port=1234,
        ssh_port=2222,
        stop_grace_s=30,
    )
    plan = build_launch(cfg, "train.py", [], cpu=True, environ=ENV)
    assert plan.hosts == {"node-a": [0, 1], "node-b": [0, 1]} and plan.world_size == 4
    assert plan.launcher == "pdsh" and len(plan.argvs) == 2
    for node, (host, argv) in enumerate(zip(plan.hosts, plan.argvs)):
        assert argv[:2] == ["ssh", "-o"] and argv[-2] == host and "-p" in argv
        assert argv[argv.index("-p") + 1] == "2222"
        remote = shlex.split(argv[-1].rsplit("exec ", 1)[1])
        args = agent_args(remote)
        assert (args.node_rank, args.nodes, args.devices) == (node, "2,2", "0,1")
        assert (args.master_addr, args.master_port, args.stop_grace_s) == ("node-a", 1234, 30)
        assert args.tee and args.control
        assert "export DS_ACCELERATOR=cpu" in argv[-1]


def test_one_host_of_a_hostfile_runs_here_and_force_multi_goes_over_ssh(tmp_path):
    one = tmp_path / "one"
    one.write_text("node-a slots=2\n")
    plan = build_launch(LauncherConfig(hostfile=str(one)), "t.py", [], cpu=True, environ=ENV)
    assert plan.launcher == "local" and agent_args(plan.argvs[0]).devices == "0,1"
    cfg = LauncherConfig(hostfile=str(one), force_multi=True)
    plan = build_launch(cfg, "t.py", [], cpu=True, environ=ENV)
    assert plan.launcher == "pdsh" and plan.argvs[0][-2] == "node-a"


def test_include_and_slurm_account(hostfile):
    cfg = LauncherConfig(
        hostfile=hostfile, include="node-b:1,3", launcher="slurm", comment="a b", account="proj"
    )
    plan = build_launch(cfg, "train.py", ["x y"], cpu=True, environ=ENV)
    assert plan.hosts == {"node-b": [1, 3]} and plan.launcher == "local"  # one host: an agent
    assert agent_args(plan.argvs[0]).devices == "1,3"
    plan = build_launch(
        cfg.model_copy(update={"force_multi": True}), "train.py", ["x y"], cpu=True, environ=ENV
    )
    srun, args = launched(plan)
    assert srun[0] == "srun" and srun[srun.index("--nodelist") + 1] == "node-b"
    assert args.devices == "1,3" and args.node_rank_env == "SLURM_NODEID"
    assert srun[-6:-2] == ["--comment", "a b", "--account", "proj"]
    assert args.script_args == ["x y"]  # srun takes an argv, no shell: no extra quoting
    assert args.master_port == 29500


def test_mpi_and_slurm_launches_take_gpt_neox_master_addr_and_port_from_the_environment(
    hostfile,
):
    environ = dict(ENV, MASTER_ADDR="10.0.0.7", MASTER_PORT="4321")
    for launcher in ("openmpi", "slurm"):
        plan = build_launch(
            LauncherConfig(hostfile=hostfile, launcher=launcher), "t.py", [], environ=environ
        )
        args = launched(plan)[1]
        assert (args.master_addr, args.master_port) == ("10.0.0.7", 4321)
    with pytest.raises(ValueError, match="MASTER_PORT='x1' in the environment is not a port"):
        build_launch(
            LauncherConfig(hostfile=hostfile, launcher="slurm"),
            "t.py",
            [],
            environ=dict(ENV, MASTER_PORT="x1"),
        )
    # The config wins over the environment.
    cfg = LauncherConfig(hostfile=hostfile, launcher="openmpi", master_addr="h", master_port=5)
    args = launched(build_launch(cfg, "t.py", [], environ=environ))[1]
    assert (args.master_addr, args.master_port) == ("h", 5)


def test_mpirun_and_srun_start_one_agent_per_node_and_name_the_exports(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=3\n")
    (tmp_path / ".deepspeed_env").write_text("MINE=x,y z\n")
    environ = dict(ENV, NCCL_DEBUG="INFO", MY_VAR="a,b")
    cfg = LauncherConfig(hostfile=str(hostfile), launcher="openmpi", export_env=["MY_VAR"])
    plan = build_launch(cfg, "t.py", ["--a"], cpu=True, environ=environ, cwd=str(tmp_path))
    mpirun, args = launched(plan)
    assert mpirun[:6] == ["mpirun", "-n", "2", "--host", "node-a,node-b", "--map-by"]
    assert "--bind-to" in mpirun and plan.world_size == 5
    # Each export by name; its value (commas, spaces) travels in mpirun's own environment.
    named = {mpirun[i + 1] for i, arg in enumerate(mpirun) if arg == "-x"}
    assert {"MINE", "NCCL_DEBUG", "MY_VAR", "DS_ACCELERATOR", "NEOX_LAUNCH_ID"} <= named
    assert (plan.env["MINE"], plan.env["MY_VAR"]) == ("x,y z", "a,b")
    assert (args.node_rank_env, args.nodes, args.devices) == (
        "OMPI_COMM_WORLD_RANK",
        "2,3",
        "0,1/0,1,2",
    )
    assert args.tee and not args.control and args.script_args == ["--a"]
    assert plan.ssh_check  # mpirun goes over ssh; gpt-neox's no_ssh_check skips the check
    # Open MPI's daemons keep no shared topology copy (their crash writing it) unless told to.
    assert plan.env["OMPI_MCA_rtc_hwloc_vmhole"] == "none"
    mine = dict(environ, OMPI_MCA_rtc_hwloc_vmhole="biggest")
    assert build_launch(cfg, "t.py", [], environ=mine).env["OMPI_MCA_rtc_hwloc_vmhole"] == "biggest"
    assert not build_launch(
        cfg.model_copy(update={"no_ssh_check": True}), "t.py", [], environ=environ
    ).ssh_check
    mvapich = build_launch(
        cfg.model_copy(update={"launcher": "mvapich"}), "t.py", [], environ=environ
    )
    hydra, args = launched(mvapich)
    assert hydra[:7] == ["mpirun", "-np", "2", "-ppn", "1", "-hosts", "node-a,node-b"]
    assert "MY_VAR" in hydra[hydra.index("-genvlist") + 1].split(",")
    assert args.node_rank_env == "MV2_COMM_WORLD_RANK,PMI_RANK"
    assert "OMPI_MCA_rtc_hwloc_vmhole" not in mvapich.env
    slurm = cfg.model_copy(update={"launcher": "slurm", "num_gpus": 2})
    plan = build_launch(slurm, "t.py", [], cpu=True, environ=environ)
    srun, args = launched(plan)
    assert not plan.ssh_check  # srun needs no ssh
    assert srun[:7] == [
        "srun",
        "-n",
        "2",
        "--nodes",
        "2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    assert srun[-2].startswith("--export=ALL,") and "MY_VAR" in srun[-2].split(",")
    assert args.devices == "0,1/0,1" and "--gpus-per-node" not in srun  # CPU ranks
    srun, _ = launched(build_launch(slurm, "t.py", [], cpu=False, environ=environ))
    assert srun[srun.index("--gpus-per-node") + 1] == "2"
    with pytest.raises(HostfileError, match="launcher=slurm needs the same slots on every host"):
        build_launch(slurm.model_copy(update={"num_gpus": None}), "t.py", [], environ=environ)


def test_dlts_hostfile_is_the_default_hostfile(hostfile, tmp_path):
    environ = dict(ENV, DLTS_HOSTFILE=hostfile)
    plan = build_launch(LauncherConfig(), "t.py", [], cpu=True, environ=environ)
    assert list(plan.hosts) == ["node-a", "node-b"]
    one = tmp_path / "one"
    one.write_text("node-c slots=1\n")
    plan = build_launch(LauncherConfig(hostfile=str(one)), "t.py", [], cpu=True, environ=environ)
    assert list(plan.hosts) == ["node-c"]  # the config's own wins


def test_a_hostfile_that_is_a_directory_is_an_error_naming_it(tmp_path):
    with pytest.raises(HostfileError, match=f"launcher.hostfile={tmp_path} is a directory"):
        build_launch(LauncherConfig(hostfile=str(tmp_path)), "t.py", [], cpu=True, environ=ENV)
    environ = dict(ENV, DLTS_HOSTFILE=str(tmp_path))
    with pytest.raises(HostfileError, match=f"DLTS_HOSTFILE={tmp_path} is a directory"):
        build_launch(LauncherConfig(), "t.py", [], cpu=True, environ=environ)


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
    with pytest.raises(ValueError, match="stop_grace_s\n.*greater than or equal to 0"):
        LauncherConfig(stop_grace_s=-1)


def remote_shell(command: str) -> str:
    """What a node's shell makes of a command, as ssh hands it over."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout


def test_ssh_args_and_exports_stay_literal_through_a_shell(hostfile, tmp_path):
    environ = dict(ENV, **{f"NEOX_T{i}": v for i, v in enumerate(NASTY)})
    cfg = LauncherConfig(hostfile=hostfile, export_env=[f"NEOX_T{i}" for i in range(len(NASTY))])
    script = str(tmp_path / "my dir" / "it's.py")
    cwd = tmp_path / "a dir; $(x)"
    cwd.mkdir()
    plan = build_launch(cfg, script, NASTY, cpu=True, environ=environ, cwd=str(cwd))
    assert plan.launcher == "pdsh"
    # The node's shell runs the command; printf stands in for the agent it would exec.
    command = plan.argvs[0][-1].replace(f"exec {shlex.quote(sys.executable)}", "printf '%s\\n'")
    printed = remote_shell(command + "; printf 'cwd=%s\\n' \"$PWD\"").split("\n")[:-1]
    assert printed[-1] == f"cwd={cwd}"
    assert printed[-len(NASTY) - 3 : -1] == ["--", script, *NASTY]
    exports = command.rsplit(" && exec ", 1)[0].replace("printf", "true")
    for i, value in enumerate(NASTY):
        assert remote_shell(exports + f' && printf %s "$NEOX_T{i}"') == value
    assert remote_shell(exports + ' && printf %s "$DS_ACCELERATOR"') == "cpu"
    assert remote_shell(exports + ' && printf %s "$NEOX_LAUNCH_ID"') == plan.launch_id


def test_users_deepspeed_env_is_exported_and_not_overwritten(hostfile, tmp_path):
    home_file = tmp_path / "mine.env"
    home_file.write_text("MY_SETTING=1\n\nOTHER=x y\n")
    environ = dict(ENV, DS_ENV_FILE=str(home_file))
    plan = build_launch(LauncherConfig(hostfile=hostfile), "t.py", [], cpu=True, environ=environ)
    assert "export MY_SETTING=1 && export OTHER='x y' && " in plan.argvs[0][-1]
    assert home_file.read_text() == "MY_SETTING=1\n\nOTHER=x y\n"
    assert "DS_ENV_FILE" not in plan.env
    home_file.write_text("BAD;NAME=1\n")
    with pytest.raises(ValueError, match="mine.env:1: 'BAD;NAME' is not an environment variable"):
        build_launch(LauncherConfig(hostfile=hostfile), "t.py", [], cpu=True, environ=environ)


@pytest.mark.parametrize("host", ["-G", "-Gq", "-Fx"])
def test_a_host_is_never_an_ssh_option(host, tmp_path):
    """Issue 33 (defect 2): `ssh -G` printed its config and exited 0, so the pre-launch probe
    called a host `-G` reachable without contacting it, and `-Fx` read ./x as ssh's config.
    After `--`, the real ssh takes the name as a host and refuses it."""
    from neox.launcher.ssh import ssh_argv

    argv = ssh_argv(host, None, ENV)
    assert argv[-2:] == ["--", host]
    (tmp_path / "x").write_text("Host *\n  ProxyCommand touch proxied\n")
    r = subprocess.run(argv + ["true"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert r.returncode != 0 and not (tmp_path / "proxied").exists(), r.stdout + r.stderr


def test_every_launcher_argv_ends_its_options_before_the_command(hostfile):
    """ssh, Open MPI's mpirun and srun take `--` before their operands (hydra's mpirun starts an
    absolute interpreter path, never an option); master_addr is never an option either."""
    plan = build_launch(LauncherConfig(hostfile=hostfile), "t.py", [], cpu=True, environ=ENV)
    assert all(argv[-3] == "--" for argv in plan.argvs)
    for launcher in ("openmpi", "slurm"):
        cfg = LauncherConfig(hostfile=hostfile, launcher=launcher, num_gpus=None)
        started, _ = launched(build_launch(cfg, "t.py", [], cpu=True, environ=ENV))
        assert started[-1] == "--", started
    assert sys.executable.startswith("/")
    with pytest.raises(HostfileError, match="master_addr='-oX' is not a plain host name"):
        build_launch(LauncherConfig(hostfile=hostfile, master_addr="-oX"), "t.py", [], environ=ENV)

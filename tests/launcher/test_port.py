"""Single-node launches with no master_port take a free one, so two runs never collide."""


def test_master_port_unset_means_a_free_one_on_one_node():
    import socket

    from neox.config.launcher import LauncherConfig
    from neox.launcher import build_launch

    plan = build_launch(LauncherConfig(num_gpus=2), "train.py", [], cpu=True)
    [arg] = [a for a in plan.argvs[0] if a.startswith("--master_port=")]
    port = int(arg.split("=")[1])
    assert port == plan.master_port
    assert port != 29500
    with socket.socket() as s:
        s.bind(("", port))  # still free


def test_a_master_port_in_use_is_an_error_naming_the_key_and_a_free_port():
    import socket

    import pytest

    from neox.config.launcher import LauncherConfig
    from neox.launcher import LaunchError, build_launch
    from neox.launcher.port import check_master_port

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        plan = build_launch(LauncherConfig(num_gpus=1, master_port=port), "t.py", [], cpu=True)
        with pytest.raises(LaunchError, match=rf"master_port={port} is in use .* \(e\.g\. \d+\)"):
            check_master_port(plan)
    check_master_port(plan)  # free again

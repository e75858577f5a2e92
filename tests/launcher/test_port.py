"""Single-node launches with no master_port take a free one, so two runs never collide."""


def test_master_port_unset_means_a_free_one_on_one_node():
    import socket

    from neox.config.launcher import LauncherConfig
    from neox.launcher import build_launch

    plan = build_launch(LauncherConfig(num_gpus=2), "train.py", [], cpu=True)
    [arg] = [a for a in plan.argv if a.startswith("--master_port=")]
    port = int(arg.split("=")[1])
    assert port != 29500
    with socket.socket() as s:
        s.bind(("", port))  # still free

import pytest

from neox.launcher.hostfile import (
    HostfileError,
    parse_hostfile,
    parse_node_spec,
    read_hostfile,
    select_resources,
)

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_parse_keeps_order_and_skips_comments_and_blanks():
    text = "# cluster\n\nworker-1 slots=8\n  worker-0 slots=2   # small box\n10.0.0.7 slots=1\n"
    assert list(parse_hostfile(text).items()) == [("worker-1", 8), ("worker-0", 2), ("10.0.0.7", 1)]


@pytest.mark.parametrize(
    "line, expected",
    [
        ("worker-0", "cannot read 'worker-0'"),
        ("worker-0 slots=four", "cannot read"),
        ("worker-0 slots=2 extra", "cannot read"),
        ("worker-0 slots=0", "slots=0"),
        ("wor;ker slots=2", "characters other than"),
        # Issue 33 (defect 2): ssh read these as options (-F: a config file, -G: print it).
        ("-Fx slots=2", "starts with '-'"),
        ("-G slots=1", "starts with '-'"),
        ("-Gq slots=1", "starts with '-'"),
        ("user@-G slots=1", "starts with '-'"),
    ],
)
def test_bad_line_names_file_line_and_form(line, expected):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(f"ok slots=1\n{line}\n", source="hosts.txt")
    assert "hosts.txt:2" in str(err.value) and expected in str(err.value)
    if "cannot read" in expected:
        assert "<host> slots=<N>" in str(err.value)


def test_duplicate_host_names_both_lines():
    with pytest.raises(HostfileError, match=r"hosts:3: host a is listed again \(first on line 1\)"):
        parse_hostfile("a slots=1\nb slots=1\na slots=2\n", source="hosts")


def test_empty_and_missing_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="no hosts found"):
        parse_hostfile("# nothing\n\n", source="empty")
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(str(tmp_path / "nope"))
    path = tmp_path / "hostfile"
    path.write_text("a slots=2\nb slots=x\n")
    with pytest.raises(HostfileError, match=f"{path}:2"):
        read_hostfile(str(path))


def test_node_spec():
    assert parse_node_spec("a:2,0,2@b") == {"a": [0, 2], "b": []}
    with pytest.raises(HostfileError, match="slot 'x' of host a"):
        parse_node_spec("a:0,x")
    with pytest.raises(HostfileError, match="empty entry"):
        parse_node_spec("a@@b")
    with pytest.raises(HostfileError, match="empty entry 'a:'"):
        parse_node_spec("a:")


def test_no_filter_uses_every_slot():
    assert select_resources(POOL) == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0, 1],
    }


def test_include_keeps_named_slots_in_hostfile_order():
    active = select_resources(POOL, include="worker-2@worker-0:1,3")
    assert list(active.items()) == [("worker-0", [1, 3]), ("worker-2", [0, 1])]


def test_exclude_removes_slots_and_whole_hosts():
    active = select_resources(POOL, exclude="worker-0@worker-1:0,3")
    assert active == {"worker-1": [1, 2], "worker-2": [0, 1]}


def test_filter_errors_name_the_host_or_slot():
    with pytest.raises(HostfileError, match="host 'worker-9', which is not in hosts"):
        select_resources(POOL, include="worker-9", source="hosts")
    with pytest.raises(HostfileError, match="slot 2 of worker-2, which has slots=0..1"):
        select_resources(POOL, exclude="worker-2:2")
    with pytest.raises(HostfileError, match="both set"):
        select_resources(POOL, include="worker-0", exclude="worker-1")
    with pytest.raises(HostfileError, match="leaves no slots"):
        select_resources({"a": 1}, exclude="a")
    with pytest.raises(HostfileError, match="cannot be combined with include"):
        select_resources(POOL, include="worker-0", num_nodes=1)


def test_num_nodes_and_num_gpus_trim_like_deepspeed():
    assert select_resources(POOL, num_nodes=2, num_gpus=2) == {
        "worker-0": [0, 1],
        "worker-1": [0, 1],
    }
    with pytest.raises(HostfileError, match="num_nodes=4 but hostfile has 3 host"):
        select_resources(POOL, num_nodes=4)
    with pytest.raises(HostfileError, match="num_gpus=3 but worker-2 has slots=2"):
        select_resources(POOL, num_gpus=3)

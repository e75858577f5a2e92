"""benchmarks/hashed_write.py: both ways save the same bytes (the one-pass digest is checked
against the file) and leave nothing behind; in the test process, a few kB."""

import json

from benchmarks import hashed_write


def test_both_ways_are_timed_and_the_file_is_removed(tmp_path):
    out = tmp_path / "results.json"
    bench = tmp_path / "disk"
    bench.mkdir()
    argv = ["--gb", "1e-5", "--tensors", "3", "--repeat", "2", "--dir", str(bench)]
    hashed_write.main([*argv, "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["way"] for r in rows] == [
        "before: save_file",
        "before: save_file + file_digest",
        "one pass",
    ]
    assert all(r["seconds"] >= 0 and r["bytes"] == 3 * 833 * 4 for r in rows)  # 1e4 bytes, cut
    assert rows[1]["seconds"] >= rows[0]["seconds"]  # the read-back adds to the same write
    assert not any(bench.iterdir())

"""examples/bench/nvme_io.py --mixed: both patterns timed on the same regions, one JSON line with each repetition."""
import json

from examples.bench import nvme_io


def test_mixed_times_both_patterns_and_leaves_nothing(tmp_path):
    out = tmp_path / "mixed.jsonl"
    drive = tmp_path / "drive"
    drive.mkdir()
    assert nvme_io.main(["--dir", str(drive), "--mixed", "--gib", "0.008", "--block-mib", "2", "--reps", "3",
                         "--json", str(out)]) == 0
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert line["mixed"] and line["bytes_each_way"] == 4 * 2 * 2 ** 20
    assert all(len(line["GBps_total"][how]) == 3 and min(line["GBps_total"][how]) > 0 for how in ("together", "one_way"))
    assert line["together_over_one_way"] == line["median_GBps_total"]["together"] / line["median_GBps_total"]["one_way"]
    assert list(drive.iterdir()) == []

"""placement_summary pairs each stronghold point with the plain point of the same shape and clipping."""
import json

from examples.bench.placement_summary import summarize


def _write(out, records):
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "placement.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_pairs_match_arch_and_clipping(tmp_path):
    _write(tmp_path, [
        {"arch": "llama", "system": "no_offload", "samples_per_s": 8.0},  # before the field: clipping 1.0
        {"arch": "llama", "system": "stronghold", "samples_per_s": 6.0, "stronghold_knobs": {}},
        {"arch": "llama", "system": "no_offload", "samples_per_s": 10.0, "clipping": 0.0},
        {"arch": "llama", "system": "stronghold", "samples_per_s": 9.0, "clipping": 0.0, "stronghold_knobs": {}},
        {"arch": "gpt2", "system": "stronghold", "samples_per_s": 3.0, "clipping": 1.0},  # no plain point: unpaired
    ])
    pairs = {p["clipping"]: p for p in summarize(tmp_path)["pairs"]}
    assert set(pairs) == {0.0, 1.0}
    assert pairs[1.0]["ratio"] == 6.0 / 8.0 and pairs[0.0]["ratio"] == 9.0 / 10.0
    assert all(p["arch"] == "llama" for p in pairs.values())


def test_failed_points_pair_with_nothing(tmp_path):
    """A point that errored (no samples_per_s) neither pairs nor stops the summary of the others."""
    _write(tmp_path, [
        {"arch": "llama", "system": "no_offload", "samples_per_s": 8.0},
        {"arch": "llama", "system": "no_offload", "error": "error", "returncode": 1},  # a later plain point failed
        {"arch": "llama", "system": "stronghold", "samples_per_s": 6.0, "stronghold_knobs": {}},
        {"arch": "llama", "system": "stronghold", "error": "error", "stronghold_knobs": {"weights_first": False}},
    ])
    pairs = summarize(tmp_path)["pairs"]
    assert [p["ratio"] for p in pairs] == [6.0 / 8.0]


def test_repeats_pair_within_their_own_file(tmp_path):
    """LLAMA_REPEAT writes placement_r2.jsonl ...: each repeat's stronghold point pairs with its own plain point."""
    _write(tmp_path, [{"arch": "llama", "system": "no_offload", "samples_per_s": 8.0},
                      {"arch": "llama", "system": "stronghold", "samples_per_s": 6.0}])
    (tmp_path / "bench" / "placement_r2.jsonl").write_text(
        json.dumps({"arch": "llama", "system": "no_offload", "samples_per_s": 5.0}) + "\n"
        + json.dumps({"arch": "llama", "system": "stronghold", "samples_per_s": 4.5}) + "\n")
    pairs = summarize(tmp_path)["pairs"]
    assert [(p["file"], p["ratio"]) for p in pairs] == [("placement.jsonl", 6.0 / 8.0), ("placement_r2.jsonl", 0.9)]


def test_repeats_summarised_by_median_and_range():
    from examples.bench.placement_summary import repeat_lines
    pairs = [{"arch": "llama", "clipping": 1.0, "stronghold_knobs": {}, "ratio": r} for r in (0.819, 0.866, 0.822)]
    pairs.append({"arch": "gpt2", "clipping": 1.0, "stronghold_knobs": {}, "ratio": 1.5})  # once: no line
    assert repeat_lines(pairs) == ["llama knobs {} clipping 1: 3 pairs, median 0.822x, range 0.819x-0.866x"]

"""Point identity, validation and its command-line round trip; the size and FLOP formulas."""
import argparse
import json

import pytest
import torch

from examples.bench.flops import flops_per_step, param_count
from examples.bench.point import Point, add_point_args, parse_cap, parse_knobs, point_from_args


def test_key_names_the_measurement_not_the_run():
    p = Point(system="stronghold", layers=8, stronghold={"window_size": 4})
    assert p.key() == p.with_(warmup_steps=0, timed_steps=9).key()
    assert p.key() != p.with_(layers=12).key()
    assert p.key() != p.with_(gpu_cap_GB=None).key()
    assert p.key() != p.with_(stronghold={"window_size": 8}).key()
    assert json.loads(p.key())["stronghold"] == {"window_size": 4}


@pytest.mark.parametrize("kwargs, words", [
    (dict(system="megatron", layers=4), "unknown system"),
    (dict(system="no_offload", layers=0), "layers=0"),
    (dict(system="no_offload", layers=4, hidden=64, heads=5), "not divisible"),
    (dict(system="no_offload", layers=4, gpu_cap_GB=0.0), "gpu_cap_GB"),
    (dict(system="zero_offload", layers=4, stronghold={"window_size": 2}), "drop them"),
])
def test_bad_points_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Point(**kwargs)


def test_argv_round_trip():
    p = Point(system="stronghold", layers=6, hidden=64, heads=4, seq=32, batch=2, gpu_cap_GB=None,
              checkpointing=False, stronghold={"window_size": 3, "resident_blocks": 1}, warmup_steps=1, timed_steps=2)
    parser = argparse.ArgumentParser()
    add_point_args(parser)
    assert point_from_args(parser.parse_args(p.to_argv())) == p


def test_clipping_is_part_of_the_measurement_and_reaches_ds_json():
    from examples.bench.systems import ds_config
    p = Point(system="stronghold", layers=4)
    # The default keeps the key every record before the field had, so stored points are still found.
    assert "clipping" not in json.loads(p.key()) and ds_config(p)["gradient_clipping"] == 1.0
    off = p.with_(clipping=0.0)
    assert json.loads(off.key())["clipping"] == 0.0 and off.label().endswith("-clip0")
    assert ds_config(off)["gradient_clipping"] == 0.0
    assert ds_config(off.with_(system="no_offload"))["gradient_clipping"] == 0.0
    parser = argparse.ArgumentParser()
    add_point_args(parser)
    assert point_from_args(parser.parse_args(off.to_argv())) == off
    with pytest.raises(ValueError, match="clipping=-1"):
        p.with_(clipping=-1.0)


def test_knob_shorthands_merge_into_the_section():
    parser = argparse.ArgumentParser()
    add_point_args(parser)
    args = parser.parse_args(["--system", "stronghold", "--layers", "4", "--stronghold", '{"pin_memory": false}',
                              "--window-size", "6"])
    assert point_from_args(args).stronghold == {"pin_memory": False, "window_size": 6}


def test_cap_and_knob_parsing():
    assert parse_cap("32") == 32.0 and parse_cap("none") is None
    with pytest.raises(ValueError, match="GiB"):
        parse_cap("lots")
    with pytest.raises(ValueError, match="JSON object"):
        parse_knobs("[4]")


@pytest.mark.parametrize("layers, billions", [(32, 1.717), (48, 2.522), (78, 4.033), (100, 5.141)])
def test_param_count_gives_the_seed_sizes(layers, billions):
    assert param_count(Point(system="no_offload", layers=layers)) / 1e9 == pytest.approx(billions, abs=5e-4)


def test_param_count_matches_the_hf_model():
    from transformers import GPT2LMHeadModel

    from examples.bench.model import gpt2_config

    p = Point(system="no_offload", layers=3, hidden=64, heads=4, seq=32)
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(p))
    assert sum(t.numel() for t in model.parameters()) == param_count(p)


def test_flops_formula():
    p = Point(system="no_offload", layers=2, hidden=8, heads=2, seq=4, batch=3, vocab=10)
    tokens = 12
    block_fwd = 24 * 64 + 4 * 4 * 8
    model = tokens * (3 * 2 * block_fwd + 6 * 10 * 8)
    assert flops_per_step(p) == (model + tokens * 2 * block_fwd, model)
    assert flops_per_step(p.with_(checkpointing=False)) == (model, model)

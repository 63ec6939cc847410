"""The planner's NVMe tier (planning/planner.py with Budgets.drive): the fewest of the last streamed blocks on the
drive that make host memory fit, the drive's traffic as a floor term, and the refusals for a drive too small or too
slow. Pure: synthetic blocks, injected drive rates."""
import dataclasses

import pytest

from stronghold.planning import plan_text
from stronghold.planning.plan_bytes import state_file_bytes
from stronghold.planning.planner import Activations, BlockSpec, Budgets, Drive, ModelSpec, Rates, Tier, plan

N = 1_000_000  # elements per synthetic block
ACTS = Activations(fixed_peak_bytes=3_000_000, per_block_bytes=100_000)
RATES = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
              gpu_s_fixed=0.003)
DRIVE = Drive(free_bytes=10 ** 12, read_bytes_per_s=2e9, write_bytes_per_s=1e9, slots=2)
# A GPU that holds two resident blocks and a window: the other six stream.
MODEL = ModelSpec(blocks=(BlockSpec(numel=N, trainable_numel=N),) * 8, rest_numel=N // 2,
                  rest_trainable_numel=N // 2, compute_bytes=2)


def budgets(host, drive=DRIVE):
    return Budgets(gpu_bytes=10 ** 15, host_bytes=host, gpu_margin_bytes=0, host_margin_bytes=0, drive=drive)


def _plan(host, drive=DRIVE, **kwargs):
    return plan(MODEL, ACTS, budgets(host, drive), RATES, resident_blocks=2, window_size=2, **kwargs)


def test_fewest_blocks_on_the_drive_that_make_host_memory_fit():
    everything = _plan(10 ** 15).host.needed  # no block on the drive: all states in host memory
    state = 12 * N  # bf16: fp32 master + two moments a parameter
    assert _plan(10 ** 15).nvme_blocks == 0
    for short_by, expected in ((1, 3), (state + 1, 4), (2 * state + 1, 5)):
        # k blocks on the drive save k states and cost min(k, 2) staging buffers (a state each, 4 KiB aligned).
        p = _plan(everything - short_by)
        assert p.nvme_blocks == expected, short_by
        assert p.tiers == (Tier.RESIDENT,) * 2 + (Tier.STREAMED,) * (6 - expected) + (Tier.NVME,) * expected
        assert p.host.needed <= everything - short_by
        with pytest.raises(MemoryError):
            _plan(everything - short_by, nvme_blocks=expected - 1)
        on_drive = expected * state_file_bytes(N, MODEL.compute_bytes)
        assert p.nvme_bytes_per_step == 2 * on_drive
        assert p.floor.nvme_s == pytest.approx(on_drive / 2e9 + on_drive / 1e9)
    assert "nvme 5 blocks" in plan_text.table(p) and "2.00 / 1.00 GB/s measured" in plan_text.table(p)


def test_without_a_drive_nothing_changes():
    host = _plan(10 ** 15).host.needed
    assert _plan(host, drive=None) == dataclasses.replace(_plan(host), drive=None)
    with pytest.raises(MemoryError, match="set \"nvme_path\""):
        _plan(host - 1, drive=None)


def test_a_slow_drive_makes_the_nvme_term_the_step_floor():
    p = _plan(_plan(10 ** 15).host.needed - 1, drive=dataclasses.replace(DRIVE, read_bytes_per_s=2e7,
                                                                          write_bytes_per_s=1e7))
    assert p.predicted_step_s == pytest.approx(p.floor.nvme_s + p.floor.cpu_tail_s)


def test_a_drive_too_small_or_too_slow_fails_with_the_numbers():
    short = _plan(10 ** 15).host.needed - 1  # three blocks must go to the drive: 36 MB of states
    with pytest.raises(MemoryError, match=r"3 blocks on the NVMe drive .* 0\.03 GiB, but the drive has 0\.02 GiB"):
        _plan(short, drive=dataclasses.replace(DRIVE, free_bytes=20 * 2 ** 20))
    slow = dataclasses.replace(DRIVE, read_bytes_per_s=1e5, write_bytes_per_s=1e5, max_io_s=600.0)
    seconds = 2 * 3 * state_file_bytes(N, MODEL.compute_bytes) / 1e5
    assert seconds > slow.max_io_s
    with pytest.raises(ValueError, match=rf"0\.1 MB/s read .* take {seconds:.0f} s a step, more than the 600 s"):
        _plan(short, drive=slow)
    assert _plan(short, drive=dataclasses.replace(slow, max_io_s=seconds + 1)).nvme_blocks == 3


def test_a_built_layout_keeps_its_drive_blocks():
    """Re-plans of a running engine (placement.py) keep the blocks the runtime put on the drive, even where the host
    would now hold them."""
    p = _plan(10 ** 15, nvme_from=6)
    assert p.nvme_blocks == 2 and p.tiers[6:] == (Tier.NVME,) * 2


def test_a_re_plan_may_bring_drive_blocks_back_to_host_memory_but_never_send_more():
    """With `nvme_shrink` (placement's re-plans, runtime.states_to_host) the built layout's first drive blocks come
    back to host memory where it holds them, the fewest left on the drive; a tight host keeps the layout, and no
    block that was built in host memory goes to the drive."""
    everything = _plan(10 ** 15).host.needed
    assert _plan(10 ** 15, nvme_from=4, nvme_shrink=True).nvme_blocks == 0
    assert _plan(everything - 1, nvme_from=4, nvme_shrink=True).nvme_blocks == 3  # as a fresh plan would choose
    with pytest.raises(MemoryError):  # three would fit, two are built on the drive: never more than built
        _plan(everything - 1, nvme_from=6, nvme_shrink=True)
    assert _plan(10 ** 15, nvme_from=4).nvme_blocks == 4  # without it the layout stays


def test_the_start_up_plan_saves_host_memory_before_it_uses_the_drive():
    """With a drive and "nvme_blocks" left to stronghold, compact masters and pooled gradient buffers come before any
    block on the drive (whose states are read and written every step), and where the drive is needed, the host saver
    that puts the fewest blocks on it."""
    import torch

    from stronghold.config import parse_stronghold_section, resolve
    from stronghold.planning.initial_plan import initial_plan

    block = BlockSpec(numel=100 * 2 ** 20, trainable_numel=100 * 2 ** 20)
    spec = ModelSpec(blocks=(block,) * 8, rest_numel=2 ** 20, rest_trainable_numel=2 ** 20, compute_bytes=2,
                     bf16=True, accumulation_steps=4)

    def start_up(host, drive=DRIVE, **keys):
        settings = resolve(parse_stronghold_section({"stronghold": keys}), torch.device("cuda"))
        return initial_plan(spec, Budgets(gpu_bytes=8 * 2 ** 30, host_bytes=host, host_margin_bytes=0, drive=drive),
                            settings)

    full = start_up(10 ** 13, drive=None)
    assert (full.compact_master, full.pooled_grads, full.nvme_blocks) == (False, False, 0)
    host, saved = 10 ** 13, full
    while not saved.compact_master:  # the host budget just under each plan's need, until full masters fit no longer
        host = saved.host.needed - 1
        saved = start_up(host, drive=None)
    assert saved.nvme_blocks == 0
    assert start_up(host) == dataclasses.replace(saved, drive=DRIVE)
    while True:  # down to where no plan fits the host without the drive
        try:
            host = start_up(host, drive=None, compact_master=True, pooled_grads=True).host.needed - 1
        except MemoryError:
            break
    with pytest.raises(MemoryError):
        start_up(host, drive=None)
    chosen = start_up(host)
    each = [start_up(host, compact_master=c, pooled_grads=p) for c in (False, True) for p in (False, True)]
    assert chosen.nvme_blocks == min(p.nvme_blocks for p in each) > 0
    assert chosen.nvme_blocks < each[0].nvme_blocks, "full masters would put more blocks on the drive"
    fixed = start_up(host, nvme_path="/drive", nvme_blocks=each[0].nvme_blocks)  # a number given is kept
    assert fixed.nvme_blocks == each[0].nvme_blocks
    # A drive too slow for full masters' drive blocks (over its step limit) but not for the fewest: still planned.
    per_block = 2 * state_file_bytes(block.trainable_numel, spec.compute_bytes) / 1e9  # seconds at 1 GB/s each way
    slow = dataclasses.replace(DRIVE, read_bytes_per_s=2e9, write_bytes_per_s=2e9,
                               max_io_s=per_block * (chosen.nvme_blocks + each[0].nvme_blocks) / 4)
    with pytest.raises(ValueError, match="a step"):
        start_up(host, drive=slow, compact_master=False, pooled_grads=False)
    on_slow = start_up(host, drive=slow)
    assert (on_slow.nvme_blocks, on_slow.compact_master, on_slow.pooled_grads) == (
        chosen.nvme_blocks, chosen.compact_master, chosen.pooled_grads)
    # Where full and compact masters put as many blocks on the drive, compact ones move fewer bytes there (the working
    # copy holds 2 bytes a parameter of each file): the start-up plan takes them.
    ties = 0
    for share in range(60, 40, -1):
        budget = full.host.needed * share // 100
        try:
            by_full, by_compact = (start_up(budget, compact_master=c, pooled_grads=False) for c in (False, True))
        except MemoryError:
            continue
        if by_full.nvme_blocks == by_compact.nvme_blocks > 0 and start_up(budget).nvme_blocks == by_full.nvme_blocks:
            ties += 1
            assert by_compact.nvme_bytes_per_step < by_full.nvme_bytes_per_step
            assert start_up(budget).nvme_bytes_per_step <= by_compact.nvme_bytes_per_step
    assert ties > 0


def test_auto_staging_buffers_are_fewer_only_where_that_keeps_a_block_off_the_drive():
    """"nvme_buffers" "auto": down to two staging buffers where that takes a block off the drive (its states' read and
    write every step); the plan records the count the runtime builds."""
    auto = dataclasses.replace(DRIVE, slots=4, fewer_slots=True)
    fixed = dataclasses.replace(DRIVE, slots=4)
    everything = _plan(10 ** 15, drive=fixed).host.needed
    fewer = 0
    for short_by in range(0, 6 * 12 * N, N // 2):
        by_auto = _plan(everything - short_by, drive=auto)
        try:
            by_four = _plan(everything - short_by, drive=fixed)
        except MemoryError:  # every streamed block on the drive and still short: fewer buffers fit a little longer
            assert by_auto.drive.slots < 4
            break
        assert by_auto.drive.fewer_slots is False and by_auto.nvme_blocks <= by_four.nvme_blocks
        if by_auto.nvme_blocks < by_four.nvme_blocks:
            fewer += 1
            assert by_auto.drive.slots < 4
            two = dataclasses.replace(auto, slots=by_auto.drive.slots, fewer_slots=False)
            assert _plan(everything - short_by, drive=two).host == by_auto.host
        else:
            assert by_auto.drive.slots == 4 and by_auto.host == by_four.host
    assert fewer > 0, "some budget must be met by fewer buffers with a block less on the drive"


def test_a_refusal_with_every_block_on_the_drive_counts_the_saving_with_the_buffers_it_tried():
    """Where even the fewest staging buffers do not fit, the refusal's saving per resident block is that block's host
    buffers, counted with the same buffers (not the most the drive allows, which would make it negative)."""
    import re

    big = dataclasses.replace(MODEL, blocks=(BlockSpec(numel=100 * 2 ** 20, trainable_numel=100 * 2 ** 20),) * 8)
    auto = dataclasses.replace(DRIVE, slots=4, fewer_slots=True)
    with pytest.raises(MemoryError) as refused:
        plan(big, ACTS, budgets(2 ** 30, auto), RATES, resident_blocks=2, window_size=2)
    saved = float(re.search(r"each saves about (-?[\d.]+) GiB", str(refused.value)).group(1))
    assert saved > 0

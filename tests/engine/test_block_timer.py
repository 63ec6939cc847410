"""BlockTimer's pairing of recompute starts (block_timer.py), on stand-in events: the GPU's events need a GPU, the
choice of which calls bound a block's recompute and backward does not."""
import pytest
import torch

from stronghold.planning.block_timer import BlockTimer


class _At:
    """A stand-in CUDA event recorded at `ms`."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, later: "_At") -> float:
        return later.ms - self.ms


def test_backward_time_is_taken_between_resident_blocks_going_down(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    timer = BlockTimer()
    # One checkpointed pass over 4 blocks: forwards 0-3 (1 ms apart), then recomputes 3, 2, 1, 0 going down; block 3
    # is streamed and waited 5 ms for its load before block 2's recompute could start.
    timer.starts = [(i, _At(i)) for i in range(4)] + [(3, _At(10)), (2, _At(18)), (1, _At(21)), (0, _At(24))]
    assert timer.backward_seconds(below=3) == 0.003, "3->2 is left out: block 3 is not resident"
    assert timer.backward_seconds(below=4) == 0.003  # the median of 8, 3 and 3 ms
    assert timer.backward_seconds(below=1) is None
    timer.reset()
    assert timer.starts == [] and timer.backward_seconds(below=4) is None


def test_the_top_resident_block_is_left_out_below_streamed_ones(monkeypatch):
    """Block 3 streams: its gradients' hand-off made the compute stream wait 7 ms for an earlier copy inside block
    2's interval (2 -> 1 takes 10 ms where the others take 3): that is the link's time, not the block's."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    timer = BlockTimer()
    timer.starts = [(i, _At(i)) for i in range(4)] + [(3, _At(10)), (2, _At(18)), (1, _At(28)), (0, _At(31))]
    assert timer.backward_seconds(below=3) == pytest.approx(0.0065), "both resident intervals, the wait in one of them"
    assert timer.backward_seconds(below=3, streamed=True) == 0.003
    assert timer.backward_seconds(below=2, streamed=True) is None


def test_the_typical_time_leaves_disturbed_steps_out():
    """block_timer.typical on measured block times: two disturbed steps of three (GPT-2 4.94 B), none (2.52 B: both
    kept), the slow step right after a promotion (H100)."""
    from stronghold.planning.block_timer import typical
    assert typical([4.81, 12.13, 12.26]) == 4.81
    assert typical([4.44, 5.03]) == (4.44 + 5.03) / 2
    assert typical([7.8, 6.1, 6.2]) == 6.15

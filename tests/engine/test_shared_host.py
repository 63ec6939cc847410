"""The node-shared working copy's segment (shared_host.py) in one process, with the node's all-gather faked: its name
never outlives the set-up, also where a rank dies while the others map it."""
import pytest
import torch

from stronghold.distributed.shared_host import SharedCopyConfig, create_shared_copy

SIZES = {0: (1000, torch.bfloat16), 1: (3000, torch.bfloat16)}


def _gather(name_holder, fail_at=None):
    """An all-gather over two local ranks where the other rank sends None; its `fail_at`-th call raises as a
    collective does when a peer has died."""
    calls = []

    def gather(value):
        calls.append(value)
        if len(calls) == fail_at:
            raise RuntimeError("gloo: connection closed by peer")
        if len(calls) == 1:
            name_holder.append(value)
        return [value, None]

    return gather


def test_the_segment_is_mapped_then_its_name_removed(tmp_path):
    names = []
    config = SharedCopyConfig(local_rank=0, local_world=2, global_ranks=(0, 1))
    shared = create_shared_copy(SIZES, config, _gather(names), directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "the name is gone once every rank has mapped it"
    assert shared.working[1].numel() == 3000 and shared.working[1].dtype == torch.bfloat16
    shared.working[1].fill_(2.0)
    assert float(shared.working[1].float().sum()) == 6000.0 and not shared.working[0].any()
    shared.close()


def test_a_rank_dying_while_the_others_map_it_leaves_no_name_behind(tmp_path):
    config = SharedCopyConfig(local_rank=0, local_world=2, global_ranks=(0, 1))
    with pytest.raises(RuntimeError, match="connection closed"):
        create_shared_copy(SIZES, config, _gather([], fail_at=3), directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "local rank 0 removed the name although the last gather failed"


def test_a_shared_memory_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A container's /dev/shm (64 MiB unless started with more) takes a larger file and kills the first write past
    its size with SIGBUS: the free space is checked first, and the error says what to change."""
    from stronghold.distributed import shared_host

    class Small:
        free = 1024
    monkeypatch.setattr(shared_host.shutil, "disk_usage", lambda path: Small())
    config = SharedCopyConfig(local_rank=0, local_world=2, global_ranks=(0, 1))
    with pytest.raises(MemoryError, match=r"has 0\.00 GiB free; in a container, start it with a larger --shm-size"):
        create_shared_copy(SIZES, config, _gather([]), directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "nothing was created"

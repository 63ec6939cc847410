"""GPU evidence for the gradient hand-off's memory (streams.Transfers.offload), run on the device machine."""
import pytest
import torch

from stronghold.planning.plan_types import STREAMED_GRADS_IN_FLIGHT
from stronghold.streaming.streams import Transfers

pytestmark = pytest.mark.gpu

NUMEL = (5 << 20) + 256  # fp16: 10 MiB and 512 B, a size no other test leaves free in the allocator's cache


def _hand_off(transfers: Transfers, value: float):
    """A block's gradient made on the compute stream and handed to the host, the caller's reference dropped."""
    grad = torch.full((NUMEL,), value, dtype=torch.float16, device=transfers.device)
    destination = torch.empty(NUMEL, dtype=torch.float16, pin_memory=True)
    landed = transfers.event()
    ptr = grad.data_ptr()
    transfers.offload([(grad, destination)], None, torch.empty(1, pin_memory=True), landed)
    return ptr, destination, landed


def test_gradient_memory_returns_to_the_compute_stream_while_the_copies_are_behind():
    """With the D2H stream held back (a spin kernel queued on it), the allocator on the host can never see the
    first block's copy done; its memory must still be handed out again once the next block's hand-off has made the
    compute stream wait for that copy: at most STREAMED_GRADS_IN_FLIGHT blocks' gradients are ever held."""
    assert STREAMED_GRADS_IN_FLIGHT == 2
    transfers = Transfers(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda._sleep(2_000_000_000)  # on the compute stream: no copy can start before the host is done here
    first_ptr, first_host, _ = _hand_off(transfers, 1.0)
    second_ptr, second_host, second_landed = _hand_off(transfers, 2.0)
    assert len(transfers.held) == 1 and second_ptr != first_ptr
    reused = torch.empty(NUMEL, dtype=torch.float16, device="cuda")
    assert reused.data_ptr() == first_ptr
    reused.fill_(7.0)  # ordered after the compute stream's wait for the first copy: the host copy keeps 1.0
    transfers.release_held()
    assert not transfers.held
    torch.cuda.synchronize()
    assert torch.equal(first_host, torch.full_like(first_host, 1.0))
    assert torch.equal(second_host, torch.full_like(second_host, 2.0))
    assert second_landed.query()


def test_wait_offloads_lets_go_of_what_it_held():
    transfers = Transfers(torch.device("cuda"))
    _, host, _ = _hand_off(transfers, 3.0)
    transfers.wait_offloads()
    assert not transfers.held and torch.equal(host, torch.full_like(host, 3.0))

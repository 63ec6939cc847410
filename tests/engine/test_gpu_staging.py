"""The promotion's copies of pageable host tensors through two pinned buffers (streaming/staging.py), on a GPU."""
import pytest
import torch

from stronghold.streaming.staging import STAGED_MIN_BYTES, Stager

pytestmark = pytest.mark.gpu

CHUNK = 1 << 20


def _sources() -> list[torch.Tensor]:
    """Whole chunks, a part-filled last chunk (odd size), a tensor below the staging threshold, and a 2-D bf16 one."""
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=generator) for n in (STAGED_MIN_BYTES // 4, 5 * CHUNK // 4 + 17, 5)]
    return sources + [torch.randn(64, STAGED_MIN_BYTES // 128, generator=generator).to(torch.bfloat16)]


def test_staged_copies_equal_their_sources_across_chunks_and_buffer_turns():
    stager = Stager(torch.device("cuda"), staged=True, chunk_bytes=CHUNK)
    sources = _sources()
    outs = [stager.to_device(source) for source in sources]  # several chunks each, the two buffers reused throughout
    for source in sources:
        source.fill_(-1)  # the host tensors change once the call returns: the device copies must not follow
    torch.cuda.synchronize()
    for out, want in zip(outs, _sources()):
        assert out.device.type == "cuda" and out.dtype == want.dtype and out.shape == want.shape
        assert torch.equal(out.cpu(), want)

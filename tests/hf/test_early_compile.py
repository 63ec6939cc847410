"""The one line starts the compiler's set-up at once where the engine will compile the blocks (hf.prepare,
compiler_setup.start_early): on a GPU (stood in for here; nothing is started), with "compile" left to stronghold or on,
for the block families compiled by default."""
import pytest
import torch

from stronghold.integrations import compiler_setup, hf

from tests.engine.helpers import tiny_gpt2, tiny_llama


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiler_setup, "start_early", lambda device, backend, options: calls.append(device))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return calls


@pytest.mark.parametrize("config, expected", [(None, True), ({"compile": "auto"}, True), ({"compile": True}, True),
                                              ({"compile": False}, False)])
def test_it_starts_where_the_engine_will_compile(started, config, expected):
    hf.prepare(tiny_llama(2), config=config)
    assert started == ([torch.device("cuda", 0)] if expected else [])


def test_it_starts_for_this_ranks_gpu(started, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    hf.prepare(tiny_gpt2(2))
    assert started == [torch.device("cuda", 1)]


def test_not_without_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(compiler_setup, "start_early", lambda *args: calls.append(args))
    hf.prepare(tiny_llama(2))
    assert calls == []

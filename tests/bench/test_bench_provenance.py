"""Which commit the records name: from git, or from either environment variable where the tree is a copy."""
import pytest

from examples.bench.store import current_provenance
from examples.provenance import commit_from_env, git_commit


@pytest.fixture(autouse=True)
def no_commit_env(monkeypatch):
    for name in ("STRONGHOLD_COMMIT", "BENCH_COMMIT", "BENCH_DIRTY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", ["STRONGHOLD_COMMIT", "BENCH_COMMIT"])
def test_either_name_reaches_the_scripts_and_the_bench(monkeypatch, name):
    monkeypatch.setenv(name, "abc1234")
    monkeypatch.setenv("BENCH_DIRTY", "0")
    assert commit_from_env() == git_commit() == "abc1234"
    assert current_provenance().commit == "abc1234" and current_provenance().dirty is False


def test_both_names_must_agree(monkeypatch):
    monkeypatch.setenv("STRONGHOLD_COMMIT", "abc1234")
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert commit_from_env() == "abc1234"
    monkeypatch.setenv("BENCH_COMMIT", "def5678")
    with pytest.raises(ValueError, match="name different commits"):
        current_provenance()


def test_without_either_the_commit_comes_from_git():
    assert commit_from_env() is None
    assert current_provenance().commit  # git HEAD, or a hash of the code where there is no git

"""The Fig. 6a search: exact answers for any limit and start, few probes, clear bad plans."""
import pytest

from examples.bench.search import IntSearch, SearchPlan, largest_trainable


def search(limit, **plan):
    probes = []

    def fits(layers):
        probes.append(layers)
        return layers <= limit

    return largest_trainable(fits, SearchPlan(**plan)), probes


@pytest.mark.parametrize("limit", [0, 3, 4, 5, 31, 32, 47, 48, 100, 101, 250])
@pytest.mark.parametrize("start", [4, 24, 100])
def test_finds_the_largest_multiple_of_step_that_fits(limit, start):
    result, probes = search(limit, start_layers=start, step_layers=4, max_layers=512)
    assert result.largest_fit == (limit // 4) * 4
    assert result.smallest_failure == result.largest_fit + 4
    assert list(result.probes) == probes
    assert len(set(probes)) == len(probes), "a layer count was probed twice"
    assert len(probes) <= 16  # growth 1.5 from 4 to ~250, then bisection


def test_start_near_the_answer_takes_few_probes():
    result, probes = search(102, start_layers=100, step_layers=4)
    assert result.largest_fit == 100
    assert probes == [100, 152, 124, 112, 104]


def test_stops_growing_at_max_layers():
    result, probes = search(10_000, start_layers=64, step_layers=4, growth=2.0, max_layers=300)
    assert (result.largest_fit, result.smallest_failure) == (300, None)
    assert probes == [64, 128, 256, 300]


@pytest.mark.parametrize("plan, words", [
    (dict(start_layers=4, step_layers=0), "step_layers"),
    (dict(start_layers=4, growth=1.0), "growth"),
    (dict(start_layers=600, max_layers=512), "start_layers"),
])
def test_bad_plans_are_refused(plan, words):
    with pytest.raises(ValueError, match=words):
        SearchPlan(**plan)


def test_a_small_growth_still_moves_up_a_step():
    """4 x 1.1 = 4.4 once truncated back to 4 and probed 4 forever; now it rounds up (8), and the search
    ends with the right answer."""
    result = largest_trainable(lambda layers: layers <= 12, SearchPlan(start_layers=4, step_layers=4, growth=1.1))
    assert result.probes[:3] == (4, 8, 12) and result.largest_fit == 12 and result.smallest_failure == 16


def test_a_known_fit_below_a_failing_start_bisects_between_them():
    """368 layers trained at other code; 384 fails at this one: the next probe is 376, not 192."""
    probes = []
    plan = IntSearch(field="layers", start=384, step=8, growth=1.25, maximum=512, known_fit=368)
    result = largest_trainable(lambda layers: probes.append(layers) or layers <= 370, plan)
    assert probes == [384, 376] and (result.largest_fit, result.smallest_failure) == (368, 376)
    for bad in (372, 384, 400):
        with pytest.raises(ValueError, match="known_layers"):
            IntSearch(field="layers", start=384, step=8, maximum=512, known_fit=bad)

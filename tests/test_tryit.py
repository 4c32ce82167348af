"""`knobs`: the first call uses each knob's first value and returns its result; bad knobs
are clear errors. (Outside a notebook there are no widgets: the function runs once.)"""
import pytest

from picolib.tryit import knobs


def test_knobs_calls_the_function_with_the_first_values():
    calls = []

    def f(n, size):
        calls.append((n, size))
        return n * size

    assert knobs(f, n=(2, 8, 1), size=[10.0, 20.0]) == 20.0
    assert calls == [(2, 10.0)]


@pytest.mark.parametrize("bad", [[], (1, 2), 5])
def test_a_bad_knob_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="knob 'n'"):
        knobs(lambda n: n, n=bad)

"""The one-line diagnoses every check shares: a uniform factor, a permutation, neither."""
import torch

from picolib.grading._core import compare, diagnose


def test_a_sum_instead_of_a_mean_is_named_with_its_factor():
    want = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert "4× too large" in diagnose(want * 4, want)
    assert "2× too small" in diagnose(want / 2, want)
    assert "same factor 1.5" in diagnose(want * 1.5, want)


def test_a_permutation_is_named_and_other_errors_are_not_guessed():
    want = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert "wrong order" in diagnose(want.flip(0), want)
    assert diagnose(want + torch.tensor([0.0, 0.0, 0.0, 1.0]), want) == ""
    assert compare("x", want, want) == []
    assert "wrong order" in compare("buckets", [[2], [0, 1]], [[0, 1], [2]])[0]

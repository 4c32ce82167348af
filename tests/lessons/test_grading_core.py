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


def test_a_mask_is_not_called_a_permutation_and_the_difference_is_shown():
    want = torch.tensor([True, False, True, False])
    assert diagnose(want.flip(0).float(), want.float()) == ""
    (line,) = compare("keep", torch.tensor([1, 0, 0, 1]), want.long())
    assert line.startswith("keep: 2 of 4 elements wrong, the first at [2]: got 0, expected 1"), line
    (line,) = compare("loss", torch.tensor(2.5), torch.tensor(2.0))
    assert line == "loss: got 2.5, expected 2", line


def test_the_sub_group_hint_is_only_for_a_rank_outside_the_group():
    from picolib.grading._core import _PEER_NOT_IN_GROUP
    assert _PEER_NOT_IN_GROUP.search("ValueError: Global rank 3 is not part of group <ProcessGroup>")
    assert not _PEER_NOT_IN_GROUP.search(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
        "peer [127.0.0.1]:4242 (ProcessGroupGloo)")
    assert not _PEER_NOT_IN_GROUP.search("RuntimeError: ProcessGroupGloo::allreduce: invalid tensor size")


def test_a_flattened_model_is_compared_parameter_by_parameter():
    from picolib.grading._core import compare_parameters
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    want = torch.cat([p.detach().flatten() for p in model.parameters()])
    got = want.clone()
    got[8] += 1.0                                    # after 6 weights and 2 biases: layer 1, weight[0, 0]
    (line,) = compare_parameters("weights", got, want, model)
    assert line.startswith("weights: 1 of 11 values wrong, the first 1.weight[0, 0]: got"), line
    assert compare_parameters("weights", want, want, model) == []


def test_all_zeros_get_no_factor_hint():
    """A result never written (all 0, or −0) is not "off by the same factor 0/−0"; beside it a
    right answer written differently (float64, from a mean) passes."""
    want = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for zeros in (torch.zeros(4), -torch.zeros(4)):
        assert diagnose(zeros, want) == ""
        (line,) = compare("grad", zeros, want)
        assert "factor" not in line and line.startswith("grad: 3 of 4 elements wrong"), line
    assert compare("grad", torch.stack([want, want]).double().mean(0), want) == []


def _shapes(split, slip):
    """A worker whose reshape is wrong only in the run `slip` names ("world" or "group")."""
    import torch.distributed as dist
    from picolib.grading._core import my_group
    group = my_group(split)
    x = torch.ones(2 * dist.get_world_size(group))
    wrong = slip == ("group" if split else "world")
    return x.view(-1, 5).sum().item() if wrong else x.view(2, -1).sum().item()


def test_an_error_on_a_rank_names_the_run_it_came_from():
    import pytest
    from picolib.grading._core import ExerciseFailed, run_student
    with pytest.raises(ExerciseFailed, match=r"in the sub-group run \(4 ranks as the groups \[0, 2\] and \[1, 3\]\)"):
        run_student(_shapes, 4, True, "group")
    with pytest.raises(ExerciseFailed, match=r"in the world run \(3 ranks, group=None\)"):
        run_student(_shapes, 3, False, "world")
    assert run_student(_shapes, 4, True, "world") == [4.0] * 4      # right in that run: passes
    assert run_student(_shapes, 3, False, "group") == [6.0] * 3

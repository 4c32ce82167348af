"""Lesson 01 checks: each passes the reference answer and fails wrong ones."""
import re
import contextlib
import pytest

from picolib.grading import (ExerciseFailed, check_activation_bytes, check_bytes_per_param,
                             check_grad_accumulation, check_param_count)


@contextlib.contextmanager
def fails(pattern):
    """The check must fail, and one of its problem lines match `pattern`."""
    with pytest.raises(ExerciseFailed) as info:
        yield info
    assert re.search(pattern, info.value.details), info.value.details


def llama_params(cfg):
    h, d, f = cfg.hidden, cfg.head_dim, cfg.ffn_hidden
    attn = h * cfg.n_heads * d * 2 + 2 * h * cfg.n_kv_heads * d
    return 2 * cfg.vocab_size * h + cfg.n_layers * (attn + 3 * h * f + 2 * h) + h


def test_param_count():
    check_param_count(llama_params)
    with pytest.raises(ExerciseFailed):   # forgets grouped-query attention (kv heads = heads)
        check_param_count(lambda c: 2 * c.vocab_size * c.hidden + c.hidden + c.n_layers
                          * (4 * c.hidden ** 2 + 3 * c.hidden * c.ffn_hidden + 2 * c.hidden))
    with pytest.raises(ExerciseFailed):
        check_param_count(lambda c: (_ for _ in ()).throw(NotImplementedError()))


def test_bytes_per_param():
    def state_bytes(n, precision, fp32_grad_accum):
        per = 4 + 4 + 8 if precision == "fp32" else 2 + 2 + 4 + 8
        return n * (per + (4 if fp32_grad_accum else 0))
    check_bytes_per_param(state_bytes)
    with pytest.raises(ExerciseFailed):   # forgets the fp32 master weights
        check_bytes_per_param(lambda n, p, acc: n * ((16 if p == "fp32" else 12) + 4 * acc))
    with pytest.raises(ExerciseFailed):
        check_bytes_per_param(lambda n, p, acc: "16 GB")


def test_activation_bytes():
    def act(L, s, b, h, a, flash=False):
        return L * s * b * h * (34 + (0 if flash else 5 * a * s / h))
    check_activation_bytes(act)
    with pytest.raises(ExerciseFailed):   # the published garbled 3/4
        check_activation_bytes(lambda L, s, b, h, a, flash=False:
                               L * s * b * h * (0.75 + (0 if flash else 5 * a * s / h)))
    with pytest.raises(ExerciseFailed):   # ignores flash attention
        check_activation_bytes(lambda L, s, b, h, a, flash=False: L * s * b * h * (34 + 5 * a * s / h))


def test_grad_accumulation():
    def accumulate(model, x, y, k):
        m = len(x) // k
        for i in range(k):
            (model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) / k).backward()
    check_grad_accumulation(accumulate)

    def unscaled(model, x, y, k):          # sums the micro-batch means: k times too large
        m = len(x) // k
        for i in range(k):
            model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]).backward()
    with pytest.raises(ExerciseFailed):
        check_grad_accumulation(unscaled)

    def all_forwards_first(model, x, y, k):   # right gradient, but holds every micro-batch
        m = len(x) // k
        sum(model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) / k for i in range(k)).backward()
    with fails("peak saved activations"):
        check_grad_accumulation(all_forwards_first)


def _lines(check, fn):
    with pytest.raises(ExerciseFailed) as info:
        check(fn)
    return info.value.problems


def test_each_typical_mistake_is_named_in_one_line():
    tied = _lines(check_param_count, lambda c: llama_params(c) - c.vocab_size * c.hidden)
    assert len(tied) == 1 and tied[0].startswith("the output head (v·h) is missing")
    mha = _lines(check_param_count, lambda c: llama_params(c) + 2 * c.n_layers * c.hidden
                 * (c.n_heads - c.n_kv_heads) * c.head_dim)
    assert len(mha) == 1 and "grouped-query attention" in mha[0]
    no_master = _lines(check_bytes_per_param, lambda n, p, acc: n * ((16 if p == "fp32" else 12) + 4 * acc))
    assert len(no_master) == 2 and all("missing the fp32 master weights" in line for line in no_master)
    garbled = _lines(check_activation_bytes, lambda L, s, b, h, a, flash=False:
                     L * s * b * h * (0.75 + (0 if flash else 5 * a * s / h)))
    assert len(garbled) == 1 and garbled[0].startswith("the per-layer constant is 34")
    no_flash = _lines(check_activation_bytes, lambda L, s, b, h, a, flash=False: L * s * b * h * (34 + 5 * a * s / h))
    assert len(no_flash) == 1 and "flash=True" in no_flash[0]

    def unscaled(model, x, y, k):
        m = len(x) // k
        for i in range(k):
            model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]).backward()
    lines = _lines(check_grad_accumulation, unscaled)
    assert len(lines) == 3 and all(f"k={k}: every gradient is {k}× the right one — the "
                                   "micro-batch losses are summed" in line
                                   for k, line in zip((2, 4, 8), lines)), lines


# ---------------------------------------------------------------- issue 37: each mistake named
def _mistake(check, fn, pattern):
    with fails(pattern):
        check(fn)


@pytest.mark.parametrize("fn, pattern", [
    (lambda c: llama_params(c) - c.vocab_size * c.hidden, "the output head \\(v·h\\) is missing"),
    (lambda c: llama_params(c) - c.hidden, "the final norm \\(h\\) is missing"),
    (lambda c: llama_params(c) - c.n_layers * c.hidden, "one norm per layer is missing"),
    (lambda c: llama_params(c) - c.n_layers * c.hidden * c.ffn_hidden, "SwiGLU has three"),
    (lambda c: llama_params(c) + c.n_layers * (c.n_heads * c.head_dim + 2 * c.n_kv_heads * c.head_dim
                                               + 2 * c.hidden + 2 * c.ffn_hidden), "biases counted"),
], ids=["tied head", "final norm", "one norm", "two-matrix MLP", "biases"])
def test_param_count_names_each_mistake(fn, pattern):
    _mistake(check_param_count, fn, pattern)


@pytest.mark.parametrize("fn, pattern", [
    (lambda n, p, acc: n * ((8 if p == "fp32" else 8) + 4 * acc), "missing Adam's two moments"),
    (lambda n, p, acc: n * ((12 if p == "fp32" else 12) + 4 * acc), "missing one of Adam's moments"),
    (lambda n, p, acc: n * ((16 if p == "fp32" else 12) + 4 * acc), "missing the fp32 master weights"),
    (lambda n, p, acc: n * ((16 if p == "fp32" else 16) + 4 * acc + (4 if p == "fp32" else 0)),
     "a stray fp32 buffer"),
], ids=["no Adam", "one moment", "no master", "stray buffer"])
def test_bytes_per_param_names_each_mistake(fn, pattern):
    _mistake(check_bytes_per_param, fn, pattern)


@pytest.mark.parametrize("fn, pattern", [
    (lambda L, s, b, h, a, flash=False: L * s * b * h * (34 + (0 if flash else 5 * a / h)), "grows with s²"),
    (lambda L, s, b, h, a, flash=False: s * b * h * (34 + (0 if flash else 5 * a * s / h)), "missing the factor L"),
    (lambda L, s, b, h, a, flash=False: L * s * b * h * (34 + (0 if flash else 2 * a * s / h)),
     "2 \\+ 1 \\+ 2 = 5 bytes"),
], ids=["s not s²", "no L", "softmax only"])
def test_activation_bytes_names_each_mistake(fn, pattern):
    _mistake(check_activation_bytes, fn, pattern)


def accumulate_by_micro_batch_size(model, x, y, k):
    m = len(x) // k
    for i in range(k):
        (model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) / m).backward()


def accumulate_with_chunks(model, x, y, k):
    """Right, written differently: torch.chunk and a weight per micro-batch's share of rows."""
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (model.loss(xs, ys) * len(xs) / len(x)).backward()


def test_grad_accumulation_names_each_mistake():
    check_grad_accumulation(accumulate_with_chunks)
    with fails("k=4: every gradient is 2× the right one — each micro-batch's loss divided "
               "by its size m = 2"):   # m = 2 rows, k = 4 (at k = 2, m = 4 = k²: both named)
        check_grad_accumulation(accumulate_by_micro_batch_size)


def _slices(start, stop):
    """A micro-batch loop whose i-th slice is tokens[start(i, m) : stop(i, m)]."""
    def accumulate(model, x, y, k):
        m = len(x) // k
        for i in range(k):
            part = slice(start(i, m), stop(i, m))
            (model.loss(x[part], y[part]) / k).backward()
    return accumulate


def hard_coded_k(model, x, y, k):
    k = 2
    m = len(x) // k
    for i in range(k):
        (model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) / k).backward()


def hard_coded_divisor(model, x, y, k):
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (model.loss(xs, ys) / 2).backward()


def zero_grad_inside(model, x, y, k):
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        model.zero_grad()
        (model.loss(xs, ys) / k).backward()


def shifted_targets(model, x, y, k):
    xs, ys = x.chunk(k), y.chunk(k)
    for i in range(k):
        (model.loss(xs[i], ys[(i + 1) % k]) / k).backward()


def by_batch_size(model, x, y, k):
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (model.loss(xs, ys) / len(x)).backward()


def own_cross_entropy(model, x, y, k):
    """Right, written differently: tensor_split, logits and cross-entropy by hand, mean of
    per-sequence losses weighted by the share of rows."""
    import torch.nn.functional as F
    for xs, ys in zip(x.tensor_split(k), y.tensor_split(k)):
        logits = model(xs).float()
        F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum").div(ys.numel() * k).backward()


@pytest.mark.parametrize("fn, pattern", [
    (_slices(lambda i, m: i * m, lambda i, m: (i + 1) * m + 1), "k=2: .*samples \\[4\\] are in more than one"),
    (_slices(lambda i, m: i * m, lambda i, m: (i + 1) * m - 1), "k=2: .*samples \\[3, 7\\] are in none"),
    (_slices(lambda i, m: i, lambda i, m: i + m), "more than one and samples \\[5, 6, 7\\] are in none"),
    (hard_coded_k, "k=4: 2 forward pass\\(es\\) of sizes \\[4, 4\\], expected k = 4"),
    (hard_coded_divisor, "divided by 2 whatever k is .*is k hard-coded"),
    (zero_grad_inside, "only the last micro-batch's gradient"),
    (shifted_targets, "micro-batch 0 has the tokens of samples \\[0, 1, 2, 3\\] but the targets of "
                      "samples \\[4, 5, 6, 7\\]"),
    (by_batch_size, "divided by the batch size 8, not by k = 2"),
], ids=["overlapping slices", "skipped samples", "slice i:i+m", "hard-coded k", "hard-coded divisor",
        "zero_grad inside", "targets of another slice", "batch size"])
def test_grad_accumulation_mistakes(fn, pattern):
    _mistake(check_grad_accumulation, fn, pattern)


def test_grad_accumulation_right_by_hand():
    check_grad_accumulation(own_cross_entropy)


@pytest.mark.parametrize("fn, pattern", [
    (lambda n, p, acc: n * 16, "fp32_grad_accum=True changes nothing"),
    (lambda n, p, acc: n * (16 + 4 * (p == "bf16")), "4 bytes too many: the fp32 gradient accumulation buffer"),
    (lambda n, p, acc: n * ((16 if p == "fp32" else 18) + 4 * acc), "bf16 weights and gradients are 2 bytes"),
    (lambda n, p, acc: n * ((16 if p == "fp32" else 12) + 4 * acc), "or Adam's moments kept in bf16"),
], ids=["accumulation ignored", "accumulation always", "bf16 grads in fp32", "moments in bf16"])
def test_bytes_per_param_more_mistakes(fn, pattern):
    _mistake(check_bytes_per_param, fn, pattern)


@pytest.mark.parametrize("fn, pattern", [
    (lambda L, s, b, h, a, flash=False: L * s * b * h * (32 + (0 if flash else 5 * a * s / h)),
     "c₁ = 32, c₂ = 5; expected 34 and 5; c₁ fits each of: one of .* left out; or both dropout masks left out"),
    (lambda L, s, b, h, a, flash=False: L * s * b * h * (34 + (0 if flash else 6 * a * s / h)),
     "c₂ = 6.*c₂: the scores' dropout mask at 2 bytes per value \\(a mask is 1\\)"),
    (lambda L, s, b, h, a, flash=False: L * s * b * h * (36 + (0 if flash else 4 * a * s / h)),
     "c₁ = 36, c₂ = 4"),
], ids=["no masks", "score mask 2 bytes", "both off"])
def test_activation_bytes_constants_named(fn, pattern):
    _mistake(check_activation_bytes, fn, pattern)


def activation_without_k(L, s, b, h, a, flash=False):
    """Wrong: K left out of the attention's saved tensors (c₁ = 32) — the same constant as
    leaving out both dropout masks, so the check must not name the masks alone."""
    attention = 2 + 2 + 2 + 2 + 1            # QKV input, Q, V, out-proj input, mask
    per_layer = s * b * h * (attention + 19 + 4) + (0 if flash else 5 * a * s * s * b)
    return L * per_layer


def activation_by_tensor(L, s, b, h, a, flash=False):
    """Right, written differently: every saved tensor listed with its element count and bytes."""
    sbh, scores = s * b * h, a * s * s * b
    saved = [(sbh, 2), (2 * sbh, 2), (sbh, 2), (sbh, 2), (sbh, 1), (sbh, 2), (4 * sbh, 2),
             (4 * sbh, 2), (sbh, 1), (2 * sbh, 2)] + ([] if flash else [(scores, 2), (scores, 1), (scores, 2)])
    return L * sum(n * width for n, width in saved)


def test_leaving_out_k_is_not_reported_as_the_masks_alone():
    check_activation_bytes(activation_by_tensor)
    with pytest.raises(ExerciseFailed) as info:
        check_activation_bytes(activation_without_k)
    (line,) = info.value.problems
    assert re.search("c₁ = 32.*Q, K, V.* left out; or both dropout masks left out", line), line


def accumulate_dividing_by_k_twice(model, x, y, k):
    """Wrong: each micro-batch's loss divided by k twice — at k = 2 that is the micro-batch
    size m = 4 too, so that case must name both."""
    m = len(x) // k
    for i in range(k):
        (model.loss(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) / k / k).backward()


def test_a_divisor_shared_by_two_slips_names_both():
    with pytest.raises(ExerciseFailed) as info:
        check_grad_accumulation(accumulate_dividing_by_k_twice)
    k2 = next(p for p in info.value.problems if p.startswith("k=2"))
    assert "its size m = 4" in k2 and "divided by k twice" in k2, k2
    k4 = next(p for p in info.value.problems if p.startswith("k=4"))
    assert "divided by k twice" in k4 and "its size" not in k4, k4

"""Generation (picolib.generate): the K/V cache gives the logits of full forwards, greedy
decoding equals the argmax of repeated full forwards, a checkpoint written at tp2 loads
into one process, and bad input is one argparse-style line with exit status 2."""
import pytest
import torch

from picolib import checkpoint
from picolib.compose import TrainConfig
from picolib.generate import generate, main, model_from_checkpoint, sample
from picolib.launch import run
from picolib.model import KVCache, LlamaConfig, TinyLlama
from picolib.train import train

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                  max_seq=40, seed=3)
PROMPT = [5, 17, 2, 40, 33]


def sharp_model(impl):
    """Float64, with q and k weights 20× init: attention that depends on positions strongly
    enough that a cache at the wrong positions changes the greedy tokens."""
    model = TinyLlama(CFG.replace(attn_impl=impl)).double()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.wq.weight.mul_(20)
            blk.attn.wk.weight.mul_(20)
    return model


def full_forward_greedy(model, prompt, n):
    """The reference: rerun the whole sequence for each new token, take the argmax."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_cached_logits_equal_full_forwards(impl):
    model = sharp_model(impl)
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        parts = [model(ids[:, :5], cache=cache)] + [model(ids[:, i:i + 1], cache=cache)
                                                    for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)   # float64
    assert cache.length == 12


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_greedy_decoding_equals_the_argmax_of_repeated_full_forwards(impl):
    model = sharp_model(impl)
    got = generate(model, PROMPT, 30, temperature=0)
    assert got == full_forward_greedy(model, PROMPT, 30)
    assert len(set(got)) > 3                      # not one token repeated: the test can tell


def test_sampling_top_k_and_temperature():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, 5, g)) for _ in range(300)}
    assert draws == set(logits[0].topk(5).indices.tolist())          # only the 5 likeliest, all seen
    assert int(sample(logits, 1.0, 1, g)) == int(logits.argmax()) == int(sample(logits, 0.0))
    model = TinyLlama(CFG)
    a, b = (generate(model, PROMPT, 20, temperature=1.0, seed=s) for s in (7, 7))
    assert a == b and a != generate(model, PROMPT, 20, temperature=1.0, seed=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of the tiny preset written by the trainer on two tensor-parallel ranks."""
    folder = tmp_path_factory.mktemp("gen") / "ckpt"
    run(train, 2, TrainConfig(tp=2, steps=2, progress=False, save=str(folder)), timeout=240)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tp2_checkpoint_loads_into_one_process_and_the_cli_decodes_greedily(ckpt, capsys):
    model, preset, step = model_from_checkpoint(ckpt)                  # preset inferred
    assert preset == "tiny" and step == checkpoint.latest(ckpt)
    params = checkpoint.load(step, model.cfg)[0]
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    fresh = TinyLlama(model.cfg)                                       # the trainer moved them
    assert not torch.equal(fresh.blocks[0].attn.wq.weight, model.blocks[0].attn.wq.weight)
    text = main([str(ckpt), "--prompt", "The ", "--tokens", "12", "--temperature", "0"])
    assert capsys.readouterr().out == text + "\n"
    want = full_forward_greedy(model, list(b"The "), 12)
    assert text == bytes(list(b"The ") + want).decode("utf-8", errors="replace")


def _error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m picolib.generate")
    return err.splitlines()[-1]


def test_bad_input_is_one_line_and_exit_2(ckpt, tmp_path, capsys):
    line = _error([str(tmp_path / "nowhere")], capsys)
    assert line == f"python -m picolib.generate: error: {tmp_path / 'nowhere'}: no such checkpoint folder"
    assert "no complete checkpoint" in _error([str(tmp_path)], capsys)
    assert "embed.weight is (256, 32) in the checkpoint but (256, 64)" in \
        _error([str(ckpt), "--preset", "small"], capsys)
    assert "unknown preset 'huge'" in _error([str(ckpt), "--preset", "huge"], capsys)
    for option, value, words in (("--tokens", "0", "--tokens must be at least 1"),
                                 ("--temperature", "-1", "--temperature must be 0"),
                                 ("--top-k", "-2", "--top-k must be 0"),
                                 ("--top-k", "300", "more than the vocabulary (256)"),
                                 ("--prompt", "", "--prompt must not be empty"),
                                 ("--tokens", "many", "invalid int value")):
        assert words in _error([str(ckpt), option, value], capsys), option

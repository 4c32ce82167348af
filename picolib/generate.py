"""Text from a trained checkpoint: load it into one process and sample, with a K/V cache.

    python -m picolib.generate CKPT --prompt "The pipeline" --tokens 200 --temperature 0.8 --top-k 40

CKPT is a folder written by `python -m picolib.train --save` (its newest complete step) or
one step folder, saved on any mesh: the checkpoint holds the whole single-process tensors
(`picolib.checkpoint`), so one process reads them as they are. The model's shapes come
from `--preset` (checked against the checkpoint) or, without it, from the preset whose
shapes the checkpoint has. Tokens are bytes, as the trainer's text: the prompt is its UTF-8
bytes, the output is decoded back (a byte sequence that is not UTF-8 shows as �).

Decoding with a K/V cache (`picolib.model.KVCache`): the prompt runs once, every later step
runs one token, whose keys and values join the cache and whose query attends to all of it —
s steps cost s token-forwards instead of the 1 + 2 + … + s of recomputing the whole prefix.
`--temperature 0` is greedy decoding (the argmax); it equals the argmax of repeated full
forwards (tests/lib/test_generate.py). Lesson 10b trains the checkpoints this reads.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from .checkpoint import check_resume, latest, load
from .compose import MODEL_PRESETS
from .model import KVCache, LlamaConfig, TinyLlama

__all__ = ["generate", "sample", "model_from_checkpoint", "main"]


def sample(logits, temperature: float = 1.0, top_k: int = 0, generator=None) -> torch.Tensor:
    """One token id per row of `logits` (b, vocab): the argmax at temperature 0, else a draw
    from softmax(logits / temperature) over the `top_k` likeliest (0: all)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: TinyLlama, prompt: list[int], tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """`tokens` new token ids after `prompt` (one sequence), sampled with a K/V cache."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache()
    logits = model(torch.tensor([prompt], device=device), cache=cache)[:, -1]   # the prompt, once
    out = []
    for i in range(tokens):
        token = sample(logits, temperature, top_k, g)
        out.append(int(token))
        if i + 1 < tokens:
            logits = model(token.view(1, 1), cache=cache)[:, -1]             # one token a step
    return out


def model_from_checkpoint(path, preset: str | None = None, max_seq: int = 256,
                          attn_impl: str = "sdpa") -> tuple[TinyLlama, str, Path]:
    """(model with the checkpoint's weights, its preset, the step folder read). Raises
    ValueError naming what is wrong: no folder, no complete step, shapes of no preset."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such checkpoint folder")
    if latest(path) is None:
        raise ValueError(f"{path}: no complete checkpoint in it (a folder written by "
                         f"`python -m picolib.train --save`, or one of its step-NNNNNN folders)")
    names = [preset] if preset else list(MODEL_PRESETS)
    why = {}
    for name in names:
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
        cfg = LlamaConfig(**MODEL_PRESETS[name], max_seq=max(max_seq, 16), attn_impl=attn_impl)
        try:
            step = check_resume(path, cfg)
        except ValueError as e:
            why[name] = str(e).replace("--resume ", "", 1)
            continue
        model = TinyLlama(cfg)
        with warnings.catch_warnings():   # DCP says it reads in one process: that is the point
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
            model.load_state_dict(load(step, cfg)[0])
        return model.eval(), name, step
    if preset:
        raise ValueError(f"--preset {preset}: {why[preset]}")
    raise ValueError(f"{path}: its shapes match no preset ({', '.join(MODEL_PRESETS)}); "
                     f"{why[names[0]]}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picolib.generate",
                                description="Sample text from a checkpoint written by "
                                            "`python -m picolib.train --save`, in one process.")
    p.add_argument("checkpoint", help="the --save folder (its newest step) or one step-NNNNNN folder")
    p.add_argument("--prompt", default="The ", help="text the sample continues (UTF-8, not empty)")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens (bytes) to sample")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="softmax temperature; 0 = greedy (the likeliest token each step)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--preset", default=None,
                   help="model size (" + ", ".join(MODEL_PRESETS) + "); default: the one the checkpoint's shapes match")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    return p


def main(argv=None) -> str:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompt = list(args.prompt.encode("utf-8"))
    if not prompt:
        parser.error("--prompt must not be empty (the first token is sampled after it)")
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, not {args.tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be 0 (greedy) or more, not {args.temperature:g}")
    if args.top_k < 0:
        parser.error(f"--top-k must be 0 (all tokens) or more, not {args.top_k}")
    try:
        model, preset, step = model_from_checkpoint(args.checkpoint, args.preset,
                                                    max_seq=len(prompt) + args.tokens)
    except ValueError as e:      # bad input: one line and exit 2, as argparse does
        parser.error(str(e))
    if args.top_k > model.cfg.vocab_size:
        parser.error(f"--top-k {args.top_k} is more than the vocabulary ({model.cfg.vocab_size})")
    ids = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    text = bytes(prompt + ids).decode("utf-8", errors="replace")
    print(f"[{step} · preset {preset} · {args.tokens} tokens · temperature {args.temperature:g}"
          f"{f' · top-k {args.top_k}' if args.top_k else ''}]", file=sys.stderr)
    print(text)
    return text


if __name__ == "__main__":
    main()

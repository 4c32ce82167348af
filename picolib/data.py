"""Training and validation data, each data-parallel rank reading only its own share (lesson 10b).

A data source is a 1-D sequence of token ids:
- a UTF-8 text file: its bytes are the tokens (vocabulary 256), as picolib has always used,
  read through `numpy.memmap` too. The default ("course") is the shipped corpus,
  picolib/data/course.txt (the course's own prose, about half a megabyte;
  `tools/make_corpus.py` assembles it); "text" is the original 2.5 KB paragraph (tiny.txt,
  `model.TextData`'s, which the trainer's `--data text` trains on whole);
- a prepared token file `*.bin`: a flat array of uint16 ids read through `numpy.memmap`, the
  layout nanoGPT's train.bin and Megatron-LM's .bin use. Write one from text with

      python -m picolib.data prepare IN.txt OUT.bin

  (a small OUT.bin.json beside it records the vocabulary). Nothing is read until a batch
  asks for it, and then only the bytes of its own windows.

The last VAL_FRACTION of every source is the validation split; training windows lie wholly
in the part before it, so no training step ever sees a held-out token.

Step `step`'s global batch is `batch` windows of seq + 1 tokens whose starts are drawn from
a generator seeded by (seed, step) alone: the position in the data is a function of the step,
so a run resumed from a checkpoint of step k sees exactly the batches the uninterrupted run
saw. Data-parallel rank r of dp owns rows [r·batch/dp, (r+1)·batch/dp) of that batch (the
rows `tensor.chunk(dp)[r]` would give) and `batch_for_rank` reads only those windows: every
layout trains on the same global batch, and no rank reads another's share.

Validation takes the held-out split's first K batches in order (`val_batches`): window j of
batch k starts at (k·batch + j)·seq. Each rank sums the token losses of its rows and counts
its tokens; `global_mean_loss` adds both over the ranks that hold different tokens (dp and
cp) and divides, so the result is the mean over every token whatever the layout.
"""
from __future__ import annotations

import argparse
import codecs
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

__all__ = ["VAL_FRACTION", "COURSE", "TokenData", "val_batches", "mean_token_loss",
           "global_mean_loss", "prepare"]

VAL_FRACTION = 0.10                              # the last tenth of a source is held out
COURSE = Path(__file__).parent / "data" / "course.txt"
TINY = Path(__file__).parent / "data" / "tiny.txt"   # model.TextData's 2.5 KB paragraph
SPLITS = ("train", "val", "all")
_CHUNK = 1 << 24                                 # bytes per read when preparing or scanning


def _source(path) -> Path:
    if path is None or str(path) == "course":
        return COURSE
    if str(path) == "text":          # the trainer's --data text: the original paragraph
        return TINY
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no data file at {p}: give a UTF-8 text file or a token file "
                                "written by `python -m picolib.data prepare IN.txt OUT.bin`")
    return p


class TokenData:
    """One split of a token source; see the module docstring.

    `TokenData()` is the shipped corpus's training split, `TokenData(path, "val")` a file's
    held-out tail, `split="all"` the whole source. `tokens` is this split's array (an
    `np.memmap` view for token files, so opening reads nothing); only `len` and slices of it
    are used, one slice per window read."""

    def __init__(self, path=None, split: str = "train", val_fraction: float = VAL_FRACTION,
                 check: bool = True):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), not {val_fraction}")
        self.path, self.split = _source(path), split
        # both kinds through numpy.memmap: opening reads nothing, a window reads its own bytes.
        # `check`: read the whole file once to check it (UTF-8 text; a token file's largest
        # id when no OUT.bin.json says its vocabulary); the trainer checks once, before any
        # rank starts, and its ranks open with check=False
        token_file = self.path.suffix == ".bin"
        ids = _memmap(self.path, np.uint16 if token_file else np.uint8)
        self._vocab = None if token_file else 256
        if check:
            if token_file:
                self._vocab = _bin_vocab(self.path, ids)
            else:
                _check_utf8(self.path)
        n = len(ids)
        cut = n - int(n * val_fraction)
        self.tokens = {"train": ids[:cut], "val": ids[cut:], "all": ids}[split]

    @property
    def vocab_size(self) -> int:
        if self._vocab is None:
            self._vocab = _bin_vocab(self.path, _memmap(self.path, np.uint16))
        return self._vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def describe(self) -> dict:
        """What a checkpoint can store to say which data a run used."""
        return {"path": str(self.path), "split": self.split, "tokens": len(self),
                "vocab_size": self.vocab_size}

    # ------------------------------------------------------------------ reading windows
    def _windows(self, starts, seq: int, columns=None):
        if columns is None:
            rows = [np.asarray(self.tokens[s:s + seq + 1], dtype=np.int64) for s in starts]
            w = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, seq + 1, dtype=torch.long)
            return w[:, :-1].contiguous(), w[:, 1:].contiguous()
        cols = np.asarray(columns, dtype=np.int64)   # only these positions (and the next ones)
        if cols.ndim != 1 or (len(cols) and (cols.min() < 0 or cols.max() >= seq)):
            raise ValueError(f"columns must be positions in [0, {seq}), not {columns!r}")
        x = [np.asarray(self.tokens[s:s + seq + 1][cols], dtype=np.int64) for s in starts]
        y = [np.asarray(self.tokens[s:s + seq + 1][cols + 1], dtype=np.int64) for s in starts]
        if not x:
            return (torch.empty(0, len(cols), dtype=torch.long),) * 2
        return torch.from_numpy(np.stack(x)), torch.from_numpy(np.stack(y))

    @staticmethod
    def _rows(batch: int, dp_rank: int, dp: int) -> range:
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is not a rank of dp={dp}")
        if batch % dp:
            raise ValueError(f"batch={batch} does not split evenly over dp={dp}")
        local = batch // dp
        return range(dp_rank * local, (dp_rank + 1) * local)

    def global_starts(self, step: int, batch: int, seq: int, seed: int = 0) -> list[int]:
        """Where each window of step `step`'s global training batch begins (no data read)."""
        if len(self) < seq + 2:
            raise ValueError(f"seq={seq} needs at least {seq + 2} tokens; the {self.split} "
                             f"split of {self.path.name} has {len(self)}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(0, len(self) - seq - 1, (batch,), generator=g).tolist()

    def batch_for_rank(self, step: int, batch: int, seq: int, seed: int = 0,
                       dp_rank: int = 0, dp: int = 1, columns=None):
        """(tokens, targets), each (batch/dp, seq) long: rank `dp_rank`'s rows of step
        `step`'s global batch, reading only those rows' windows. `columns`: the positions of
        each sequence this rank holds (context parallelism: `context_parallel.positions`);
        then only those tokens are read, (batch/dp, len(columns)) each."""
        rows = self._rows(batch, dp_rank, dp)
        starts = self.global_starts(step, batch, seq, seed)
        return self._windows([starts[i] for i in rows], seq, columns)

    def batch(self, batch: int, seq: int, step: int = 0, seed: int = 0):
        """The whole global batch of `step` (one process); model.TextData's signature."""
        return self.batch_for_rank(step, batch, seq, seed)

    def val_batch_for_rank(self, k: int, batch: int, seq: int, dp_rank: int = 0, dp: int = 1,
                           columns=None):
        """Rank `dp_rank`'s rows of the k-th batch of consecutive windows of this split
        (`columns`: as in `batch_for_rank`)."""
        rows = self._rows(batch, dp_rank, dp)
        need = ((k + 1) * batch) * seq + 1
        if need > len(self):
            raise ValueError(f"{k + 1} batches of {batch}x{seq} need {need} tokens; the "
                             f"{self.split} split of {self.path.name} has {len(self)} "
                             f"(at most {(len(self) - 1) // (batch * seq)} batches)")
        return self._windows([(k * batch + i) * seq for i in rows], seq, columns)

    def val_batches(self, K: int, batch: int, seq: int, dp_rank: int = 0, dp: int = 1,
                    columns=None):
        """The first K batches of consecutive windows (this rank's rows), always the same."""
        return [self.val_batch_for_rank(k, batch, seq, dp_rank, dp, columns) for k in range(K)]

    def max_val_batches(self, batch: int, seq: int) -> int:
        """How many batches of `batch` × `seq` consecutive windows this split holds."""
        return max(0, (len(self) - 1) // (batch * seq))


def val_batches(K: int, batch: int, seq: int, path=None, dp_rank: int = 0, dp: int = 1):
    """The held-out split's first K batches of `path` (default: the shipped corpus)."""
    return TokenData(path, "val").val_batches(K, batch, seq, dp_rank, dp)


# ---------------------------------------------------------------------- the mean over tokens

def mean_token_loss(loss_sums, token_counts) -> float:
    """Σ loss sums / Σ token counts: the mean over all tokens, however the ranks (or the
    batches) divided them. Averaging per-rank means instead is wrong when counts differ."""
    total = sum(float(c) for c in token_counts)
    if total <= 0:
        raise ValueError("no tokens were counted")
    return math.fsum(float(s) for s in loss_sums) / total


def global_mean_loss(loss_sum: float, token_count: int, group=None) -> float:
    """In a process group: this rank's summed token loss and token count, added over `group`
    (float64, through picolib.comm so a Ledger sees it), divided. Pass the group of the ranks
    holding different tokens — dp and cp, `mesh.group("dp", "cp")` — on the stage that computes
    the loss; tp ranks hold the same loss and must not be added again."""
    from . import comm
    # a CPU tensor: gloo carries it, in an NCCL run's groups too (cpu:gloo,cuda:nccl)
    t = torch.tensor([float(loss_sum), float(token_count)], dtype=torch.float64)
    comm.all_reduce(t, group=group)
    return mean_token_loss([t[0].item()], [t[1].item()])


# ---------------------------------------------------------------------- token files

def _memmap(path: Path, dtype):
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"{path} is empty")
    if size % item:
        raise ValueError(f"{path} holds {size} bytes, not a whole number of {np.dtype(dtype).name} "
                         "tokens: a token file (.bin) is written by `python -m picolib.data prepare`")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_utf8(path: Path) -> None:
    """Read the file in chunks, decoding it; a ValueError naming the first bad byte."""
    decoder, n = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text (byte {n + e.start}); a token file "
                                 "must end in '.bin' (write one with `python -m picolib.data "
                                 "prepare`)") from None
            n += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{path} ends inside a UTF-8 character: not UTF-8 text") from None


def _bin_vocab(path: Path, ids) -> int:
    meta = path.with_name(path.name + ".json")
    if meta.is_file():
        return int(json.loads(meta.read_text())["vocab_size"])
    top = 0                      # a file from elsewhere (nanoGPT): the largest id, read once
    for i in range(0, len(ids), _CHUNK):
        top = max(top, int(ids[i:i + _CHUNK].max()))
    return top + 1


def prepare(src, dst) -> int:
    """Write the bytes of UTF-8 text `src` as uint16 token ids to `dst` (and `dst`.json);
    returns the number of tokens. Reads and writes in chunks, so any size fits in memory."""
    src, dst = Path(src), Path(dst)
    if dst.suffix != ".bin":
        raise ValueError(f"the token file must end in '.bin' (picolib.data reads '.bin' as "
                         f"tokens and anything else as text), not {dst.name!r}")
    try:
        n = _write_tokens(src, dst)
    except ValueError:
        dst.unlink(missing_ok=True)
        raise
    dst.with_name(dst.name + ".json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes", "tokens": n,
         "source": src.name}, indent=1) + "\n")
    return n


def _write_tokens(src: Path, dst: Path) -> int:
    decoder, n = codecs.getincrementaldecoder("utf-8")(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"{src} is not UTF-8 text (near byte {n + e.start})") from None
            fout.write(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tobytes())
            n += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{src} ends inside a UTF-8 character: not UTF-8 text") from None
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m picolib.data",
                                 description="Prepare and inspect picolib's training data.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write a UTF-8 text file as a uint16 token file (.bin)")
    p.add_argument("src", metavar="IN.txt", help="UTF-8 text file")
    p.add_argument("dst", metavar="OUT.bin", help="token file to write (numpy.memmap, uint16)")
    i = sub.add_parser("info", help="tokens and splits of a data file")
    i.add_argument("path", nargs="?", default=None, help="text or .bin file (default: shipped corpus)")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        if not Path(args.src).is_file():
            ap.error(f"IN.txt: no file at {args.src}")
        try:
            n = prepare(args.src, args.dst)
        except (ValueError, OSError) as e:
            ap.error(str(e))
        print(f"wrote {args.dst}: {n:,} tokens (uint16, vocabulary 256)")
        return 0
    try:
        parts = {s: TokenData(args.path, s).describe() for s in ("train", "val")}
    except (ValueError, OSError) as e:
        ap.error(str(e))
    t, v = parts["train"], parts["val"]
    print(f"{t['path']}: {t['tokens'] + v['tokens']:,} tokens, vocabulary {t['vocab_size']}; "
          f"train {t['tokens']:,}, validation {v['tokens']:,} (the last {VAL_FRACTION:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

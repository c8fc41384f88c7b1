"""A character-level corpus from the Python standard library's own sources.

The files are the top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]`` in
sorted order, ASCII ones only, up to `max_chars` characters: the same text for a given
Python version, read from disk (about 0.1 s), so nothing is downloaded or cached. Every
tenth file is held out for validation, so validation text is code the model never saw.

A training block is `block_size` consecutive characters of ONE file: a block that
reaches a file's end is padded, and the targets there are `IGNORE_INDEX`. Blocks
therefore hold different numbers of tokens, which is what a summed loss with a token
count (``ms.backward(loss_sum, count=n_tokens)``) is for.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

IGNORE_INDEX = -100
"""Target of a padding position: `F.cross_entropy(..., ignore_index=...)` skips it."""
PAD = 0
"""Input id of a padding position (the causal mask keeps it out of real predictions)."""


def stdlib_files(max_chars: int) -> list[tuple[str, str]]:
    """(name, text) of the stdlib's top-level ASCII modules, sorted, up to `max_chars`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_bytes().decode("ascii")
        except UnicodeDecodeError:  # a handful of modules; a smaller vocab is worth more
            continue
        if total + len(text) > max_chars:
            break
        files.append((path.name, text))
        total += len(text)
    if not files:
        raise RuntimeError(f"no ASCII *.py files under {root} within {max_chars} characters")
    return files


class Split:
    """The files of one split as one id tensor, with where each position's file ends."""

    def __init__(self, texts: list[str], stoi: dict[str, int]) -> None:
        table = torch.zeros(128, dtype=torch.long)  # ASCII code -> id
        for c, i in stoi.items():
            table[ord(c)] = i
        raw = bytearray("".join(texts).encode("ascii"))
        self.ids = table[torch.frombuffer(raw, dtype=torch.uint8).long()]
        lengths = torch.tensor([len(t) for t in texts])
        ends = lengths.cumsum(0)
        # file_end[i]: one past the last character of position i's file.
        self.file_end = torch.repeat_interleave(ends, lengths)
        # A block may start anywhere that has at least one target in the same file.
        self.starts = torch.nonzero(torch.arange(len(self.ids)) + 1 < self.file_end).squeeze(1)

    def __len__(self) -> int:
        return len(self.ids)

    def blocks(self, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (len(starts), block_size) for blocks beginning at `starts`."""
        idx = starts[:, None] + torch.arange(block_size + 1)
        inside = idx < self.file_end[starts][:, None]
        tok = self.ids[idx.clamp(max=len(self.ids) - 1)]
        x = tok[:, :-1].masked_fill(~inside[:, :-1], PAD)
        y = tok[:, 1:].masked_fill(~inside[:, 1:], IGNORE_INDEX)
        return x, y


class CharCorpus:
    """Vocabulary, train and validation splits, and seeded block sampling."""

    def __init__(self, max_chars: int = 2_000_000, val_every: int = 10) -> None:
        files = stdlib_files(max_chars)
        self.files = [name for name, _ in files]
        # Id 0 is padding; the characters follow in code-point order.
        self.chars = sorted({c for _, text in files for c in text})
        self.stoi = {c: i + 1 for i, c in enumerate(self.chars)}
        val = [t for i, (_, t) in enumerate(files) if i % val_every == val_every - 1]
        train = [t for i, (_, t) in enumerate(files) if i % val_every != val_every - 1]
        self.train, self.val = Split(train, self.stoi), Split(val, self.stoi)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i - 1] if i > 0 else "" for i in ids.tolist())

    def sample(self, generator: torch.Generator, n: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` training blocks at random starts drawn from `generator`."""
        pick = torch.randint(len(self.train.starts), (n,), generator=generator)
        return self.train.blocks(self.train.starts[pick], block_size)

    def ragged_blocks(self, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` training blocks that end 0 to `block_size` + 3 characters before a file's
        end, so they hold anything from no target to a full block: the uneven batches on
        which a merged step is checked against the big-batch step."""
        ends = self.train.file_end.unique()
        i = torch.arange(n)
        starts = ends[i % len(ends)] - 1 - (3 * i) % (block_size + 4)
        return self.train.blocks(starts, block_size)

    def val_blocks(self, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` validation blocks, the same every call: evenly spaced over the split."""
        starts = self.val.starts[torch.linspace(0, len(self.val.starts) - 1, n).long()]
        return self.val.blocks(starts, block_size)

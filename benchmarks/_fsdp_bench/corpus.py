# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The embedded training corpus: English-like text generated deterministically, a word tokenizer, batches.

Nothing is downloaded: a small grammar with fixed word lists and a fixed-seed ``random.Random`` writes the same
text on every machine, so every run, rank and peer trains on identical data and loss curves are comparable.
"""

import functools
import random
import re
from collections import Counter
from typing import Dict, List, Tuple

import torch

_SUBJECTS = (
    "the engineer",
    "a student",
    "the old sailor",
    "my neighbour",
    "the small robot",
    "a quiet child",
    "the teacher",
    "the baker",
    "a tired runner",
    "the gardener",
    "our captain",
    "the young doctor",
    "a curious fox",
    "the river",
    "the north wind",
    "a grey cat",
    "the village choir",
    "the night train",
    "an honest clerk",
)
_VERBS = (
    "builds",
    "reads",
    "carries",
    "paints",
    "watches",
    "finds",
    "mends",
    "counts",
    "follows",
    "remembers",
    "opens",
    "sells",
    "writes",
    "cleans",
    "measures",
    "hides",
    "shares",
    "plants",
    "answers",
    "studies",
)
_OBJECTS = (
    "a wooden boat",
    "the long letter",
    "three red apples",
    "the broken clock",
    "a map of the coast",
    "the heavy box",
    "an old song",
    "the kitchen window",
    "a bag of seeds",
    "the last page",
    "a silver key",
    "the evening paper",
    "two paper lanterns",
    "the stone bridge",
    "a warm loaf",
    "the garden gate",
)
_PLACES = (
    "near the harbour",
    "in the morning",
    "after the rain",
    "by the fire",
    "at the market",
    "under the old oak",
    "before dinner",
    "on the hill",
    "in the library",
    "during the storm",
    "behind the station",
    "every sunday",
)
_LINKS = ("and then", "because", "while", "so", "but", "although", "until", "before", "after")
_TAILS = (
    "the lights went out",
    "everyone was asleep",
    "the bells rang twice",
    "the snow began to fall",
    "the shop was closed",
    "a letter arrived",
    "the tide came in",
    "nobody noticed",
    "the work was done",
)

UNK, EOS = "<unk>", "<eos>"
_TOKEN_RE = re.compile(r"[a-z]+|[.,;!?]")


def _sentence(rng: random.Random) -> str:
    head = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        head += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.45:
        head += f" {rng.choice(_LINKS)} {rng.choice(_TAILS)}"
    return head + rng.choice(".....!?")


def generate_text(num_sentences: int = 6000, seed: int = 1234) -> str:
    """The corpus text: ``num_sentences`` sentences of a fixed grammar, the same for a given seed everywhere."""
    rng = random.Random(seed)
    paragraphs, current = [], []
    for _ in range(num_sentences):
        current.append(_sentence(rng))
        if len(current) >= rng.randint(3, 7):
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n".join(paragraphs)


def build_vocab(text: str, vocab_size: int) -> Dict[str, int]:
    """Word-level vocabulary: ``<unk>``, ``<eos>``, then words by decreasing frequency (ties alphabetical).

    Words beyond ``vocab_size`` map to ``<unk>``; ids up to ``vocab_size - 1`` that no word uses simply never occur
    (the model's embedding still has ``vocab_size`` rows, so the parameter count is what was asked for).
    """
    counts = Counter(_TOKEN_RE.findall(text.lower()))
    words = sorted(counts, key=lambda w: (-counts[w], w))[: max(0, vocab_size - 2)]
    return {UNK: 0, EOS: 1, **{w: i + 2 for i, w in enumerate(words)}}


def tokenize(text: str, vocab: Dict[str, int]) -> torch.Tensor:
    """Token ids of ``text`` (one ``<eos>`` after each paragraph), as a 1-D int64 tensor."""
    ids: List[int] = []
    for line in text.lower().split("\n"):
        ids.extend(vocab.get(tok, 0) for tok in _TOKEN_RE.findall(line))
        ids.append(vocab[EOS])
    return torch.tensor(ids, dtype=torch.long)


@functools.lru_cache(maxsize=None)
def corpus_tokens(vocab_size: int) -> int:
    """How many tokens the embedded corpus has (what ``--seq-len`` must stay below)."""
    text = generate_text()
    return int(tokenize(text, build_vocab(text, vocab_size)).numel())


class Corpus:
    """Token stream plus a deterministic batch sampler shared by every peer.

    Args:
        vocab_size: size of the model's vocabulary.
        seq_len: tokens per training sequence (targets are the next tokens).
        seed: seed of the batch sampling (the text itself is fixed).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        text = generate_text()
        self.vocab = build_vocab(text, vocab_size)
        self.tokens = tokenize(text, self.vocab)
        self.seq_len = seq_len
        self.seed = seed
        if self.tokens.numel() <= seq_len + 1:
            raise ValueError(f"--seq-len {seq_len} is longer than the embedded corpus ({self.tokens.numel()} tokens)")

    def batch(self, step: int, microbatch: int, rank: int, world_size: int, batch: int) -> Tuple[torch.Tensor, ...]:
        """This rank's ``(inputs, targets)`` of one microbatch, each ``(batch, seq_len)`` int64.

        The global microbatch (``world_size * batch`` sequences) depends only on the seed, the step and the
        microbatch index, so every peer, and any world size, sees the same global data.
        """
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + microbatch)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (world_size * batch,), generator=g)
        mine = starts[rank * batch : (rank + 1) * batch]
        offsets = torch.arange(self.seq_len + 1)
        window = self.tokens[mine[:, None] + offsets[None, :]]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

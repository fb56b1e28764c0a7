"""Built-in tasks: prompts and reference answers generated in code, so tidal runs with no data file.

Each task enumerates its prompts deterministically and splits them into a train and an eval split.
Prompts are short (at most 8 characters) and use only characters of the tiny presets' char
tokenizer (``tidal.model.tokenizer``); answers are scored with the ``exact`` reward.

``digit-sum`` (the embedded default)
    ``a+b=`` with ``a, b`` in 0..4; the answer is the single digit ``a+b`` followed by the end
    token. The reward depends on the prompt: no fixed answer is right for more than 1/9 of the
    training prompts, because each sum 0..8 is drawn equally often (the 25 pairs are repeated so
    that, e.g., ``0+0=`` comes up as often as the five pairs that sum to 4 together). With the
    natural frequencies, answering "4" to everything is right 5 times in 25, and GRPO from random
    initialisation reliably collapses onto that answer before it learns the sums; with equal
    frequencies a rising reward means the sums are being learnt. The space is too small to hold
    prompts out (a tiny model does not generalise addition to pairs it never saw), so eval is the
    greedy accuracy over all 25 pairs, each once.

    Learnability from random init (2-layer, 100k-parameter llama, char tokenizer, 32 prompts x 8
    samples, AdamW 3e-3, exact reward; in-process loop on a loaded 2-core CPU): with at most 2
    response tokens the reward rises from ~0.01 to ~0.6 in 100 steps; with 1 token it reaches ~0.7
    in 70; with 4 tokens most early steps are spent learning to stop, and it is ~0.2 after 100.
``arith``
    ``ab+cd=`` or ``ab-cd=`` with two-digit operands 10..99 (subtraction keeps the larger operand
    first, so answers are non-negative); answers have up to three digits. One prompt in ten,
    chosen by a hash of its text (so independent of the seed), is held out for eval.

The seed picks the order of the train split (shuffled again each epoch by the dataset) and which
held-out prompts are evaluated when ``eval_size`` caps them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from tidal.errors import UserError

Row = tuple[str, str]  # (prompt, label)


@dataclass(frozen=True)
class TaskSplits:
    train: list[Row]
    eval: list[Row]


def _held_out(prompt: str, one_in: int) -> bool:
    """Whether a prompt belongs to the eval split: a stable hash, the same on every machine and run."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") % one_in == 0


def digit_sum() -> TaskSplits:
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(5) for b in range(5)]
    train: list[Row] = []
    for total in range(9):
        same_sum = [row for row in pairs if row[1] == str(total)]
        # 60 is a multiple of every group size (1..5): each sum then fills 60 rows of the 540.
        train += [row for row in same_sum for _ in range(60 // len(same_sum))]
    return TaskSplits(train=train, eval=pairs)


def arith() -> TaskSplits:
    train: list[Row] = []
    held: list[Row] = []
    for a in range(10, 100):
        for b in range(10, 100):
            for prompt, label in ((f"{a}+{b}=", str(a + b)), (f"{max(a, b)}-{min(a, b)}=", str(abs(a - b)))):
                (held if _held_out(prompt, 10) else train).append((prompt, label))
    # a-b and b-a give the same prompt: keep each once.
    return TaskSplits(train=list(dict.fromkeys(train)), eval=list(dict.fromkeys(held)))


TASKS: dict[str, Callable[[], TaskSplits]] = {"digit-sum": digit_sum, "arith": arith}

# Held-out prompts evaluated per eval round: greedy decoding of 64 short prompts is about a second
# on a 2-core CPU with the tiny presets.
DEFAULT_EVAL_SIZE = 64


def task_rows(name: str, seed: int, eval_size: int | None = DEFAULT_EVAL_SIZE) -> TaskSplits:
    """The task's (prompt, label) rows: train in a seed-dependent order, eval capped at ``eval_size``.

    The same ``(name, seed)`` always gives the same rows in the same order.
    """
    if name not in TASKS:
        raise UserError(f"--task {name!r}: no such built-in task; use one of {', '.join(TASKS)} or pass --prompt-data")
    splits = TASKS[name]()
    rng = random.Random(f"{name}/{seed}")
    train = list(splits.train)
    rng.shuffle(train)
    held = list(splits.eval)
    if eval_size is not None and len(held) > eval_size:
        held = rng.sample(held, eval_size)
    return TaskSplits(train=train, eval=held)

"""Built-in tasks: (prompt, label) rows generated in code, so a run needs no data file.

``digit-sum`` and ``arith`` prompts are at most 8 characters, all in the character vocabulary of the
tiny presets (``tidal.model.tokenizer``), and end with ``=``; the label is the answer written as
digits, scored by the ``exact`` reward (the response must be the answer and then the end token) or
``math``. ``mental-math`` is for real instruct models.

``digit-sum`` (the embedded default)
    ``a+b=`` with ``a, b`` in 0..4, answer ``a+b`` (one digit). Made to be learnt from random
    initialisation by a 2-layer ~100k-parameter model within minutes of GRPO on a 2-core CPU:

    * the answer is a single token, so a random policy finds it now and then, and every GRPO group
      with one success carries a gradient;
    * the answer depends on both digits of the prompt, so no fixed token scores well;
    * the train split is *balanced by answer*: each of the 9 sums is equally frequent (pairs of a
      rare sum such as 0+0 repeat more often). With the natural frequencies one answer (4) is right
      for 5 of 25 prompts and a fresh policy collapses onto it, after which every group is all-right
      or all-wrong and GRPO has no gradient left. Balanced, the best constant answer scores 1/9, so
      a mean reward well above 0.11 means the sums are being learnt.

    How fast depends on the response budget, because with ``exact`` every token after the digit
    must be the end token (or nothing): GRPO through these modules on the ``tiny`` preset (32
    prompts x 8 samples, lr 3e-3, one step per rollout) reached a mean reward of 0.74 after 60
    rollouts with ``--rollout-max-response-len 1``, 0.39 with 2, and 0.10 with 4.

    Its 25 prompts are too few to hold some out (a model this small does not generalise addition to
    pairs it never saw), so its eval split is every distinct prompt once, decoded greedily.
``arith``
    ``ab+cd=`` or ``ab-cd=`` with two-digit operands 10..99 (subtraction puts the larger operand
    first, so answers are non-negative), answers of one to three digits. One prompt in ten, chosen by
    a hash of its text (the same on every machine), is held out as the eval split.

``mental-math`` (for instruct models: chat prompts, ``--rm-type math``)
    ``What is a + b?``, ``What is a - b?`` (a >= b) and ``What is a times b?`` (a, b >= 2) with
    single-digit operands, asked as chat messages under the system message "Answer with only the
    number." (rendered by the model's chat template). One question in four, by a hash of its text,
    is held out as the eval split (49 questions). Made for ``--preset smollm2-135m-cpu``:
    SmolLM2-135M-Instruct knows most of these sums, but under this system message it mostly
    starts explaining and runs out of its 12-token budget before the number, so its greedy
    accuracy starts near 0.08 (0.47 with the model's own default system message and 16 tokens):
    room to improve on questions it can answer.

``guess`` (multi-turn, for the tiny presets; its environment is ``tidal.rollout.envs.GuessEnv``)
    The prompt ``guess:`` and a hidden digit 0, 1 or 2 as the label, each digit equally often;
    the policy guesses one character per turn and the environment answers higher / lower. The
    eval split is each digit once.

``calculator`` (multi-turn, for instruct models with a chat template: ``tidal.rollout.envs.CalculatorEnv``)
    ``What is a times b?`` (a in 3..9, b in 11..59), under a system message that offers a
    ``calculator`` tool in the Hermes/Qwen ``<tool_call>`` format; the label is the product. One
    question in ten, by a hash of its text, is held out (at most ``eval_size`` evaluated).

The seed decides the order of the train split (the dataset reshuffles it every epoch from the seed
as well) and which held-out prompts are evaluated when ``eval_size`` caps them; the same ``(name,
seed)`` always gives the same rows.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.errors import UserError

Row = tuple[Any, str]  # (prompt: text or chat messages, label)

# Held-out prompts evaluated per eval round: greedy decoding of 64 short prompts takes about a second
# with the tiny presets on a 2-core CPU.
DEFAULT_EVAL_SIZE = 64


@dataclass(frozen=True)
class TaskSplits:
    train: list[Row]
    eval: list[Row]


def _held_out(prompt: str, one_in: int) -> bool:
    """Whether a prompt is in the eval split: a stable hash of its text, independent of seed and host."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") % one_in == 0


def digit_sum() -> TaskSplits:
    by_sum: dict[int, list[Row]] = {}
    for a in range(5):
        for b in range(5):
            by_sum.setdefault(a + b, []).append((f"{a}+{b}=", str(a + b)))
    # Repeat each pair so every sum gets the same weight: sums have 1..5 pairs, and 60 is the least
    # common multiple of 1..5, so each sum contributes exactly 60 rows (540 in all).
    train = [row for rows in by_sum.values() for row in rows for _ in range(60 // len(rows))]
    distinct = [row for rows in by_sum.values() for row in rows]
    return TaskSplits(train=train, eval=sorted(distinct))


def arith() -> TaskSplits:
    rows: dict[str, str] = {}
    for a in range(10, 100):
        for b in range(10, 100):
            rows[f"{a}+{b}="] = str(a + b)
            rows[f"{max(a, b)}-{min(a, b)}="] = str(abs(a - b))  # a-b and b-a: the same prompt, kept once
    train = [(p, lab) for p, lab in rows.items() if not _held_out(p, 10)]
    held = [(p, lab) for p, lab in rows.items() if _held_out(p, 10)]
    return TaskSplits(train=train, eval=held)


_SYSTEM = "Answer with only the number."


def mental_math() -> TaskSplits:
    questions: dict[str, str] = {}
    for a in range(10):
        for b in range(10):
            questions[f"What is {a} + {b}?"] = str(a + b)
            if a >= b:
                questions[f"What is {a} - {b}?"] = str(a - b)
            if a >= 2 and b >= 2:
                questions[f"What is {a} times {b}?"] = str(a * b)

    def chat(q: str) -> list[dict]:
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": q}]

    train = [(chat(q), lab) for q, lab in questions.items() if not _held_out(q, 4)]
    held = [(chat(q), lab) for q, lab in questions.items() if _held_out(q, 4)]
    return TaskSplits(train=train, eval=held)


def guess() -> TaskSplits:
    rows = [("guess:", str(h)) for h in range(3)]
    return TaskSplits(train=rows * 60, eval=rows)


CALCULATOR_SYSTEM = (
    "You have one tool, a calculator. To use it, reply with exactly\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
    "(with your own expression). The result comes back in <tool_response> tags. "
    "Then reply with only the number."
)


def calculator() -> TaskSplits:
    # Some products a small model knows by heart (a start for the reward), most it does not: the tool helps.
    questions = {f"What is {a} times {b}?": str(a * b) for a in range(3, 10) for b in range(11, 60)}

    def chat(q: str) -> list[dict]:
        return [{"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": q}]

    train = [(chat(q), lab) for q, lab in questions.items() if not _held_out(q, 10)]
    held = [(chat(q), lab) for q, lab in questions.items() if _held_out(q, 10)]
    return TaskSplits(train=train, eval=held)


TASKS: dict[str, Callable[[], TaskSplits]] = {
    "digit-sum": digit_sum,
    "arith": arith,
    "mental-math": mental_math,
    "guess": guess,
    "calculator": calculator,
}
MULTI_TURN_TASKS = ("guess", "calculator")  # answered turn by turn by an environment (tidal.rollout.envs)


def task_rows(name: str, seed: int, eval_size: int | None = DEFAULT_EVAL_SIZE) -> TaskSplits:
    """The task's rows: train in a seed-dependent order, eval capped at ``eval_size`` (None: all)."""
    if name not in TASKS:
        raise UserError(f"--task {name!r}: no such built-in task; use one of {', '.join(TASKS)} or pass --prompt-data")
    splits = TASKS[name]()
    rng = random.Random(f"tidal-task/{name}/{seed}")
    train = list(splits.train)
    rng.shuffle(train)
    held = list(splits.eval)
    if eval_size is not None and len(held) > eval_size:
        held = sorted(rng.sample(held, eval_size))
    return TaskSplits(train=train, eval=held)

"""Reward functions: score one response against its prompt's reference label.

Every reward function has the signature ``fn(prompt, response_text, label) -> float``: ``prompt`` is
the dataset's prompt (text or chat messages, before any template), ``response_text`` the decoded
response without special tokens, ``label`` the dataset's reference answer (any JSON value). It is a
plain function, called once per sample on the driver, after generation; rewards of a group are then
turned into advantages by ``tidal.algos.advantages``.

Built-in functions (``--rm-type``):

``exact``
    1.0 when the response equals the label after stripping surrounding whitespace, else 0.0. The
    built-in tasks use it: ``3+4=`` is answered by exactly ``7`` and then the end token; "7 apples"
    or "77" score 0.
``math``
    The answer is the content of the last ``\\boxed{...}`` in the response, or else the last number
    in it. It is compared numerically with the label (``7.0`` equals ``7``, ``1,000`` equals
    ``1000``, ``\\frac{1}{2}`` and ``1/2`` equal ``0.5``); when either side is not a number the two
    are compared as strings with whitespace and ``$`` removed.
``format``
    1.0 when the response has the form an answer is expected in, regardless of correctness: it
    contains a complete, non-empty ``\\boxed{...}``, or the whole stripped response is one number
    (the form of the built-in tasks). Useful as a sanity reward and as a shaping term in a custom
    function.

``--custom-rm-path module:function`` replaces them with a user function of the same signature. A
user function that raises, or returns something that is not a finite number, stops the run with a
``UserError`` naming the function, the sample index and the problem.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from tidal.errors import UserError
from tidal.rollout.plugins import load_callable
from tidal.rollout.types import Sample

RewardFn = Callable[[Any, str, Any], float]

# A number as people write it: optional sign, digits with optional thousands separators, optional
# decimals; or a bare decimal fraction (.5).
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in text (nested braces allowed), or None if there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i, depth = start + len("\\boxed{"), 1
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[begin : i - 1]
        # Unclosed (a truncated response): look at an earlier, complete one.
        start = text.rfind("\\boxed{", 0, start)
    return None


def to_number(text: Any) -> float | None:
    """Parse a label or an extracted answer as a number; None when it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().strip("$").strip()
    s = s.replace("\\!", "").replace(" ", "").rstrip(".")
    if s.startswith("\\boxed{") and s.endswith("}"):
        s = s[len("\\boxed{") : -1]
    frac = _FRAC.match(s)
    if frac:
        num, den = to_number(frac.group(1)), to_number(frac.group(2))
        return num / den if num is not None and den not in (None, 0.0) else None
    if s.count("/") == 1:
        num_s, den_s = s.split("/")
        num, den = to_number(num_s), to_number(den_s)
        return num / den if num is not None and den not in (None, 0.0) else None
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def extract_answer(response: str) -> str | None:
    """The answer of a response: the last ``\\boxed{}`` content, else the last number, else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def exact_reward(prompt: Any, response: str, label: Any) -> float:
    """1.0 when the stripped response equals the stripped label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


def math_reward(prompt: Any, response: str, label: Any) -> float:
    """1.0 when the extracted answer equals the label numerically (or as a normalised string)."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got, want = to_number(answer), to_number(label)
    if got is not None and want is not None:
        return 1.0 if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0

    def norm(x: Any) -> str:
        return re.sub(r"\s+", "", str(x)).strip("$")

    return 1.0 if norm(answer) == norm(label) else 0.0


def format_reward(prompt: Any, response: str, label: Any) -> float:
    """1.0 when the response holds a non-empty ``\\boxed{}`` or is exactly one number; label unused."""
    boxed = last_boxed(response)
    if boxed is not None and boxed.strip():
        return 1.0
    return 1.0 if _NUMBER.fullmatch(response.strip()) else 0.0


BUILTIN: dict[str, RewardFn] = {"exact": exact_reward, "math": math_reward, "format": format_reward}


def reward_name(fn: Callable) -> str:
    """``module.function`` of a reward function, for messages."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def get_reward_fn(rm_type: str = "exact", custom_rm_path: str | None = None) -> RewardFn:
    """The reward function for ``--rm-type`` or, when given, the user's ``--custom-rm-path``."""
    if custom_rm_path:
        fn = load_callable(custom_rm_path, what="--custom-rm-path")
        if inspect.iscoroutinefunction(fn):
            raise UserError(
                f"--custom-rm-path {custom_rm_path!r} is an async function; pass a plain function (prompt, response, label) -> float"
            )
        try:
            inspect.signature(fn).bind("prompt", "response", "label")
        except TypeError:
            raise UserError(
                f"--custom-rm-path {custom_rm_path!r}: {reward_name(fn)} must accept three arguments (prompt, response, label)"
            ) from None
        except ValueError:
            pass  # callables without an inspectable signature (C functions): checked when called
        return fn
    if rm_type not in BUILTIN:
        raise UserError(
            f"--rm-type {rm_type!r}: unknown reward; use one of {', '.join(BUILTIN)} or --custom-rm-path module:function"
        )
    return BUILTIN[rm_type]


def score_samples(samples: Sequence[Sample], fn: RewardFn) -> Sequence[Sample]:
    """Fill ``sample.reward`` of every sample with ``fn(prompt, response_text, label)``; returns them."""
    for s in samples:
        try:
            value = fn(s.prompt, s.response_text, s.label)
        except Exception as e:
            raise UserError(
                f"reward function {reward_name(fn)} raised on sample {s.index}: {type(e).__name__}: {e}; fix the function or the label"
            ) from e
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise UserError(
                f"reward function {reward_name(fn)} returned {type(value).__name__} {value!r:.60} for sample {s.index}; return a float"
            ) from None
        if not math.isfinite(reward):
            raise UserError(
                f"reward function {reward_name(fn)} returned {reward} for sample {s.index}; return a finite float"
            )
        s.reward = reward
    return samples

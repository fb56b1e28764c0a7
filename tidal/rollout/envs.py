"""The built-in multi-turn tasks' environments (``--task guess``, ``--task calculator``).

``GuessEnv`` (``--task guess``, for the tiny presets)
    A hidden digit (the row's label, 0, 1 or 2) and two guesses. The policy answers with one
    character; the environment replies ``h`` (the hidden digit is higher), ``l`` (lower) or ``?``
    (not a digit), and ends the game with reward 1 on a right guess, or 0 after the second wrong
    one. The prompt is the same for every row, so the first guess cannot know the digit: a policy
    that ignores the replies scores at most 2/3 (two different digits), one that reads them scores
    1 (guess 1, then 0 after ``l`` or 2 after ``h``). Every turn and every reply is one token of
    the character tokenizer, so a random-init 2-layer model learns it in a few dozen rollouts on a
    2-core CPU (``tests/unit/test_agent.py``).
``CalculatorEnv`` (``--task calculator``, for ``--preset smollm2-135m-cpu``)
    A product of a digit and a two-digit number, asked in chat under a system message that describes a
    ``calculator`` tool in the Hermes/Qwen ``<tool_call>`` format. A turn holding a call is
    answered with the result (as a ``user`` message in ``<tool_response>`` tags, which every chat
    template can render); a turn without one is the answer, scored by the ``math`` reward (the
    last number in it against the label) and ending the trajectory. At most three tool answers.
    SmolLM2-135M-Instruct rarely writes a call unprompted (none in 8 samples at temperature 1 on
    ``55 times 77``), so its first rewards come from products it knows; whether RL then teaches it
    the tool within a CPU budget is not measured.
"""

from __future__ import annotations

import ast
import operator

from tidal.rollout.env import Action, Environment, StepResult
from tidal.rollout.rewards import BUILTIN
from tidal.rollout.tools import TOOL_CALL_STOP, parse_tool_calls, run_tool_calls, tool_response


class GuessEnv(Environment):
    stop: list[str] = []
    role = "env"
    guesses = 2

    def reset(self, sample) -> None:
        self.hidden = int(sample.label)
        self.left = self.guesses
        return None

    def step(self, action: Action) -> StepResult:
        guess = action.text.strip()
        self.left -= 1
        if guess == str(self.hidden):
            return StepResult(None, 1.0, True)
        if self.left == 0:
            return StepResult(None, 0.0, True)
        if len(guess) != 1 or not guess.isdigit():
            return StepResult("?", 0.0, False)
        return StepResult("h" if self.hidden > int(guess) else "l", 0.0, False)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses (nothing else is evaluated)."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    value = ev(ast.parse(str(expression).replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEnv(Environment):
    stop = [TOOL_CALL_STOP]
    role = "user"
    max_calls = 3

    def reset(self, sample) -> None:
        self.label, self.prompt, self.calls = sample.label, sample.prompt, 0
        return None

    def step(self, action: Action) -> StepResult:
        calls = parse_tool_calls(action.text)
        if not calls or self.calls >= self.max_calls:
            return StepResult(None, BUILTIN["math"](self.prompt, action.text, self.label), True)
        self.calls += 1
        results = run_tool_calls(calls, {"calculator": calculate})
        return StepResult("\n".join(tool_response(r) for r in results), 0.0, False)


BUILTIN_ENVS = {"guess": GuessEnv, "calculator": CalculatorEnv}

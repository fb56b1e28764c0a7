"""The environment interface of multi-turn rollouts, and the checked calls the agent loop makes into it.

An environment answers a policy's turns for one trajectory (``tidal.rollout.agent`` makes one
instance per trajectory, with no arguments)::

    class MyEnv(tidal.rollout.env.Environment):
        stop = ["</tool_call>"]          # stop strings that end a policy turn (besides the end token)
        role = "tool"                    # the chat role of observations (with a chat template)

        def reset(self, sample) -> str | list[int] | None:       # first observation (None: nothing)
            ...
        def step(self, action) -> StepResult | tuple:             # (observation, reward, done)
            ...

``sample`` is the trajectory's ``tidal.rollout.types.Sample`` (``prompt``, ``label``,
``metadata`` as the dataset gave them); ``action`` an ``Action``: the policy turn's text and its
token ids exactly as generated. An observation is text (tokenised once, on its own, and appended
after the policy's turn; with a chat template, wrapped as a ``role`` message) or token ids (appended
as they are). Either method may be ``async def``; plain ones run in a daemon thread each, so a slow or
blocking environment never holds up the others, and every call is bounded by ``--env-timeout``.

Loaded by ``--env-path module:Class`` (or ``path/to/file.py:Class``); the built-in tasks' classes
are in ``tidal.rollout.envs``. Everything an environment gets wrong (raises, returns something that
is not an observation or a finite reward, never answers) stops the run with a ``UserError``: one
line naming the environment, the trajectory (index and prompt), the turn and the fix.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from tidal.errors import UserError


@dataclass
class Action:
    """One policy turn as the environment sees it."""

    text: str  # decoded without special tokens
    ids: list[int]  # exactly as the engine generated them
    turn: int  # 0-based policy turn of the trajectory
    finished: bool  # the turn ended on the end token or a stop string (False: cut at the turn's token limit)


@dataclass
class StepResult:
    observation: str | list[int] | None
    reward: float = 0.0
    done: bool = False


class Environment:
    """Base class of environments (see the module docstring); subclasses override ``reset`` and ``step``."""

    stop: ClassVar[list[str]] = []
    role: ClassVar[str] = "tool"

    def reset(self, sample: Any) -> str | list[int] | None:
        return None

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError


def load_env(path: str) -> Callable[[], Any]:
    """The environment class named by ``--env-path``; it must build with no arguments."""
    from tidal.rollout.plugins import load_callable

    cls = load_callable(path, "--env-path")
    if not inspect.isclass(cls):
        raise UserError(f"--env-path {path!r}: names a {type(cls).__name__}, not a class; name an environment class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise UserError(f"--env-path {path!r}: {cls.__name__} has no {method}() method; subclass Environment")
    return cls


class EnvCaller:
    """Checked, time-bounded calls into one kind of environment, errors as one ``UserError`` line.

    ``name`` is what messages call the environment (its ``--env-path``, or the built-in task's class).
    """

    def __init__(self, name: str, timeout: float, vocab_size: int):
        self.name, self.timeout, self.vocab = name, timeout, vocab_size

    def where(self, sample: Any, turn: int | None, method: str) -> str:
        at = "" if turn is None else f", turn {turn}"
        return f"environment {self.name}: {method}() of trajectory {sample.index} (prompt {_short(sample.prompt)}{at})"

    def make(self, cls: Callable[[], Any], sample: Any) -> Any:
        try:
            return cls()
        except Exception as e:
            raise UserError(
                f"{self.where(sample, None, '__init__')} raised {type(e).__name__}: {e}; it must build with no arguments"
            ) from e

    async def _call(self, fn: Callable, arg: Any, where: str) -> Any:
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(arg), self.timeout)
            out = await asyncio.wait_for(_in_daemon_thread(fn, arg), self.timeout)
            if inspect.isawaitable(out):  # a plain function that returned a coroutine
                out = await asyncio.wait_for(out, self.timeout)
            return out
        except (TimeoutError, asyncio.TimeoutError):
            raise UserError(
                f"{where} did not return within {self.timeout:g} s (--env-timeout); make it answer, or raise the limit"
            ) from None
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{where} raised {type(e).__name__}: {e}; fix the environment") from e

    async def reset(self, env: Any, sample: Any) -> str | list[int] | None:
        where = self.where(sample, None, "reset")
        return self.observation(await self._call(env.reset, sample, where), where)

    async def step(self, env: Any, sample: Any, action: Action) -> StepResult:
        where = self.where(sample, action.turn, "step")
        out = await self._call(env.step, action, where)
        if isinstance(out, tuple) and len(out) == 3:
            out = StepResult(*out)
        if not isinstance(out, StepResult):
            raise UserError(
                f"{where} returned {type(out).__name__} {_short(out)}; return StepResult(observation, reward, done) "
                "or an (observation, reward, done) tuple"
            )
        try:
            reward = float(out.reward)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward) or isinstance(out.reward, bool):
            raise UserError(f"{where} returned reward {_short(out.reward)}; return a finite number")
        if not isinstance(out.done, bool):
            raise UserError(f"{where} returned done={_short(out.done)}; return True or False")
        return StepResult(self.observation(out.observation, where), reward, out.done)

    def observation(self, obs: Any, where: str) -> str | list[int] | None:
        if obs is None or isinstance(obs, str):
            return obs
        if isinstance(obs, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs):
            bad = [t for t in obs if not 0 <= t < self.vocab]
            if bad:
                raise UserError(
                    f"{where} returned token id {bad[0]}, outside the vocabulary ({self.vocab}); "
                    "return text, or ids of the model's tokenizer"
                )
            return obs
        raise UserError(
            f"{where} returned observation {type(obs).__name__} {_short(obs)}; return text, a list of token ids, or None"
        )


def _in_daemon_thread(fn: Callable, arg: Any) -> asyncio.Future:
    """``fn(arg)`` in a daemon thread of its own: one that never returns is abandoned at the timeout and
    cannot keep the process from exiting (``asyncio.to_thread``'s pool would be joined at exit)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            value, ok = fn(arg), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed: nobody waits for this answer any more
            pass

    threading.Thread(target=work, daemon=True, name="tidal-env").start()
    return fut


def _short(x: Any, n: int = 40) -> str:
    text = repr(x)
    return text if len(text) <= n else text[: n - 3] + "..."

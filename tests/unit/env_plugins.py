"""Environments for the multi-turn tests, loaded by ``--env-path tests/unit/env_plugins.py:Name``.

``Countdown`` is a well-behaved custom environment; the others each break one rule.
"""

from __future__ import annotations

import asyncio
import time

from tidal.rollout.env import Environment, StepResult


class Countdown(Environment):
    """Replies with the turn number as text ("3", "2", ...) for three turns, reward 0.5 each turn;
    async, to check both kinds of method."""

    role = "env"

    async def reset(self, sample):
        self.left = 3
        return "go:"

    async def step(self, action):
        self.left -= 1
        return StepResult(str(self.left) + ":", 0.5, self.left == 0)


class Raises(Environment):
    def step(self, action):
        raise ValueError("the tool crashed")


class BadTuple(Environment):
    def step(self, action):
        return ("obs", 1.0)


class NanReward(Environment):
    def step(self, action):
        return ("obs", float("nan"), False)


class BadIds(Environment):
    def step(self, action):
        return StepResult([1, 2, 10_000_000], 0.0, False)


class BadObservation(Environment):
    def reset(self, sample):
        return {"text": "a dict is not an observation"}


class Hangs(Environment):
    def step(self, action):
        time.sleep(5)


class HangsAsync(Environment):
    async def step(self, action):
        await asyncio.sleep(5)


class NeverDone(Environment):
    role = "env"

    def step(self, action):
        return StepResult("a", 0.0, False)


class BadStop(Environment):
    stop = "</call>"  # a string, not a list of strings


class NeedsArgs(Environment):
    def __init__(self, size):
        self.size = size


NotAClass = 3

"""Multi-turn rollouts: the agent loop that drives the engines turn by turn against environments.

Every trajectory starts as its prompt's ids. Each turn, all trajectories still running go to the
engines together as one batch (``orchestrate.run_engines``: whole calls per engine, engine deaths
survived), each request's prompt being the trajectory's whole context so far. The policy's new
tokens are appended exactly as the engine returned them (ids and raw-policy log-probs, loss mask
1); the environment (``tidal.rollout.env``) then answers every trajectory at once (``asyncio``;
plain environments in worker threads), and its observation is tokenised once, on its own, and
appended with loss mask 0. Nothing is ever re-tokenised from the concatenated text: the ids the
engine saw are the ids the trainer trains on.

A trajectory ends when its environment says ``done`` (status ``completed``), after ``--max-turns``
policy turns, or when its response (policy and environment tokens) reaches
``--max-trajectory-tokens`` or its context the model's positions (status ``truncated``; the last
turn or observation is cut to fit). Each policy turn is at most ``--rollout-max-response-len``
tokens and ends at the end token, a ``--rollout-stop`` string or one of the environment's ``stop``
strings.

With a chat template (``--apply-chat-template``, a tokenizer that has one) an observation is wrapped
as a message of the environment's ``role``: the text the template puts between the end of an
assistant turn and the next assistant turn, found by rendering a two-message conversation with
and without it (``ChatFrame``). When the policy's turn ended on the end token, that token is not
supplied again.

Rewards (``--agent-reward``): ``env`` the sum of the environment's step rewards, ``rm`` the reward
function (``--rm-type`` / ``--custom-rm-path``) over the whole trajectory (its prompt, the decoded
response of every turn, the label), ``sum`` both added.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.errors import UserError
from tidal.rollout.env import Action, EnvCaller, load_env
from tidal.rollout.types import Sample, SamplingParams, Turn

_MARK = "\x1fOBSERVATION\x1f"


def agent_environment(cfg) -> tuple[str, Any] | None:
    """(name, environment class) of the run: ``--env-path``, or a built-in multi-turn task's; None: single-turn."""
    r, d = cfg.rollout, cfg.data
    if r.env_path:
        return r.env_path, load_env(r.env_path)
    if d.prompt_data is None:
        from tidal.rollout.envs import BUILTIN_ENVS

        cls = BUILTIN_ENVS.get(d.task)
        if cls is not None:
            return f"{cls.__module__}:{cls.__qualname__}", cls
    return None


def make_agent(cfg, tokenizer) -> AgentLoop | None:
    """The run's agent loop (None for single-turn runs); the environment class is loaded once, here."""
    found = agent_environment(cfg)
    if found is None:
        return None
    from tidal.model.load import model_config, resolve_model

    spec = resolve_model(cfg.model.model, cfg.model.tokenizer, cfg.model.trust_remote_code)
    text = model_config(spec).get_text_config()
    return AgentLoop(
        found[0], found[1], cfg, tokenizer, getattr(text, "max_position_embeddings", None), text.vocab_size
    )


class ChatFrame:
    """The text around an observation of ``role`` in a chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, role: str):
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        try:
            head = tokenizer.apply_chat_template(base, tokenize=False)
            full = tokenizer.apply_chat_template(
                [*base, {"role": role, "content": _MARK}], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:
            raise UserError(
                f"the chat template cannot render an observation as a {role!r} message ({type(e).__name__}: {e}); "
                "set the environment's role to one the template knows (e.g. user)"
            ) from None
        if not full.startswith(head) or full.count(_MARK) != 2:
            raise UserError(
                f"the chat template changes earlier turns when a {role!r} message follows; "
                "observations cannot be appended token by token with it (use --no-apply-chat-template)"
            )
        self.closing = head[head.index(_MARK) + len(_MARK) :]  # after an assistant turn's content
        self.before, self.after = full[len(head) :].split(_MARK)
        eos = tokenizer.eos_token or ""
        self.eos_text = eos

    def wrap(self, text: str, ended_on_eos: bool) -> str:
        closing = self.closing
        if ended_on_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return closing + self.before + text + self.after


@dataclass
class Trajectory:
    sample: Sample
    env: Any
    context: list[int]
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    policy_turns: int = 0
    env_reward: float = 0.0
    done: bool = False
    status: str = "truncated"

    @property
    def response(self) -> list[int]:
        return self.context[len(self.sample.prompt_ids) :]

    def append(self, ids: Sequence[int], role: str, logprobs: Sequence[float] | None = None) -> None:
        if not ids:
            return
        start = len(self.context) - len(self.sample.prompt_ids)
        self.context.extend(ids)
        policy = role == "assistant"
        self.logprobs.extend(logprobs if policy else [0.0] * len(ids))
        self.mask.extend([1 if policy else 0] * len(ids))
        self.turns.append(Turn(role, start, start + len(ids)))


@dataclass
class AgentLoop:
    """One rollout's trajectories: ``run(generate, samples, sampling)`` fills every sample as a trajectory.

    ``generate(requests, sampling) -> requests`` is one batched engine call (the driver's
    ``orchestrate.run_engines`` over every engine, or one engine's ``generate`` in process).
    """

    name: str
    env_cls: Any
    cfg: Any  # the run's TidalConfig
    tokenizer: Any
    positions: int | None = None  # the model's max positions (None: no limit)
    vocab_size: int | None = None  # the model's vocabulary (None: the tokenizer's)
    figures: dict = field(default_factory=dict)

    def run(self, generate: Callable, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        return asyncio.run(self._run(generate, samples, sampling))

    async def _run(self, generate: Callable, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        r = self.cfg.rollout
        caller = EnvCaller(self.name, r.env_timeout, self.vocab_size or len(self.tokenizer))
        chat = self.cfg.data.apply_chat_template and getattr(self.tokenizer, "chat_template", None)
        role = getattr(self.env_cls, "role", "tool")
        frame = ChatFrame(self.tokenizer, role) if chat else None
        stop = getattr(self.env_cls, "stop", None) or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise UserError(f"environment {self.name}: stop is {stop!r}; give a list of non-empty strings")
        turn_sampling = SamplingParams(**{**sampling.__dict__, "stop": [*sampling.stop, *stop]})
        trajs = [Trajectory(x, caller.make(self.env_cls, x), list(x.prompt_ids)) for x in samples]
        first = await asyncio.gather(*(caller.reset(t.env, t.sample) for t in trajs))
        for t, obs in zip(trajs, first):
            self._observe(t, obs, frame, ended_on_eos=False)
        gen_s, env_s = 0.0, 0.0
        for turn in range(r.max_turns):
            active = [t for t in trajs if not t.done and self._room(t, 1)]
            for t in trajs:
                if not t.done and t not in active:
                    t.done = True  # no room left for a turn
            if not active:
                break
            t0 = time.perf_counter()
            outs = await asyncio.to_thread(self._generate, generate, active, turn_sampling)
            gen_s += time.perf_counter() - t0
            stepping = []
            for t, out in zip(active, outs):
                if self._take_turn(t, out, turn):
                    stepping.append((t, out))
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(caller.step(t.env, t.sample, self._action(out, turn)) for t, out in stepping)
            )
            env_s += time.perf_counter() - t0
            for (t, out), res in zip(stepping, results):
                t.env_reward += res.reward
                if res.done:
                    t.done, t.status = True, "completed"
                elif turn + 1 < r.max_turns:
                    self._observe(t, res.observation, frame, ended_on_eos=self._ended_on_eos(out))
        self.figures = {"agent/generate_s": gen_s, "agent/env_s": env_s}
        return [self._finish(t) for t in trajs]

    # ---- one turn -------------------------------------------------------------------------------
    def _room(self, t: Trajectory, need: int) -> bool:
        return self._budget(t) >= need

    def _budget(self, t: Trajectory) -> int:
        r = self.cfg.rollout
        left = r.max_trajectory_tokens - len(t.response)
        if self.positions is not None:
            left = min(left, self.positions - len(t.context))
        return left

    def _generate(self, generate: Callable, active: list[Trajectory], sampling: SamplingParams) -> list[Sample]:
        reqs = [
            Sample(
                index=i,
                group=i,
                prompt=t.sample.prompt,
                label=t.sample.label,
                prompt_ids=list(t.context),
                metadata=t.sample.metadata,
            )
            for i, t in enumerate(active)
        ]
        # The engines check prompt + max_new_tokens against the model's positions, so a turn asks for no
        # more than the fullest context has room for (the trajectory budget is applied when appending).
        new = sampling.max_new_tokens
        if self.positions is not None:
            new = min(new, min(self.positions - len(t.context) for t in active))
        turn = SamplingParams(**{**sampling.__dict__, "max_new_tokens": max(1, new)})
        outs = sorted(generate(reqs, turn), key=lambda x: x.index)
        if [x.index for x in outs] != list(range(len(reqs))):
            raise RuntimeError(f"the engines answered {len(outs)} of {len(reqs)} requests of a turn")
        return outs

    def _take_turn(self, t: Trajectory, out: Sample, turn: int) -> bool:
        """Append the policy's turn; False when the trajectory ends here (budget reached)."""
        ids, lps = list(out.response_ids), list(out.response_logprobs)
        left = self._budget(t)
        cut = len(ids) > left
        t.append(ids[:left], "assistant", lps[:left])
        t.policy_turns += 1
        t.sample.weight_version = out.weight_version
        if cut or not self._room(t, 1):
            t.done = True
            return not cut  # a cut turn is not a finished action; the environment does not see it
        return True

    def _observe(self, t: Trajectory, obs: Any, frame: ChatFrame | None, *, ended_on_eos: bool) -> None:
        if obs is None or (isinstance(obs, str) and not obs):
            return
        if isinstance(obs, str):
            text = frame.wrap(obs, ended_on_eos) if frame is not None else obs
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = list(obs)
        left = self._budget(t)
        t.append(ids[: max(left, 0)], getattr(self.env_cls, "role", "tool"))
        if len(ids) >= left:
            t.done = True  # no room for another policy turn

    def _ended_on_eos(self, out: Sample) -> bool:
        eos = self.tokenizer.eos_token_id
        return bool(out.response_ids) and eos is not None and out.response_ids[-1] == eos

    def _action(self, out: Sample, turn: int) -> Action:
        return Action(text=out.response_text, ids=list(out.response_ids), turn=turn, finished=out.status == "completed")

    def _finish(self, t: Trajectory) -> Sample:
        from tidal.rollout.generate import decode_ids  # torch and transformers: the tokenizer needs them

        x = t.sample
        x.response_ids = t.response
        x.response_logprobs = t.logprobs
        x.loss_mask = t.mask
        x.turns = t.turns
        x.status = t.status
        x.response_text = decode_ids(self.tokenizer, list(x.response_ids))
        x.metadata = {**x.metadata, "env_reward": t.env_reward, "policy_turns": t.policy_turns}
        return x


def score_trajectories(samples: Sequence[Sample], mode: str, reward_fn) -> None:
    """Each trajectory's reward from ``--agent-reward``: the environment's, the reward function's, or their sum."""
    from tidal.rollout.rewards import score_samples

    env = [float(x.metadata.get("env_reward", 0.0)) for x in samples]
    if mode == "env":
        for x, v in zip(samples, env):
            x.reward = v
        return
    score_samples(samples, reward_fn)
    if mode == "sum":
        for x, v in zip(samples, env):
            x.reward += v


def trajectory_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    n = max(1, len(samples))
    policy = sum(x.num_policy_tokens for x in samples)
    total = sum(len(x.response_ids) for x in samples)
    return {
        "agent/turns_mean": sum(x.metadata.get("policy_turns", 0) for x in samples) / n,
        "agent/policy_tokens_mean": policy / n,
        "agent/env_tokens_mean": (total - policy) / n,
        "agent/env_reward_mean": sum(x.metadata.get("env_reward", 0.0) for x in samples) / n,
        "agent/completed_frac": sum(x.status == "completed" for x in samples) / n,
    }

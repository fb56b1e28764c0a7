"""One rollout on the driver: prompts -> engines -> rewards -> advantages -> samples to train on.

Prompts of a rollout are expanded into ``n_samples_per_prompt`` samples each (one GRPO group per
prompt), spread over the engines whole groups at a time, generated, scored by the reward function
and given advantages by ``--advantage-estimator`` (``tidal.algos.estimators.sample_advantages``;
``ppo``'s come from the critic, in the trainer), after DAPO's overlong penalty when it is on. With
``--dynamic-sampling`` groups whose rewards are all equal (zero advantage, no gradient) are dropped
before training. With an environment (``--env-path``, or a multi-turn ``--task``) the session's
agent loop (``tidal.rollout.agent``) generates the samples as trajectories instead, turn by turn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tidal.algos.advantages import dynamic_sampling_keep
from tidal.algos.estimators import sample_advantages
from tidal.algos.objectives import overlong_penalty
from tidal.errors import last_line
from tidal.errors import ray_get as get
from tidal.rollout.agent import score_trajectories, trajectory_metrics
from tidal.rollout.rewards import score_samples
from tidal.rollout.types import DecodeStats, Sample, SampleBatch, SamplingParams


def make_rollout_samples(
    batch: Sequence[tuple[Any, Any, list[int]]], n_samples_per_prompt: int, start_index: int = 0
) -> list[Sample]:
    """``n_samples_per_prompt`` samples per prompt, group-major (the layout ``tidal.algos`` expects).

    Sample ``k`` of prompt ``g`` gets index ``start_index + g * n + k`` and group
    ``start_index // n + g`` (so ``index // n == group`` when batches are built back to back); each
    sample has its own copy of the prompt ids.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
    samples = []
    for g, (prompt, label, prompt_ids) in enumerate(batch):
        for k in range(n_samples_per_prompt):
            samples.append(
                Sample(
                    index=start_index + g * n_samples_per_prompt + k,
                    group=start_index // n_samples_per_prompt + g,
                    prompt=prompt,
                    label=label,
                    prompt_ids=list(prompt_ids),
                )
            )
    return samples


def sampling_params(rollout_cfg, tokenizer, *, greedy: bool = False) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if greedy else rollout_cfg.rollout_temperature,
        top_p=rollout_cfg.rollout_top_p,
        top_k=rollout_cfg.rollout_top_k,
        max_new_tokens=rollout_cfg.rollout_max_response_len,
        stop=list(rollout_cfg.rollout_stop),
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
        seed=rollout_cfg.rollout_seed,
    )


def run_engines(s, samples: list[Sample], sampling: SamplingParams, group_size: int) -> list[Sample]:
    """Generate on every engine of session ``s`` in parallel, whole groups per engine; returns the
    samples in input order.

    An engine that dies (its actor, or its server) loses only its own share: the session restarts
    it and resyncs the weights, and that share is generated again from the driver's copy of the
    samples (engines get copies, so nothing half-filled comes back). Each sample is taken from
    exactly one successful call, so none is lost or counted twice.
    """

    from tidal.errors import is_engine_death

    engines = s.engines
    n = len(engines)
    groups = len(samples) // group_size
    per = -(-groups // n)
    todo = {
        i: samples[i * per * group_size : (i + 1) * per * group_size]
        for i in range(n)
        if samples[i * per * group_size : (i + 1) * per * group_size]
    }
    done: list[Sample] = []
    while todo:
        refs = {i: engines.actors[i].generate.remote(SampleBatch(chunk), sampling) for i, chunk in todo.items()}
        dead, why = _wait_or_probe(s, refs)
        for i, ref in refs.items():
            if i in dead:
                continue
            try:
                done.extend(get(ref))
            except Exception as e:  # noqa: BLE001 - only engine deaths are survived
                if not is_engine_death(e):
                    raise
                dead.append(i)
                why = why or _cause(e)
        todo = {i: todo[i] for i in dead}
        if dead:
            s.restart_engines(dead, why, new_version=False)  # the trainer holds the weights it last pushed
    done.sort(key=lambda x: x.index)
    return done


def _wait_or_probe(s, refs: dict) -> tuple[list[int], str]:
    """Wait for every generate call; while engines are still busy after each ``--engine-health-timeout``,
    probe them (``health()``: an HTTP engine's ``/health``; an embedded engine answers from its own
    concurrency group, beside the generate call): one that does not answer in time counts as dead (hung;
    its call is abandoned). A dead actor Ray reports itself."""
    import ray

    timeout = s.cfg.rollout.engine_health_timeout
    pending = dict(refs)
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=timeout)
        pending = {i: r for i, r in pending.items() if r not in ready}
        if not pending:
            break
        probes = {i: s.engines.actors[i].health.remote() for i in pending}
        answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout)
        hung = [i for i, p in probes.items() if p not in answered or _failed(p)]
        if hung:
            what = "/health" if s.engines.kind == "sglang" else "health()"
            return hung, f"no {what} answer within {timeout:g} s (--engine-health-timeout)"
    return [], ""


def _failed(ref) -> bool:
    try:
        get(ref)
        return False
    except Exception:  # noqa: BLE001 - any failure of the probe means the engine cannot serve
        return True


def _cause(e: BaseException) -> str:
    """The last line of a remote error (``tidal.errors.last_line``), at most 200 characters."""
    return last_line(e).strip()[:200]


def policy_masks(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[N, longest response]`` bool: the trained (policy) tokens of each response, or None when every
    sample is single-turn (then every response token is trained)."""
    if not any(x.loss_mask for x in samples):
        return None
    width = max(1, max(len(x.response_ids) for x in samples))
    out = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, x in enumerate(samples):
        if x.response_ids:
            out[i, : len(x.response_ids)] = torch.tensor(x.policy_mask, dtype=torch.bool)
    return out


def generate_rollout(s, rollout_id: int) -> tuple[list[Sample], dict]:
    """One rollout of the synchronous loop: ``rollout-batch-size`` groups scored, with advantages.

    Without ``--over-sampling-batch-size``, one round of rollout-batch-size prompts (``--dynamic-sampling``
    trains the groups it kept). With it, P prompts a round, as slime does (P >= the batch without
    ``--dynamic-sampling``): the first rollout-batch-size groups kept are trained and the rest of the
    round is dropped, and with ``--dynamic-sampling`` rounds continue until that many groups are kept.
    The generation metrics cover every round (``rollout_rounds`` counts them)."""
    r = s.cfg.rollout
    per_round = r.over_sampling_batch_size or r.rollout_batch_size
    more = r.over_sampling_batch_size is not None and s.cfg.algorithm.dynamic_sampling
    kept: list[Sample] = []
    rounds: list[dict] = []
    while not rounds or (more and len({x.group for x in kept}) < r.rollout_batch_size):
        samples, metrics = _generate_round(s, rollout_id, len(rounds), per_round)
        kept += samples
        rounds.append(metrics)
    groups = set(sorted({x.group for x in kept})[: r.rollout_batch_size])
    kept = [x for x in kept if x.group in groups]
    metrics = rounds[0] if len(rounds) == 1 else merge_round_metrics(rounds)
    if r.over_sampling_batch_size is not None:
        metrics["rollout_rounds"] = len(rounds)
    metrics.update(decode_metrics(s))
    return kept, metrics


def decode_metrics(s) -> dict:
    """The ``decode/*`` metrics of everything the engines generated since the last ask (``DecodeStats``):
    waves, decode steps, seconds of prefill, decode steps, graph captures and whole decoder calls, new graphs
    and compactions; none without the fast decode path."""
    return DecodeStats.metrics(s.engines.call("take_decode_stats"))


def merge_round_metrics(rounds: list[dict]) -> dict:
    """Generation metrics of several rounds as one: counts summed, tokens/s over the total time, the rest
    weighted by each round's samples."""
    weights = [m["gen_samples"] for m in rounds]
    total = sum(weights) or 1
    seconds = sum(m["gen_tokens"] / m["gen_tokens_per_s"] for m in rounds if m.get("gen_tokens_per_s"))
    out: dict = {}
    for key in rounds[0]:
        values = [m.get(key, 0.0) for m in rounds]
        if key in ("gen_samples", "gen_tokens"):
            out[key] = sum(values)
        elif key == "gen_tokens_per_s":
            out[key] = sum(m["gen_tokens"] for m in rounds) / seconds if seconds > 0 else 0.0
        else:
            out[key] = sum(v * w for v, w in zip(values, weights)) / total
    return out


def _generate_round(s, rollout_id: int, round_no: int, prompts: int) -> tuple[list[Sample], dict]:
    """``prompts`` prompts generated, scored and given advantages (then dynamic sampling); groups numbered
    after the earlier rounds' of this rollout."""
    r = s.cfg.rollout
    cursor = getattr(s, "cursor", None)  # the training loops draw through it (prompts a checkpoint marked done skipped)
    batch = [item for _, item in cursor.draw(prompts)] if cursor is not None else s.dataset.next_batch(prompts)
    samples = make_rollout_samples(
        batch, r.n_samples_per_prompt, start_index=round_no * prompts * r.n_samples_per_prompt
    )
    sampling = sampling_params(r, s.tokenizer)
    sampling.seed = r.rollout_seed + rollout_id + 7919 * round_no
    agent = getattr(s, "agent", None)
    t0 = time.perf_counter()
    if agent is None:
        samples = run_engines(s, samples, sampling, r.n_samples_per_prompt)
    else:
        # Multi-turn: trajectories, turn by turn; each turn is one call over every engine.
        samples = agent.run(lambda reqs, sp: run_engines(s, reqs, sp, 1), samples, sampling)
    gen_s = time.perf_counter() - t0
    if agent is None:
        score_samples(samples, s.reward_fn)
    else:
        score_trajectories(samples, r.agent_reward, s.reward_fn)
    return finish_samples(s, samples, gen_s)


def finish_samples(s, samples: list[Sample], gen_s: float) -> tuple[list[Sample], dict]:
    """Advantages of scored samples (whole groups, group-major) and the generation metrics; then dynamic sampling."""
    r, algo = s.cfg.rollout, s.cfg.algorithm
    agent = getattr(s, "agent", None)
    rewards = torch.tensor([x.reward for x in samples], dtype=torch.float32)
    resp_lens = torch.tensor([len(x.response_ids) for x in samples], dtype=torch.float32)
    shaped = rewards
    if algo.overlong_buffer_len:
        # DAPO's overlong penalty is part of the reward trained on (reward_mean stays the task's own).
        shaped = rewards + overlong_penalty(
            resp_lens, r.rollout_max_response_len, algo.overlong_buffer_len, algo.overlong_penalty_factor
        )
        for x, v in zip(samples, shaped.tolist()):
            x.reward = v
    adv, token_adv = sample_advantages(shaped, resp_lens, r.n_samples_per_prompt, algo, mask=policy_masks(samples))
    for i, (x, a) in enumerate(zip(samples, adv.tolist())):
        x.advantage = a
        if token_adv is not None:
            x.token_advantages = token_adv[i, : len(x.response_ids)].tolist()
    metrics = {
        "gen_samples": len(samples),
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "response_len_mean": resp_lens.mean().item(),
        "truncated_frac": sum(x.status == "truncated" for x in samples) / max(1, len(samples)),
        "reward_shaped_mean": shaped.mean().item(),
        "gen_tokens": int(resp_lens.sum().item()),
        "gen_tokens_per_s": resp_lens.sum().item() / gen_s if gen_s > 0 else 0.0,
    }
    if agent is not None:
        metrics.update({**trajectory_metrics(samples), **agent.figures})
        policy = sum(x.num_policy_tokens for x in samples)
        metrics["gen_tokens"] = policy  # generated by the policy; environment tokens are not generated
        metrics["gen_tokens_per_s"] = policy / gen_s if gen_s > 0 else 0.0
    if algo.dynamic_sampling:
        keep = dynamic_sampling_keep(shaped, r.n_samples_per_prompt)  # the rewards the advantages saw
        samples = [x for x, k in zip(samples, keep.tolist()) if k]
        metrics["dynamic_sampling_kept_frac"] = keep.float().mean().item()
    return samples, metrics


def evaluate(s) -> dict:
    """Greedy accuracy (mean reward) on the held-out prompts."""
    batch = s.dataset.eval_batch()
    if not batch:
        return {}
    samples = make_rollout_samples(batch, 1, start_index=0)
    greedy = sampling_params(s.cfg.rollout, s.tokenizer, greedy=True)
    agent = getattr(s, "agent", None)
    if agent is None:
        samples = run_engines(s, samples, greedy, 1)
        score_samples(samples, s.reward_fn)
    else:
        samples = agent.run(lambda reqs, sp: run_engines(s, reqs, sp, 1), samples, greedy)
        score_trajectories(samples, s.cfg.rollout.agent_reward, s.reward_fn)
    decode_metrics(s)  # the evaluation's generate calls are not the next rollout's
    return {"eval_accuracy": sum(x.reward for x in samples) / len(samples)}

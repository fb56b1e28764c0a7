"""DAPO's soft overlong penalty in the real loop: responses that run into the buffer cost reward, and the policy learns to stop.

The default task's answer is one token; with room for six response tokens and a four-token buffer
(``--overlong-buffer-len 4``), a fresh model that rambles to the limit loses most of a reward point per
sample, and the only way up is to end the answer early. Eight rollouts on the tiny model move the mean
response length from ~5.8 tokens down by more than one, and the shaped reward the advantages saw with
it; ``reward_mean`` stays the task's own score.
"""

from __future__ import annotations

from tidal.config import parse, resolve
from tidal.driver import train


def test_overlong_penalty_shortens_responses_in_the_real_loop(ray_cluster, tmp_path):
    flags = ["--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run"), "--num-rollout", "8"]
    flags += ["--rollout-max-response-len", "6", "--overlong-buffer-len", "4"]
    cfg, prov = parse(flags)
    rows: list[dict] = []
    train(resolve(cfg, prov), on_step=lambda s, rid, row: rows.append(row) if rid >= 0 else None)
    lens = [r["response_len_mean"] for r in rows]
    shaped = [r["reward_shaped_mean"] for r in rows]
    assert len(rows) == 8
    # Past the free region a response costs (len - (6 - 4)) / 4 of a point, so the shaped mean is below the task's.
    assert all(r["reward_shaped_mean"] <= r["reward_mean"] for r in rows)
    assert rows[0]["reward_shaped_mean"] < rows[0]["reward_mean"] - 0.5
    assert lens[0] > 5.0, lens  # a fresh model rambles to the limit
    assert lens[-1] < lens[0] - 1.0, f"responses did not get shorter: {lens}"
    assert shaped[-1] > shaped[0] + 0.15, f"the shaped reward did not rise: {shaped}"

"""samples.jsonl: which samples of a rollout are written, and what each line holds."""

from __future__ import annotations

import json

from tidal.observe.samples import SampleLog, pick, sample_line
from tidal.rollout.types import Sample


def _rollout(groups: int, per: int) -> list[Sample]:
    out = []
    for g in range(groups):
        for k in range(per):
            i = g * per + k
            out.append(
                Sample(
                    index=i,
                    group=g,
                    prompt=[{"role": "user", "content": f"What is {g} + {k}?"}],
                    label=str(g + k),
                    response_ids=[1, 2],
                    response_text=str(g + k) if k else "no",
                    status="completed" if k else "truncated",
                    reward=1.0 if k else 0.0,
                    weight_version=7,
                )
            )
    return out


def test_picked_samples_are_spread_over_prompts():
    samples = _rollout(groups=8, per=4)
    assert [(s.group, s.index % 4) for s in pick(samples, 4)] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    # More than there are groups: every group's first sample, then second ones.
    more = pick(_rollout(groups=3, per=2), 5)
    assert [(s.group, s.index % 2) for s in more] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert pick(samples, 0) == [] and len(pick(samples, 100)) == 32


def test_sample_log_lines(tmp_path):
    log = SampleLog(str(tmp_path), 2)
    records = log.write(3, _rollout(groups=2, per=2))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == records and len(lines) == 2
    first = lines[0]
    assert first["step"] == 3 and first["prompt"] == [{"role": "user", "content": "What is 0 + 0?"}]
    assert (first["response"], first["label"], first["reward"]) == ("no", "0", 0.0)
    assert (first["finish_reason"], first["response_length"], first["weight_version"]) == ("length", 2, 7)
    assert "What is 0 + 0? -> no | label 0 | reward 0.00 | length" in sample_line(first)
    none = SampleLog(str(tmp_path / "off"), 0)
    assert none.write(0, _rollout(1, 1)) == [] and not (tmp_path / "off" / "samples.jsonl").exists()


def test_a_sample_batch_pickles_as_rows_and_reads_back_the_same_samples():
    """``SampleBatch`` (what the driver, engines and trainer send each other): every field back as it was,
    multi-turn ones included, as a ``SampleBatch`` of ``Sample``s; one with an attribute of its own or a
    foreign item pickles item by item and keeps it."""
    import pickle

    from tidal.rollout.types import SampleBatch, Turn

    samples = _rollout(3, 2)
    samples[1].loss_mask, samples[1].turns = [1, 0], [Turn("assistant", 0, 1), Turn("tool", 1, 2)]
    samples[2].metadata, samples[2].token_advantages, samples[2].response_versions = {"k": [1, {"a": 2}]}, [0.5], [3]
    samples[3].response_logprobs, samples[3].prompt_ids = [-0.25, -1.5], [1, 9, 9]
    back = pickle.loads(pickle.dumps(SampleBatch(samples), protocol=5))
    assert type(back) is SampleBatch and all(type(x) is Sample for x in back) and back == samples
    assert back[1].turns[1] == Turn("tool", 1, 2) and back[2].metadata == {"k": [1, {"a": 2}]}
    samples[0].note = "kept"  # an attribute that is not a field
    back = pickle.loads(pickle.dumps(SampleBatch([*samples, "other"]), protocol=5))
    assert back[0].note == "kept" and back[:-1] == samples and back[-1] == "other" and type(back) is SampleBatch

"""Built-in rewards, custom reward loading, and the errors a user sees when their code fails."""

from __future__ import annotations

import math
import textwrap

import pytest

from tidal.errors import UserError
from tidal.rollout.plugins import load_callable
from tidal.rollout.rewards import (
    exact_reward,
    extract_answer,
    format_reward,
    get_reward_fn,
    last_boxed,
    math_reward,
    score_samples,
    to_number,
)
from tidal.rollout.types import Sample


def test_exact():
    assert exact_reward("3+4=", "7", "7") == 1.0
    assert exact_reward("3+4=", " 7\n", "7") == 1.0  # surrounding whitespace is not part of the answer
    assert exact_reward("3+4=", "7", 7) == 1.0  # labels may be JSON numbers
    assert exact_reward("3+4=", "77", "7") == 0.0
    assert exact_reward("3+4=", "7 apples", "7") == 0.0
    assert exact_reward("3+4=", "", "7") == 0.0


def test_math_answer_extraction():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{3} and a truncated \boxed{4") == "3"  # unclosed: the earlier complete one
    assert last_boxed("no box") is None
    assert extract_answer("7 or maybe 12.") == "12"
    assert extract_answer("nothing here") is None
    assert to_number("1,000") == 1000.0 and to_number("$-3.50$") == -3.5 and to_number(r"\frac{3}{4}") == 0.75
    assert to_number("1/0") is None and to_number("x") is None and to_number(True) is None


def test_math_reward():
    assert math_reward("", r"so \boxed{7.0}", "7") == 1.0
    assert math_reward("", "the answer is 7", 7) == 1.0
    assert math_reward("", "7 or maybe 12", "7") == 0.0  # the last number counts
    assert math_reward("", r"\boxed{12} but 7", "12") == 1.0  # a box wins over later numbers
    assert math_reward("", r"\boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("", "it is 1,000", "1000") == 1.0
    assert math_reward("", r"\boxed{x+1}", "x + 1") == 1.0  # non-numbers compare as normalised strings
    assert math_reward("", "no answer", "7") == 0.0


def test_format_reward():
    assert format_reward("", r"thinking... \boxed{3}", None) == 1.0
    assert format_reward("", " 42 ", None) == 1.0
    assert format_reward("", r"\boxed{ }", None) == 0.0
    assert format_reward("", "seven", None) == 0.0
    assert format_reward("", "7 apples", None) == 0.0


def _samples(n=3):
    return [Sample(index=i, group=0, prompt=f"{i}+1=", label=str(i + 1), response_text=str(i + 1)) for i in range(n)]


def test_score_samples_fills_rewards():
    samples = _samples()
    samples[1].response_text = "9"
    score_samples(samples, get_reward_fn("exact"))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    with pytest.raises(UserError, match="--rm-type 'nope'"):
        get_reward_fn("nope")


def _write_module(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_custom_reward_by_module_and_file(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        "my_rm_ok",
        """
        def length_bonus(prompt, response, label):
            return len(response) / 10

        class Scorer:
            @staticmethod
            def score(prompt, response, label):
                return 2
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = _samples()
    samples[2].response_text = "abcde"
    score_samples(samples, get_reward_fn("exact", "my_rm_ok:length_bonus"))
    assert [s.reward for s in samples] == [0.1, 0.1, 0.5]
    assert get_reward_fn("exact", "my_rm_ok.length_bonus")("", "ab", None) == 0.2  # dotted form
    assert get_reward_fn("exact", "my_rm_ok:Scorer.score")("", "", None) == 2  # nested attribute
    by_file = get_reward_fn("exact", f"{tmp_path / 'my_rm_ok.py'}:length_bonus")  # a file off sys.path
    assert by_file("", "abc", None) == pytest.approx(0.3)


def test_custom_reward_errors_are_one_line(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        "my_rm_bad",
        """
        import math

        def divide(prompt, response, label):
            return 1 / (len(response) - 1)

        def text(prompt, response, label):
            return "high"

        def nan(prompt, response, label):
            return math.nan

        async def asynchronous(prompt, response, label):
            return 1.0

        def two_args(prompt, response):
            return 1.0

        NOT_A_FUNCTION = 3
        """,
    )
    _write_module(tmp_path, "my_rm_broken", "import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = _samples(6)
    for s in samples:
        s.response_text = "ab"
    samples[4].response_text = "5"  # len 1 -> ZeroDivisionError on sample 4 only
    with pytest.raises(UserError) as e:
        score_samples(samples, get_reward_fn("exact", "my_rm_bad:divide"))
    msg = str(e.value)
    assert "my_rm_bad.divide" in msg and "sample 4" in msg and "ZeroDivisionError" in msg and "\n" not in msg
    with pytest.raises(UserError, match="returned str 'high' for sample 0; return a float"):
        score_samples(samples, get_reward_fn("exact", "my_rm_bad:text"))
    with pytest.raises(UserError, match="returned nan for sample 0"):
        score_samples(samples, get_reward_fn("exact", "my_rm_bad:nan"))
    with pytest.raises(UserError, match="async function"):
        get_reward_fn("exact", "my_rm_bad:asynchronous")
    with pytest.raises(UserError, match="three arguments"):
        get_reward_fn("exact", "my_rm_bad:two_args")
    with pytest.raises(UserError, match="not a function"):
        get_reward_fn("exact", "my_rm_bad:NOT_A_FUNCTION")
    with pytest.raises(UserError, match="my_rm_bad has no attribute 'missing'"):
        get_reward_fn("exact", "my_rm_bad:missing")
    with pytest.raises(
        UserError, match="no module named 'no_such_pkg_xyz'; install it or add its folder to PYTHONPATH"
    ):
        get_reward_fn("exact", "no_such_pkg_xyz.rewards:score")
    with pytest.raises(UserError, match="importing my_rm_broken failed.*no_such_dependency_xyz"):
        get_reward_fn("exact", "my_rm_broken:score")
    with pytest.raises(UserError, match="expected module:function"):
        get_reward_fn("exact", "justaname")
    with pytest.raises(UserError, match="does not exist"):
        get_reward_fn("exact", f"{tmp_path / 'absent.py'}:score")


def test_load_callable_names_the_flag(tmp_path):
    path = _write_module(tmp_path, "gen_plugin", "def generate(engine, samples, sampling):\n    return samples\n")
    fn = load_callable(f"{path}:generate", what="--custom-generate-function-path")
    assert fn(None, [1, 2], None) == [1, 2]
    with pytest.raises(UserError, match="^--custom-generate-function-path 'gen_plugin_absent:generate': no module"):
        load_callable("gen_plugin_absent:generate", what="--custom-generate-function-path")
    with pytest.raises(UserError, match="empty path"):
        load_callable("  ", what="--custom-generate-function-path")
    raising = _write_module(tmp_path, "raises_on_import", "raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="running .*raises_on_import.py failed with RuntimeError: boom"):
        load_callable(f"{raising}:f")
    assert math.isclose(load_callable("math:sqrt")(4.0), 2.0)  # a C function: no signature needed

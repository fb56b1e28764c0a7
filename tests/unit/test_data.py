"""Prompt datasets and built-in tasks: files, errors with line numbers, chat templates, order, resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tokenizers.processors import TemplateProcessing

from tidal.config.schema import DataConfig, RolloutConfig
from tidal.data.dataset import PromptDataset
from tidal.data.tasks import task_rows
from tidal.errors import UserError
from tidal.model.tokenizer import CHARS, char_tokenizer
from tidal.rollout.orchestrate import make_rollout_samples


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_tokenised(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"q": "1+2=", "a": "3"}, "", {"q": "4+4=", "a": 8, "extra": 1}])
    ds = PromptDataset.from_file(path, tok, input_key="q", label_key="a", shuffle=False)
    assert len(ds) == 2  # the blank line is skipped
    (p0, l0, ids0), (p1, l1, ids1) = ds.next_batch(2)
    assert (p0, l0, p1, l1) == ("1+2=", "3", "4+4=", 8)
    assert ids0 == tok("1+2=")["input_ids"] and tok.decode(ids1) == "4+4="


def test_bad_jsonl_line_names_file_and_line(tmp_path, tok):
    path = _jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}, '{"prompt": "3+3=", "label": '],
    )
    with pytest.raises(UserError) as e:
        PromptDataset.from_file(path, tok)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: not valid JSON") and "fix or remove that line" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "row, flags, expected",
    [
        ({"text": "1+1=", "label": "2"}, {}, r":2: no field 'prompt' \(fields: text, label\); set --input-key"),
        ({"prompt": "1+1="}, {}, r":2: no field 'label' .*set --label-key"),
        ({"prompt": 5, "label": "2"}, {}, r":2: field 'prompt' is a int, not a string"),
        ([1, 2], {}, r":2: expected a JSON object per row"),
    ],
)
def test_row_errors(tmp_path, tok, row, flags, expected):
    path = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "0+0=", "label": "0"}, row])
    with pytest.raises(UserError, match=expected):
        PromptDataset.from_file(path, tok, **flags)


def test_file_errors_and_unlabelled_data(tmp_path, tok):
    with pytest.raises(UserError, match="no such file; pass a .jsonl or .parquet file"):
        PromptDataset.from_file(str(tmp_path / "missing.jsonl"), tok)
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(UserError, match="unknown file type .csv"):
        PromptDataset.from_file(str(tmp_path / "d.csv"), tok)
    with pytest.raises(UserError, match="has no rows"):
        PromptDataset.from_file(_jsonl(tmp_path / "empty.jsonl", []), tok)
    # --label-key '' : data without labels, for rewards that need none
    ds = PromptDataset.from_file(_jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "ab"}]), tok, label_key="")
    assert ds.next_batch(1)[0].label is None


def test_parquet_round_trip(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")  # pyarrow is a dev dependency; the skip only covers minimal installs
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(3) for b in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = PromptDataset.from_file(str(tmp_path / "d.parquet"), tok, shuffle=False)
    got = ds.next_batch(len(rows))
    assert [(p, lab) for p, lab, _ in got] == [(r["prompt"], r["label"]) for r in rows]
    assert all(tok.decode(ids) == p for p, _, ids in got)
    # chat messages survive the round trip as lists of structs
    msgs = [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}]
    pq.write_table(pa.Table.from_pylist(msgs), tmp_path / "m.parquet")
    tok_t = _templated(char_tokenizer())
    (item,) = PromptDataset.from_file(str(tmp_path / "m.parquet"), tok_t).next_batch(1)
    assert item.prompt == [{"role": "user", "content": "hi"}]
    # a missing column is reported once, a null cell with its row
    with pytest.raises(UserError, match=r"no column 'question' \(columns: prompt, label\); set --input-key"):
        PromptDataset.from_file(str(tmp_path / "d.parquet"), tok, input_key="question")
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "1+1=", "label": "2"}, {"prompt": None, "label": "3"}]), tmp_path / "n.parquet"
    )
    with pytest.raises(UserError, match=r"n.parquet row 2: field 'prompt' is a NoneType"):
        PromptDataset.from_file(str(tmp_path / "n.parquet"), tok)


def _templated(tok):
    """The char tokenizer with a small chat template (all its characters are in the vocabulary)."""
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    return tok


def test_chat_template(tmp_path):
    tok = _templated(char_tokenizer())
    path = _jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": "3+4=", "label": "7"},
            {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}], "label": "2"},
        ],
    )
    ds = PromptDataset.from_file(path, tok, shuffle=False)
    (p0, _, ids0), (p1, _, ids1) = ds.next_batch(2)
    assert p0 == "3+4=" and tok.decode(ids0) == "u:3+4= a:"  # a string becomes one user message
    assert tok.decode(ids1) == "s:add u:1+1= a:"
    # turned off: raw text for strings, and a clear error for message lists
    only_text = _jsonl(tmp_path / "text.jsonl", [{"prompt": "3+4=", "label": "7"}])
    assert (
        tok.decode(PromptDataset.from_file(only_text, tok, apply_chat_template=False).next_batch(1)[0].prompt_ids)
        == "3+4="
    )
    with pytest.raises(
        UserError, match=r"chat.jsonl:2: the prompt is a list of chat messages but --no-apply-chat-template"
    ):
        PromptDataset.from_file(path, tok, apply_chat_template=False)
    plain = char_tokenizer()
    with pytest.raises(UserError, match="the tokenizer has no chat template"):
        PromptDataset.from_file(path, plain)


def test_chat_template_does_not_double_bos(tmp_path):
    # A tokenizer that adds <bos> to raw text, with a template that writes <bos> itself.
    tok = char_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "label": "4"}])
    raw = PromptDataset.from_file(path, tok, apply_chat_template=False).next_batch(1)[0].prompt_ids
    assert raw[0] == tok.bos_token_id and raw.count(tok.bos_token_id) == 1
    tok.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    templated = PromptDataset.from_file(path, tok).next_batch(1)[0].prompt_ids
    assert templated == raw  # the template's <bos>, not a second one


def test_long_prompts_dropped(tmp_path, tok, caplog):
    path = _jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "123456789+1=", "label": "x"}])
    ds = PromptDataset.from_file(path, tok, max_prompt_len=8)
    assert len(ds) == 1 and "dropped 1 prompt(s)" in caplog.text and "long.jsonl:2" in caplog.text
    with pytest.raises(UserError, match="no prompts left"):
        PromptDataset.from_file(path, tok, max_prompt_len=3)


def test_epoch_order_is_deterministic_and_resumable(tok):
    rows = [(f"{i}", str(i)) for i in range(10)]

    def take(ds, sizes):
        return [[p for p, _, _ in ds.next_batch(n)] for n in sizes]

    a = take(PromptDataset(rows, tok, seed=3), [4, 4, 4, 4, 4])
    b = take(PromptDataset(rows, tok, seed=3), [4, 4, 4, 4, 4])
    c = take(PromptDataset(rows, tok, seed=4), [4, 4, 4, 4, 4])
    assert a == b and a != c
    flat = [p for batch in a for p in batch]
    # every epoch is a permutation of all rows; the 3rd batch spans the epoch boundary
    assert sorted(flat[:10]) == sorted(r[0] for r in rows) and sorted(flat[10:20]) == sorted(r[0] for r in rows)
    assert flat[:10] != flat[10:20]  # reshuffled each epoch
    assert take(PromptDataset(rows, tok, shuffle=False), [3]) == [["0", "1", "2"]]

    # resume: a fresh dataset loaded from the state continues exactly where the first one was
    ds = PromptDataset(rows, tok, seed=3)
    take(ds, [4, 4, 4])
    state = json.loads(json.dumps(ds.state_dict()))  # checkpoints store it as JSON
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = PromptDataset(rows, tok, seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, [4, 4]) == a[3:]
    with pytest.raises(UserError, match="checkpoint was taken with 10 prompts"):
        PromptDataset(rows[:5], tok).load_state_dict(state)


def test_make_rollout_samples():
    batch = [("1+1=", "2", [5, 14, 5, 17]), ("2+2=", "4", [6, 14, 6, 17])]
    samples = make_rollout_samples(batch, 3, start_index=6)
    assert [(s.index, s.group) for s in samples] == [(6, 2), (7, 2), (8, 2), (9, 3), (10, 3), (11, 3)]
    assert [s.label for s in samples] == ["2"] * 3 + ["4"] * 3
    samples[0].prompt_ids.append(99)  # each sample owns its ids
    assert samples[1].prompt_ids == [5, 14, 5, 17] and batch[0][2] == [5, 14, 5, 17]


# --- built-in tasks ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["digit-sum", "arith"])
def test_tasks_are_deterministic_and_valid(name, tok):
    a, b, c = task_rows(name, 1), task_rows(name, 1), task_rows(name, 2)
    assert a == b and a.train != c.train and sorted(a.train) == sorted(c.train)
    for prompt, label in set(a.train + a.eval):
        assert len(prompt) <= 8 and set(prompt) <= set(CHARS) and set(label) <= set(CHARS)
        assert prompt.endswith("=") and str(eval(prompt[:-1])) == label  # the label is the arithmetic's value
    # one token per character: nothing unknown to the tiny presets
    assert all(len(tok(p)["input_ids"]) == len(p) for p, _ in a.train[:50] + a.eval)


def test_mental_math_is_chat_prompts_with_held_out_questions():
    a, b, c = task_rows("mental-math", 1), task_rows("mental-math", 1), task_rows("mental-math", 2)
    key = [str(p) for p, _ in a.train]
    assert a == b and key != [str(p) for p, _ in c.train] and sorted(key) == sorted(str(p) for p, _ in c.train)
    questions = {}
    for split in (a.train, a.eval):
        for prompt, label in split:
            system, user = prompt
            assert system == {"role": "system", "content": "Answer with only the number."} and user["role"] == "user"
            q = user["content"]
            expr = q.removeprefix("What is ").removesuffix("?").replace("times", "*")
            assert str(eval(expr)) == label and int(label) >= 0, q
            questions.setdefault(q, set()).add(id(split))
    assert all(len(v) == 1 for v in questions.values()), "a question is in train or eval, never both"
    assert 40 <= len(a.eval) <= 64 and len(a.train) > 3 * len(a.eval)
    ops = {q.split()[3] for q, _ in ((p[1]["content"], lab) for p, lab in a.eval)}
    assert ops == {"+", "-", "times"}


def test_digit_sum_is_balanced_by_answer():
    splits = task_rows("digit-sum", 0)
    counts = Counter(label for _, label in splits.train)
    # 9 sums, 60 rows each, so always answering one digit scores 1/9
    assert sorted(counts) == [str(k) for k in range(9)] and set(counts.values()) == {60}
    assert len(set(splits.train)) == 25 and sorted(set(splits.train)) == splits.eval  # eval: each prompt once


def test_arith_eval_is_held_out():
    splits = task_rows("arith", 0, eval_size=None)
    assert len(splits.eval) > 500 and not set(splits.train) & set(splits.eval)
    assert any("-" in p for p, _ in splits.eval) and any("+" in p for p, _ in splits.eval)
    capped = task_rows("arith", 0)
    assert len(capped.eval) == 64 and set(capped.eval) <= set(splits.eval)


def test_task_dataset_and_build(tok):
    ds = PromptDataset.from_task("digit-sum", tok, seed=0)
    assert len(ds) == len(task_rows("digit-sum", 0).train) and ds.eval_batch()
    built = PromptDataset.build(DataConfig(), RolloutConfig(), tok, seed=0)
    assert built.next_batch(5) == ds.next_batch(5)
    with pytest.raises(UserError, match="--task 'nope'"):
        PromptDataset.from_task("nope", tok)


def test_the_drivers_char_tokenizer_encodes_as_the_transformers_one(tok):
    """``DriverCharTokenizer`` (the driver's, without transformers) against ``char_tokenizer()``: every built-in
    task's prompts, special tokens and unknown characters inside a text, with and without special tokens; the
    same ids, lengths and special tokens, the same error for chat prompts, and anything else answered by the
    transformers tokenizer itself."""
    from tidal.data.tasks import TASKS
    from tidal.model.tokenizer import DriverCharTokenizer

    light = DriverCharTokenizer()

    def ids_or_error(name, tokenizer):
        try:
            return [item[2] for item in PromptDataset.from_task(name, tokenizer, shuffle=False).items]
        except UserError as e:  # a chat task: the char tokenizer has no chat template
            return str(e)

    results = {name: ids_or_error(name, tok) for name in TASKS}
    assert {name: ids_or_error(name, light) for name in TASKS} == results
    assert any(isinstance(r, str) for r in results.values()) and any(isinstance(r, list) for r in results.values())
    texts = ["4+1=", "<eos>ab<pad>c", "A B!é?", "", " ", "12<bos><unk>", "".join(CHARS)]
    for special in (True, False):
        assert (
            light(texts, add_special_tokens=special)["input_ids"] == tok(texts, add_special_tokens=special)["input_ids"]
        )
        assert all(
            light(t, add_special_tokens=special)["input_ids"] == tok(t, add_special_tokens=special)["input_ids"]
            for t in texts
        )
    names = ("pad_token", "bos_token", "eos_token", "unk_token", "chat_template", "padding_side")
    assert [getattr(light, n) for n in names] == [getattr(tok, n) for n in names] and len(light) == len(tok)
    assert [getattr(light, f"{n}_id") for n in names[:4]] == [getattr(tok, f"{n}_id") for n in names[:4]]
    ids = tok(texts[1])["input_ids"]
    assert light.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert light.all_special_ids == tok.all_special_ids

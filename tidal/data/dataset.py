"""Prompt datasets: rows from JSONL/Parquet or a built-in task, tokenised once, served in batches.

A row holds a prompt (``--input-key``: a string, or a list of chat messages ``{"role", "content"}``)
and a reference answer (``--label-key``; pass ``--label-key ''`` for data without labels, e.g. for a
custom reward that needs none). Each prompt is turned into token ids once, at load time:

* with ``--apply-chat-template`` and a tokenizer that has a chat template, the messages (a plain
  string becomes one user message) are rendered with ``apply_chat_template(tokenize=False,
  add_generation_prompt=True)`` and tokenised without adding special tokens again (the template
  writes them);
* otherwise the raw string is tokenised as the tokenizer does by default (a BOS where it adds one).

Prompts longer than ``--rollout-max-prompt-len`` tokens are dropped at load time, as slime does,
with one warning giving how many and the first one's line; a dataset left empty is an error.
Everything wrong with a file (missing, unreadable row, missing field) is a ``UserError`` naming the
file, the line (JSONL) or row (Parquet, 1-based) and the fix.

Order: each epoch is a permutation of the rows drawn from ``(seed, epoch)`` alone, and the position
within it is the whole state (``state_dict``), so a run resumed from a checkpoint sees exactly the
prompts the uninterrupted run would have seen. A batch that runs past the end of an epoch continues
into the next one.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from tidal.data.tasks import task_rows
from tidal.errors import UserError

log = logging.getLogger(__name__)


class PromptItem(NamedTuple):
    """One prompt as served to a rollout; unpacks as ``prompt, label, prompt_ids``."""

    prompt: Any  # text or chat messages, as in the dataset (what the reward function sees)
    label: Any
    prompt_ids: list[int]


class _Row(NamedTuple):
    prompt: Any
    label: Any
    where: str  # "file:line" or "task name #i", for messages


def _check_prompt(value: Any, where: str, input_key: str) -> Any:
    """A prompt must be a string or a list of {"role", "content"} messages."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    raise UserError(
        f"{where}: field {input_key!r} is a {type(value).__name__}, not a string or a list of "
        f'{{"role", "content"}} messages; point --input-key at the prompt field'
    )


def _row(obj: Any, where: str, input_key: str, label_key: str | None) -> _Row:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object per row, got {type(obj).__name__}; write one object per line")
    if input_key not in obj:
        fields = ", ".join(map(str, list(obj)[:8])) or "none"
        raise UserError(f"{where}: no field {input_key!r} (fields: {fields}); set --input-key to the prompt's field")
    label = None
    if label_key:
        if label_key not in obj:
            fields = ", ".join(map(str, list(obj)[:8])) or "none"
            raise UserError(
                f"{where}: no field {label_key!r} (fields: {fields}); set --label-key to the answer's field, "
                "or --label-key '' for data without labels"
            )
        label = obj[label_key]
    return _Row(_check_prompt(obj[input_key], where, input_key), label, where)


def _read_jsonl(path: str, input_key: str, label_key: str | None) -> list[_Row]:
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UserError(f"--prompt-data {path}: cannot open ({e.strerror}); check the path and permissions") from e
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, start=1):  # noqa: B007 (lineno is used after the loop on errors)
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix or remove that line "
                        "(one JSON object per line)"
                    ) from None
                rows.append(_row(obj, where, input_key, label_key))
        except UnicodeDecodeError:
            raise UserError(f"{path}:{lineno + 1}: not UTF-8 text; re-save the file as UTF-8") from None
    return rows


def _read_parquet(path: str, input_key: str, label_key: str | None) -> list[_Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"--prompt-data {path}: reading Parquet needs pyarrow; pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not Parquet
        raise UserError(f"--prompt-data {path}: not a readable Parquet file ({e}); check the file") from None
    columns = table.column_names
    for key, flag in ((input_key, "--input-key"), (label_key, "--label-key")):
        if key and key not in columns:
            raise UserError(
                f"{path}: no column {key!r} (columns: {', '.join(columns[:8])}); set {flag} to the right column"
            )
    wanted = [input_key] + ([label_key] if label_key else [])
    rows = []
    for i, obj in enumerate(table.select(wanted).to_pylist(), start=1):
        rows.append(_row(obj, f"{path} row {i}", input_key, label_key))
    return rows


def read_rows(path: str, input_key: str = "prompt", label_key: str | None = "label") -> list[_Row]:
    """Rows of a JSONL (``.jsonl``/``.json``, one object per line) or Parquet file."""
    if not os.path.exists(path):
        raise UserError(f"--prompt-data {path}: no such file; pass a .jsonl or .parquet file")
    if os.path.isdir(path):
        raise UserError(f"--prompt-data {path}: is a folder; pass a .jsonl or .parquet file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return _read_parquet(path, input_key, label_key)
    if ext in (".jsonl", ".json"):
        return _read_jsonl(path, input_key, label_key)
    raise UserError(
        f"--prompt-data {path}: unknown file type {ext or '(none)'}; use .jsonl (one JSON object per line) or .parquet"
    )


def render_prompt(prompt: Any, tokenizer: Any, apply_chat_template: bool, where: str = "prompt") -> tuple[str, bool]:
    """(text to tokenise, whether it came from the chat template)."""
    template = apply_chat_template and getattr(tokenizer, "chat_template", None)
    if template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects these messages (roles it does not know, ...)
            raise UserError(
                f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {e}); fix the messages"
            ) from None
        return text, True
    if isinstance(prompt, list):
        why = "--no-apply-chat-template is set" if not apply_chat_template else "the tokenizer has no chat template"
        raise UserError(
            f"{where}: the prompt is a list of chat messages but {why}; give plain-text prompts or a tokenizer with a chat template"
        )
    return prompt, False


class PromptDataset:
    """Prompts with labels and token ids; deterministic epoch order; resumable position."""

    def __init__(
        self,
        rows: Sequence[tuple[Any, Any]] | Sequence[_Row],
        tokenizer: Any,
        *,
        seed: int = 0,
        shuffle: bool = True,
        apply_chat_template: bool = True,
        max_prompt_len: int | None = None,
        eval_rows: Sequence[tuple[Any, Any]] = (),
        name: str = "prompts",
    ):
        self.name = name
        self.seed = seed
        self.shuffle = shuffle
        self.items = self._tokenize(
            rows,
            tokenizer,
            apply_chat_template,
            max_prompt_len,
        )
        if not self.items:
            raise UserError(
                f"{name}: no prompts left; give a dataset with at least one prompt within --rollout-max-prompt-len"
            )
        self.eval_items = self._tokenize(
            eval_rows,
            tokenizer,
            apply_chat_template,
            max_prompt_len,
        )
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    # ---- construction ----------------------------------------------------------------------
    def _tokenize(self, rows, tokenizer, apply_chat_template, max_prompt_len) -> list[PromptItem]:
        rendered = []
        for i, row in enumerate(rows):
            where = row.where if isinstance(row, _Row) else f"{self.name} #{i}"
            text, templated = render_prompt(row[0], tokenizer, apply_chat_template, where)
            rendered.append((row[0], row[1], where, text, templated))
        items: list[PromptItem] = []
        dropped, first_long = 0, None
        # Tokenised in slices: one call per slice is ~10x faster than one per row on large files.
        for s in range(0, len(rendered), 1024):
            part = rendered[s : s + 1024]
            # A rendered template already holds its special tokens (BOS included); adding them
            # again would give the model a double BOS it never saw in training.
            add_special = not part[0][4]
            ids_list = tokenizer([r[3] for r in part], add_special_tokens=add_special)["input_ids"]
            for (prompt, label, where, _, _), ids in zip(part, ids_list):
                if max_prompt_len is not None and len(ids) > max_prompt_len:
                    dropped += 1
                    first_long = first_long or (where, len(ids))
                    continue
                items.append(PromptItem(prompt, label, list(ids)))
        if dropped:
            log.warning(
                "%s: dropped %d prompt(s) longer than --rollout-max-prompt-len %d tokens (first: %s, %d tokens)",
                self.name, dropped, max_prompt_len, first_long[0], first_long[1],
            )  # fmt: skip
        return items

    @classmethod
    def from_file(
        cls,
        path: str,
        tokenizer: Any,
        *,
        input_key: str = "prompt",
        label_key: str | None = "label",
        seed: int = 0,
        shuffle: bool = True,
        apply_chat_template: bool = True,
        max_prompt_len: int | None = None,
    ) -> PromptDataset:
        rows = read_rows(path, input_key, label_key or None)
        if not rows:
            raise UserError(f"--prompt-data {path}: the file has no rows; give a file with at least one prompt")
        return cls(
            rows,
            tokenizer,
            seed=seed,
            shuffle=shuffle,
            apply_chat_template=apply_chat_template,
            max_prompt_len=max_prompt_len,
            name=path,
        )

    @classmethod
    def from_task(
        cls,
        name: str,
        tokenizer: Any,
        seed: int = 0,
        *,
        shuffle: bool = True,
        apply_chat_template: bool = True,
        max_prompt_len: int | None = None,
        eval_size: int | None = None,
    ) -> PromptDataset:
        """A built-in task (``tidal.data.tasks``): its train split, and its eval split for ``eval_batch``."""
        kwargs = {} if eval_size is None else {"eval_size": eval_size}
        splits = task_rows(name, seed, **kwargs)
        return cls(
            splits.train,
            tokenizer,
            seed=seed,
            shuffle=shuffle,
            apply_chat_template=apply_chat_template,
            max_prompt_len=max_prompt_len,
            eval_rows=splits.eval,
            name=f"task {name}",
        )

    @classmethod
    def build(cls, data_cfg: Any, rollout_cfg: Any, tokenizer: Any, seed: int = 0) -> PromptDataset:
        """The dataset a run uses: ``--prompt-data`` when given, else the built-in ``--task``."""
        common = dict(
            seed=seed,
            shuffle=data_cfg.rollout_shuffle,
            apply_chat_template=data_cfg.apply_chat_template,
            max_prompt_len=rollout_cfg.rollout_max_prompt_len,
        )
        if data_cfg.prompt_data:
            return cls.from_file(
                data_cfg.prompt_data, tokenizer, input_key=data_cfg.input_key, label_key=data_cfg.label_key, **common
            )
        return cls.from_task(data_cfg.task, tokenizer, **common)

    # ---- serving ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            # Seeded by (seed, epoch) only, so the order never depends on how much was read before.
            random.Random(f"tidal-data/{self.seed}/{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next ``n`` prompts in epoch order, continuing into the next epoch when one ends."""
        if n < 1:
            raise ValueError(f"batch size must be positive, got {n}")
        out = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self.items[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def eval_batch(self) -> list[PromptItem]:
        """The held-out prompts (empty for files: evaluation needs a built-in task's eval split)."""
        return list(self.eval_items)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_prompts": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_prompts", len(self.items)) != len(self.items):
            raise UserError(
                f"{self.name}: the checkpoint was taken with {state['num_prompts']} prompts, this dataset has "
                f"{len(self.items)}; resume with the same --prompt-data (or start without --load)"
            )
        if state.get("seed", self.seed) != self.seed:
            log.warning(
                "%s: checkpoint data seed %s differs from %s; using the checkpoint's",
                self.name,
                state["seed"],
                self.seed,
            )
            self.seed = state["seed"]
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)

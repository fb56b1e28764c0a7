"""A character-level tokenizer for the built-in tiny presets.

The tiny presets train from random initialisation, so a small vocabulary matters: with one token
per character (digits, a few operators, lowercase letters) a random policy already hits the right
answer to a digit task with probability ~1/10, which is what lets a 2-core CPU see the reward rise
within minutes. It is a real ``PreTrainedTokenizerFast`` (saved and loaded like any other); a run's driver
encodes its prompts with ``DriverCharTokenizer``, the same encoder without importing transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=?:,. ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _char_backend():
    """The ``tokenizers.Tokenizer`` of the char tokenizer: one token per character, unknown ones ``<unk>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def char_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_char_backend(),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    return fast


class DriverCharTokenizer:
    """The char tokenizer for a process that need not import transformers (~1 s of CPU on a small host): a run's
    driver, which reads the prompts beside Ray's start.

    It encodes with the same ``tokenizers.Tokenizer`` that ``char_tokenizer()`` wraps, its special tokens
    registered as transformers registers them, and is called as transformers' tokenizers are for what the
    driver asks of it: ``tok(text or texts, add_special_tokens=...)["input_ids"]``, the special tokens and
    their ids, ``len``, no chat template. Anything else (decoding, a chat template call, other arguments)
    is asked of ``char_tokenizer()``, built on first use, so it answers exactly as the transformers one."""

    chat_template = None
    padding_side = "left"

    def __init__(self) -> None:
        from tokenizers import AddedToken

        self._backend = _char_backend()
        self._backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = SPECIALS
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = range(len(SPECIALS))
        self._full = None

    def __len__(self) -> int:
        return len(SPECIALS) + len(CHARS)

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        if kwargs:
            return self.transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            return {"input_ids": self._backend.encode(text, add_special_tokens=add_special_tokens).ids}
        batch = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in batch]}

    def transformers(self) -> PreTrainedTokenizerFast:
        """``char_tokenizer()``, built once."""
        if self._full is None:
            self._full = char_tokenizer()
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_full":  # pickling and copying look these up before __init__ ran
            raise AttributeError(name)
        return getattr(self.transformers(), name)

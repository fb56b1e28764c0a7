"""A character-level tokenizer for the built-in tiny presets.

The tiny presets train from random initialisation, so a small vocabulary matters: with one token
per character (digits, a few operators, lowercase letters) a random policy already hits the right
answer to a digit task with probability ~1/10, which is what lets a 2-core CPU see the reward rise
within minutes. It is a real ``PreTrainedTokenizerFast`` (saved and loaded like any other).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=?:,. ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def char_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    return fast

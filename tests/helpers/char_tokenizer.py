"""A character-level tokenizer for the tiny random models: token id i (2..95) is one printable ASCII
character, 0 and 1 are the end and start tokens. Every token adds exactly one character of text, so a
test can aim a stop string at any token it likes."""

from __future__ import annotations

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS, BOS = "</s>", "<s>"
FIRST_CHAR_ID = 2


def char_of(token_id: int) -> str:
    return chr(ord("!") + token_id - FIRST_CHAR_ID)


def save_char_tokenizer(folder: str, vocab_size: int = 96) -> str:
    vocab = {EOS: 0, BOS: 1, **{char_of(i): i for i in range(FIRST_CHAR_ID, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS,
                                                eos_token=EOS, unk_token=EOS)
    fast.save_pretrained(folder)
    return folder

"""A character-level tokenizer, saved and loaded as an ordinary Hugging Face tokenizer.

One token per character of printable ASCII (space ``' '`` to ``'~'``) plus tab and newline, and four
special tokens. It is built with the ``tokenizers`` library (a ``WordLevel`` model whose vocabulary is
the single characters, a ``Split`` pre-tokenizer that isolates every character, a ``Fuse`` decoder
that concatenates tokens without spaces) and wrapped in ``PreTrainedTokenizerFast``, so that
``AutoTokenizer.from_pretrained(dir)`` loads it exactly like a real model's tokenizer.

Ids (fixed, so a saved model and a rebuilt tokenizer always agree)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4.. ' ' '!' ... '~' '\\t' '\\n'

Encoding with ``add_special_tokens=True`` (the default) prepends ``<bos>``; ``<eos>`` is never added
by the tokenizer: demonstrations append it explicitly and generation stops on it. The tokenizer
carries :data:`~flow_assets.policy.chat.COMPACT_CHAT_TEMPLATE` as its chat template (saved in
``tokenizer_config.json``), so the gateway renders conversations for it like for any chat model.

Round trip: for any text made of the vocabulary's characters that does not contain a special
token's literal spelling (e.g. ``"<eos>"``), ``decode(encode(text), skip_special_tokens=True) == text``.
Characters outside the vocabulary encode to ``<unk>`` (and so do not round-trip).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flow_assets.policy.chat import COMPACT_CHAT_TEMPLATE

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: printable ASCII (0x20..0x7E) plus tab and newline, in id order after the special tokens
CHARACTERS: tuple[str, ...] = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\t", "\n")


@dataclass(frozen=True)
class CharTokenizerConfig:
    """How the character tokenizer is wrapped for ``transformers``.

    Attributes:
        model_max_length: longest sequence (in tokens = characters + specials) the model accepts;
            stored in ``tokenizer_config.json``. Must match the model's ``max_position_embeddings``.
        padding_side: side ``tokenizer.pad`` pads on; ``"left"`` because batched generation needs
            left padding (the sampler pads by itself anyway and does not rely on this).
    """

    model_max_length: int = 128
    padding_side: str = "left"


def char_vocabulary() -> dict[str, int]:
    """The fixed token -> id map: the 4 special tokens, then :data:`CHARACTERS` (101 entries)."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_char_tokenizer(config: CharTokenizerConfig | None = None) -> PreTrainedTokenizerFast:
    """Build the character tokenizer in memory.

    Returns:
        a ``PreTrainedTokenizerFast`` with ``pad/bos/eos/unk`` set (ids 0/1/2/3), ``len == 101``,
        ``clean_up_tokenization_spaces=False`` (cleanup would rewrite ``" ."`` and break round trips).
    """
    config = config or CharTokenizerConfig()
    vocab = char_vocabulary()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # every character (newline included: [\s\S] rather than '.') becomes its own pre-token
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        padding_side=config.padding_side,
        model_max_length=config.model_max_length,
        chat_template=COMPACT_CHAT_TEMPLATE,
    )


def save_char_tokenizer(directory: str | Path, config: CharTokenizerConfig | None = None) -> Path:
    """Build the tokenizer and ``save_pretrained`` it into ``directory`` (created if missing).

    Returns:
        the directory, loadable with ``AutoTokenizer.from_pretrained(directory)``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(config).save_pretrained(str(directory))
    return directory

"""Text tokenizers through Megatron-Core's own classes (``megatron.core.tokenizers``).

``build_tokenizer`` takes Megatron's flags by their names:

* ``--tokenizer-type``: ``HuggingFaceTokenizer``, ``SentencePieceTokenizer`` (also Megatron's
  aliases ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``) or ``NullTokenizer``;
* ``--tokenizer-model``: the local tokenizer folder (HuggingFace: a folder holding
  ``tokenizer.json``/``tokenizer_config.json``; a path to the ``tokenizer.json`` inside it works
  too) or the SentencePiece ``.model`` file. Nothing is ever downloaded;
* ``--vocab-size``: the NullTokenizer's vocabulary (its EOS is ``vocab_size - 1``, Megatron's
  ``eod``, unless ``null_tokenizer_eod_id`` is set);
* optional ``trust_remote_code`` (HuggingFace).

What Megatron-Core 0.19.2 offers, as found on this machine: ``MegatronTokenizer.from_pretrained``
with an in-memory metadata dict (``{"library": "huggingface" | "sentencepiece" | "null-text"}``)
returns a ``DefaultTokenizerText`` around ``HuggingFaceTokenizer`` (transformers'
``AutoTokenizer``), ``SentencePieceTokenizer`` (needs the ``sentencepiece`` package) or
``NullTokenizer`` (text = space-separated ids). All three cases are served by Megatron's classes;
no transformers wrapper of our own is needed. The gaps this module closes:

* the NullTokenizer has no ``eos_id`` (only ``eod``), so ``Tokenizer.eos_id`` reads ``eod``;
* Megatron's HuggingFace ``eos_id`` raises ``TypeError`` when the tokenizer defines no EOS token,
  and SentencePiece reports ``-1``: both become a ``ValueError`` naming ``--tokenizer-model``;
* Megatron's HuggingFace path needs a folder (``AutoTokenizer`` refuses a ``tokenizer.json``
  file path), so a file path is turned into its folder;
* Megatron's HuggingFace ``text_to_ids`` always adds the tokenizer's special tokens (e.g. a BOS);
  ``tokenize(text, add_special_tokens=False)`` (for responses) calls the underlying HF tokenizer
  without them;
* the HF ``model_max_length`` is lifted so million-token prompts do not log a bogus
  "sequence length is longer than the specified maximum" warning.
"""

import os
import sys
from typing import Optional

HUGGINGFACE_TYPES = ("HuggingFaceTokenizer",)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
NULL_TYPES = ("NullTokenizer",)
SUPPORTED_TOKENIZER_TYPES = HUGGINGFACE_TYPES + SENTENCEPIECE_TYPES + NULL_TYPES


class Tokenizer:
    """The small interface the trainer uses, over a Megatron-Core text tokenizer.

    ``megatron`` is the Megatron-Core tokenizer object itself (``MegatronTokenizerText``),
    ``library`` its Megatron library name.
    """

    def __init__(self, megatron_tokenizer, library: str, tokenizer_type: str, eos_id: int,
                 vocab_size: int):
        self.megatron = megatron_tokenizer
        self.library = library
        self.tokenizer_type = tokenizer_type
        self.eos_id = eos_id
        self.vocab_size = vocab_size

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens=False`` leaves out what the tokenizer adds
        around a text (a BOS for some HF tokenizers), for continuations such as responses.
        NullTokenizer text is whitespace-separated integer ids."""
        if not isinstance(text, str):
            raise ValueError(f"tokenize expects a string, got {type(text).__name__}")
        if self.library == "null-text":
            words = text.split()
            if not words:
                return []
            try:
                return self.megatron.tokenize(" ".join(words))
            except ValueError:
                raise ValueError("NullTokenizer text must be whitespace-separated integer ids, "
                                 f"got {text[:40]!r}") from None
        if self.library == "huggingface" and not add_special_tokens:
            return self.megatron._tokenizer.tokenizer(text, add_special_tokens=False).input_ids
        return list(self.megatron.tokenize(text))

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list or 1-D tensor); special tokens such as EOS are kept unless
        ``skip_special_tokens``."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if self.library == "null-text":
            return self.megatron.detokenize(ids)
        return self.megatron.detokenize(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.tokenizer_type}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, *, vocab_size: Optional[int] = None,
                    null_tokenizer_eod_id: Optional[int] = None, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``/``--tokenizer-model``/``--vocab-size``;
    ``ValueError`` naming the flag for anything missing or unusable."""
    from megatron.core.tokenizers import MegatronTokenizer

    model = tokenizer_model
    if tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}")

    if tokenizer_type in NULL_TYPES:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 2, "
                             f"got {vocab_size!r}")
        kwargs = dict(vocab_size=vocab_size)
        eod_id = null_tokenizer_eod_id
        if eod_id is not None:
            if not 0 <= eod_id < vocab_size:
                raise ValueError(f"null_tokenizer_eod_id {eod_id} is outside --vocab-size {vocab_size}")
            kwargs["eod_id"] = eod_id
        tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, **kwargs)
        return Tokenizer(tok, "null-text", tokenizer_type, eos_id=int(tok.eod),
                         vocab_size=int(tok.vocab_size))

    if not model:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    if not os.path.exists(model):
        raise ValueError(f"--tokenizer-model {model}: no such file or folder "
                         "(tokenizers are loaded from local paths only)")

    if tokenizer_type in HUGGINGFACE_TYPES:
        library = "huggingface"
        path = (os.path.dirname(model) or ".") if os.path.isfile(model) else model
        kwargs = dict(trust_remote_code=trust_remote_code)
    else:
        library = "sentencepiece"
        path = model
        if not os.path.isfile(model):
            raise ValueError(f"--tokenizer-model {model}: SentencePieceTokenizer needs the "
                             ".model file, not a folder")
        kwargs = {}
    try:
        tok = MegatronTokenizer.from_pretrained(tokenizer_path=path,
                                                metadata_path={"library": library}, **kwargs)
    except ModuleNotFoundError as err:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs the {err.name or library} "
                         "package, which is not installed") from err
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--tokenizer-model {model}: cannot load a {tokenizer_type}: "
                         f"{first_line}") from err

    if library == "huggingface":
        hf = tok._tokenizer.tokenizer
        hf.model_max_length = sys.maxsize
        if hf.eos_token is None:
            raise ValueError(f"--tokenizer-model {model}: the tokenizer defines no EOS token "
                             "(set eos_token in tokenizer_config.json)")
    eos_id = tok.eos_id
    if eos_id is None or eos_id < 0:
        raise ValueError(f"--tokenizer-model {model}: the tokenizer defines no EOS token")
    return Tokenizer(tok, library, tokenizer_type, eos_id=int(eos_id),
                     vocab_size=int(tok.vocab_size))

"""Tokenizers: `tokenizer.json` through the `tokenizers` library, or a byte-level fallback."""

from pathlib import Path

from .errors import DeepinferError


def is_text(value: str) -> bool:
    """Unicode text, which every tokenizer and encoder takes: a Python str may hold lone surrogates
    (JSON's "\\ud800", YAML's escapes, invalid UTF-8 in argv), which none does."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ByteTokenizer:
    """UTF-8 bytes as ids 2..257; ids 0 and 1 stay free for BOS/EOS. For models without a tokenizer."""

    OFFSET = 2

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.OFFSET:
            raise DeepinferError(f"the byte-level tokenizer needs vocab_size >= {256 + self.OFFSET}, not {vocab_size}; add a tokenizer.json.")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # (it has none)
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # (it has none)
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def decode_token(self, token: int) -> str:
        """One token's text on its own (logprobs' token strings)."""
        return self.decode([token])


class HFTokenizer:
    def __init__(self, source: str, where: str):
        """`source`: the tokenizer.json text (read by the caller, verified where it came from a bundle)."""
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(source)
        except Exception as err:  # the tokenizers library raises a bare Exception on bad files
            raise DeepinferError(f"{where}: cannot read tokenizer ({str(err)[:200]}).") from None
        self.source = source  # (llguidance builds its own view of the vocabulary from it)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for text that already has them (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token: int) -> str:
        """One token's text on its own, special tokens spelled out (logprobs' token strings)."""
        return self._tok.decode([token], skip_special_tokens=False)


def load_tokenizer(directory: Path | None, vocab_size: int):
    """A checkpoint's `directory/tokenizer.json` if there is one, else bytes."""
    path = Path(directory) / "tokenizer.json" if directory is not None else None
    if path is not None and path.is_file():
        return HFTokenizer(path.read_text(), str(path))
    return ByteTokenizer(vocab_size)


def bundle_tokenizer(executor):
    """The tokenizer file a loaded bundle's manifest names (read through its verifying reader), else bytes."""
    m = executor.manifest
    if m.tokenizer is None:
        return ByteTokenizer(m.vocab_size)
    return HFTokenizer(executor.files.text(m.tokenizer), str(executor.bundle / m.tokenizer))

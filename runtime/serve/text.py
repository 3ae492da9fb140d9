"""Token ids -> the text a client sees, one token at a time: incremental detokenization (a
character whose UTF-8 bytes span several tokens comes out whole, once) and stop strings (held
back while they may still be starting, never included; as vLLM, not looked for before
min_tokens tokens)."""


class TextStream:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0, keep_special: bool = False, hidden=()):
        """`keep_special`: special tokens are spelled out (a markup made of them is parsed), except
        the `hidden` ones (EOS)."""
        self.tokenizer, self.keep_special, self.hidden = tokenizer, keep_special, set(hidden)
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded last time: the context for the next piece
        self.read = 0
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found; `text` ends just before it

    def add(self, token: int) -> str:
        """Feed one generated token; returns the text that may be sent now (often "")."""
        if self.stopped or (self.keep_special and token in self.hidden):
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its next token
            return ""
        self._extend(after[len(before) :])
        return self._take(final=False)

    def finish(self) -> str:
        """The text still held back, once the sequence has ended."""
        if not self.stopped:
            before = self._decode(self.ids[self.prefix : self.read])
            self._extend(self._decode(self.ids[self.prefix :])[len(before) :])
        return self._take(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not self.keep_special)

    def _extend(self, piece: str):
        self.prefix, self.read = self.read, len(self.ids)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        if len(self.ids) < self.min_tokens:
            return
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest end of `text` that may be the start of a stop string."""
        for k in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

"""Which sequence slots hold the state of which tokens, indexed by hashed token blocks (prefix caching).

Each slot's tokens are cut into blocks of `block` tokens and each whole block hashed together
with the hash of the blocks before it, so one hash names a whole prefix. Finding how much of a
new prompt each slot holds then walks the prompt's block hashes once (stopping at the first no
slot has) and compares at most one block per slot in Python, token by token. The prefix a hash
matched is confirmed by one list comparison per slot (in C, about a nanosecond a token), so a
hash collision cannot make a wrong match.
"""

class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self.tokens: dict[int, list[int]] = {}  # slot -> the tokens whose state it holds
        self.chains: dict[int, list[int]] = {}  # slot -> the chained hash of each whole block of its tokens
        self.slots_of: dict[int, set[int]] = {}  # chained hash -> the slots holding that prefix

    def add(self, slot: int, tokens: list[int]):
        """Slot `slot` now holds the state of `tokens` (replacing what it held)."""
        self.remove(slot)
        self.tokens[slot] = tokens
        self.chains[slot] = list(self._chain(tokens))
        for h in self.chains[slot]:
            self.slots_of.setdefault(h, set()).add(slot)

    def remove(self, slot: int):
        for h in self.chains.pop(slot, ()):
            slots = self.slots_of[h]
            slots.discard(slot)
            if not slots:
                del self.slots_of[h]
        self.tokens.pop(slot, None)

    def matches(self, prompt: list[int]) -> dict[int, int]:
        """slot -> how many leading tokens of `prompt` its tokens share."""
        depth = dict.fromkeys(self.tokens, 0)  # slot -> whole blocks shared
        for level, h in enumerate(self._chain(prompt), start=1):
            slots = self.slots_of.get(h)
            if not slots:
                break
            depth.update(dict.fromkeys(slots, level))
        shared = {}
        for slot, blocks in depth.items():
            tokens, start = self.tokens[slot], blocks * self.block
            if tokens[:start] != prompt[:start]:  # a hash collision: compare all of it
                shared[slot] = _common_length(tokens, prompt)
            else:  # (the next block differs, or one of them ends in it: no slot had the prompt's next hash)
                end = start + self.block
                shared[slot] = start + _common_length(tokens[start:end], prompt[start:end])
        return shared

    def _chain(self, tokens: list[int]):
        h = 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, *tokens[start : start + self.block]))
            yield h


def _common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

"""Which sequence slots hold the state of which tokens, indexed by hashed token blocks (prefix caching).

Each slot's tokens are cut into blocks of `block` tokens and each whole block hashed together
with the hash of the blocks before it, so one hash names a whole prefix. Finding how much of a
new prompt each slot holds then walks the prompt's block hashes once (stopping at the first no
slot has) and compares at most one block per slot in Python, token by token. The prefix a hash
matched is confirmed by one list comparison per slot (in C, about a nanosecond a token), so a
hash collision cannot make a wrong match.

A slot's tokens carry a salt (a request's cache_salt, a tenant's key): a prompt matches only the
slots of its own salt, so requests of different salts never share state or learn from each
other's hits. The salt starts each hash chain and is compared itself (a collision cannot join two).
"""

class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self.tokens: dict[int, list[int]] = {}  # slot -> the tokens whose state it holds
        self.chains: dict[int, list[int]] = {}  # slot -> the chained hash of each whole block of its tokens
        self.slots_of: dict[int, set[int]] = {}  # chained hash -> the slots holding that prefix
        self.salts: dict[int, str] = {}  # slot -> the salt of the request whose tokens it holds

    def add(self, slot: int, tokens: list[int], salt: str = ""):
        """Slot `slot` now holds the state of `tokens`, for prompts salted `salt` (replacing what it held)."""
        self.remove(slot)
        self.tokens[slot], self.salts[slot] = tokens, salt
        self.chains[slot] = list(self._chain(tokens, salt))
        for h in self.chains[slot]:
            self.slots_of.setdefault(h, set()).add(slot)

    def remove(self, slot: int):
        for h in self.chains.pop(slot, ()):
            slots = self.slots_of[h]
            slots.discard(slot)
            if not slots:
                del self.slots_of[h]
        self.tokens.pop(slot, None)
        self.salts.pop(slot, None)

    def matches(self, prompt: list[int], salt: str = "") -> dict[int, int]:
        """slot -> how many leading tokens of `prompt` its tokens share, for the slots salted `salt`."""
        depth = {slot: 0 for slot, s in self.salts.items() if s == salt}  # slot -> whole blocks shared
        for level, h in enumerate(self._chain(prompt, salt), start=1):
            slots = [slot for slot in self.slots_of.get(h, ()) if slot in depth]
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

    def _chain(self, tokens: list[int], salt: str):
        h = hash(salt)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, *tokens[start : start + self.block]))
            yield h


def _common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

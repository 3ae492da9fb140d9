"""Consistency inside our model: chunking and batching must not change the math."""

import torch

from .conftest import MAX_LEN, MAX_SEQS, prefill

def flat(state):
    return [t for layer in state for t in layer]


PROMPT = [7, 3, 250, 11, 42, 42, 9, 100, 31, 8, 77, 5, 200, 13, 64, 2, 90, 91, 17, 300, 6, 4]


def test_prefill_in_three_chunks_equals_one_shot(tiny_model):
    one_kv, chunk_kv = tiny_model.new_state(MAX_SEQS, MAX_LEN), tiny_model.new_state(MAX_SEQS, MAX_LEN)
    one_shot = prefill(tiny_model, one_kv, 1, PROMPT, chunk=32)
    chunked = prefill(tiny_model, chunk_kv, 1, PROMPT, chunk=8)  # 22 tokens: 8 + 8 + 6 (+2 padding)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    n = len(PROMPT)
    for one, chunk in zip(flat(one_kv), flat(chunk_kv)):
        torch.testing.assert_close(chunk[1, :n], one[1, :n], atol=1e-5, rtol=1e-5)


def test_batched_decode_with_padding_equals_each_sequence_alone(tiny_model):
    prompts = {0: PROMPT[:5], 2: PROMPT[3:17], 3: PROMPT[9:]}
    kv = tiny_model.new_state(MAX_SEQS, MAX_LEN)
    for slot, ids in prompts.items():
        prefill(tiny_model, kv, slot, ids)
    scratch = MAX_SEQS
    live_before = [t[:MAX_SEQS].clone() for t in flat(kv)]
    alone = {}
    for slot, ids in prompts.items():
        solo_kv = [[t.clone() for t in layer] for layer in kv]
        alone[slot] = tiny_model.decode(torch.tensor([ids[-1]]), torch.tensor([len(ids)]), torch.tensor([slot]), solo_kv)[0]

    # 3 live rows and 3 padding rows (bucket of 6), live rows out of slot order.
    slots = [2, scratch, 0, scratch, 3, scratch]
    tokens = [prompts[s][-1] if s != scratch else 0 for s in slots]
    positions = [len(prompts[s]) if s != scratch else 0 for s in slots]
    batched = tiny_model.decode(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), kv)
    for row, slot in enumerate(slots):
        if slot != scratch:
            torch.testing.assert_close(batched[row], alone[slot], atol=1e-5, rtol=1e-5)

    # Padding touched only the scratch slot: every live slot changed at exactly its new position.
    for before, after in zip(live_before, flat(kv)):
        changed = (before != after[:MAX_SEQS]).any(dim=-1)  # [S, L]
        expected = torch.zeros_like(changed)
        for slot, ids in prompts.items():
            expected[slot, len(ids)] = True
        assert torch.equal(changed, expected)


def test_prefill_padding_leaves_other_slots_untouched(tiny_model):
    kv = tiny_model.new_state(MAX_SEQS, MAX_LEN)
    prefill(tiny_model, kv, 0, PROMPT[:10])
    before = [t[:MAX_SEQS].clone() for t in flat(kv)]
    prefill(tiny_model, kv, 2, PROMPT[:3], chunk=16)  # 13 padding tokens
    for b, after in zip(before, flat(kv)):
        changed = (b != after[:MAX_SEQS]).any(dim=-1)
        assert changed[2, :3].all() and changed.sum() == 3

"""Property: a pjrt region file mutated in any way -- bytes flipped (outside the executable's machine
code, which only a signature guards: XLA can segfault deserializing a flipped one), cut short, its executable or
StableHLO taken from another region, its StableHLO garbled and compiled at load
(DEEPINFER_PJRT_RECOMPILE=1), its metadata or tensor entries of another type -- loads or
is refused with a BundleError naming the file; never another exception, never a hang.

    .venv/bin/python -m pytest tests/runtime/test_pjrt_region_fuzz.py -s     # prints the tally
"""

import json
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.runtime.errors import BundleError
from deepinfer.runtime.manifest import Manifest
from deepinfer.runtime.weights import header_of, tensors_of

pjrt = pytest.importorskip("deepinfer.runtime.backends.pjrt")

TALLY = {"regions": 0, "loaded": 0, "clean errors": 0}


@pytest.fixture(scope="module")
def regions(pjrt_bundle):
    """[(manifest entry, its parts {name: bytes}, its metadata)] for every region of the bundle."""
    import torch

    manifest = Manifest.from_dict(json.loads((pjrt_bundle / "manifest.json").read_text()))
    found = []
    for entry in manifest.regions.values():
        buffer = torch.frombuffer(bytearray((pjrt_bundle / entry.file).read_bytes()), dtype=torch.uint8)
        parts = {name: t.numpy().tobytes() for name, t in tensors_of(buffer, entry.file).items()}
        found.append((entry, parts, header_of(buffer, entry.file)[0]["__metadata__"]))
    return found


def safetensors(parts: dict[str, bytes], metadata, entries: dict | None = None) -> bytes:
    """A safetensors file of byte tensors `parts`, with any JSON as `__metadata__` and any
    replacement header `entries` (name -> what the header says of it)."""
    header, offset = {}, 0
    for name, data in parts.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    header.update(entries or {})
    header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"".join(parts.values())


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(), st.text(max_size=6),
                        st.sampled_from(["", "cpu", "neuron", "cuda", "cpu x", "[0, 0]", "[999]", "[-1]", "{}", "[",
                                         "[0.5]", "[true]", "\"cpu\"", "cpu (jaxlib 0.0.1)"]),
                        st.lists(st.integers(-1, 40), max_size=3), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))


@st.composite
def mutations(draw, regions):
    """(the region's manifest entry, the mutated file's bytes, whether DEEPINFER_PJRT_RECOMPILE is set)."""
    target = draw(st.integers(0, len(regions) - 1))
    entry, parts, metadata = regions[target]
    whole = safetensors(parts, metadata)
    kind = draw(st.sampled_from(["flip", "cut", "swap", "metadata", "entry", "stablehlo"]))
    if kind == "flip":  # each flip in the header or the StableHLO: a flipped executable is code, and XLA may
        data = bytearray(whole)  # crash deserializing one (seen: a segfault), as any tampered native code may
        code = range(len(whole) - len(parts["executable"]) - len(parts["stablehlo"]), len(whole) - len(parts["stablehlo"]))
        spots = st.integers(0, len(data) - 1).filter(lambda at: at not in code)
        for at, bits in draw(st.lists(st.tuples(spots, st.integers(1, 255)), min_size=1, max_size=4)):
            data[at] ^= bits
        data = bytes(data)
    elif kind == "cut":
        data = whole[: draw(st.integers(0, len(whole) - 1))]
    elif kind == "swap":  # one part from another region's file
        part = draw(st.sampled_from(["executable", "stablehlo"]))
        other = regions[draw(st.integers(0, len(regions) - 1))][1]
        data = safetensors({**parts, part: other[part]}, metadata)
    elif kind == "stablehlo":  # garbled program text, compiled at load (an executable for another plugin)
        text = bytearray(parts["stablehlo"])
        for at, bits in draw(st.lists(st.tuples(st.integers(0, len(text) - 1), st.integers(1, 255)), min_size=1, max_size=4)):
            text[at] ^= bits
        data = safetensors({**parts, "stablehlo": bytes(text)}, {**metadata, "platform_version": "cpu (elsewhere)"})
        return entry, data, True
    elif kind == "metadata":
        key = draw(st.sampled_from(["platform", "platform_version", "mutated_inputs", None]))
        changed = draw(JSON_VALUES) if key is None else {**metadata, key: draw(JSON_VALUES)}
        data = safetensors(parts, changed)
    else:  # a tensor entry that says another dtype or shape, or is not an entry
        name = draw(st.sampled_from(["executable", "stablehlo"]))
        size = len(parts[name])
        entry_value = draw(st.sampled_from([{"dtype": "F32", "shape": [size // 4]}, {"dtype": "BF16", "shape": [size // 2]},
                                            {"dtype": "U8", "shape": [1, size]}, {"dtype": "U8", "shape": [size - 1]}]))
        offsets = {n: [sum(len(parts[m]) for m in list(parts)[:i]), sum(len(parts[m]) for m in list(parts)[: i + 1])]
                   for i, n in enumerate(parts)}
        replaced = {name: {**entry_value, "data_offsets": offsets[name]}} if draw(st.booleans()) else {name: draw(JSON_VALUES)}
        data = safetensors(parts, metadata, replaced)
    return entry, data, draw(st.booleans())


def test_mutated_pjrt_regions_load_or_fail_cleanly(regions):
    for entry, parts, metadata in regions:  # the unchanged files load
        pjrt.load(safetensors(parts, metadata), entry, entry.file)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutations(regions))
    def check(case):
        entry, data, recompile = case
        os.environ["DEEPINFER_PJRT_RECOMPILE"] = "1" if recompile else "0"
        TALLY["regions"] += 1
        try:
            pjrt.load(data, entry, "fuzzed.pjrt")
            TALLY["loaded"] += 1
        except BundleError as err:
            assert str(err).startswith("fuzzed.pjrt: "), err
            TALLY["clean errors"] += 1
        finally:
            del os.environ["DEEPINFER_PJRT_RECOMPILE"]

    check()
    print(f"\npjrt region fuzz: {TALLY}; tracebacks 0, hangs 0 (any would have failed this test)")

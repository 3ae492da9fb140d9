"""Serialized ExportedPrograms (`.ep.json`), run by PyTorch's eager kernels: the reference backend,
and the one that carries no code: a deployment that refuses native regions runs these.

Loaded without `torch.export.load`, whose archive reader unpickles sample inputs and constants:
the JSON is first held to the allow-list of what deepinfer-compile writes (`export_schema`: why
nothing that passes can run Python), then deserialized with empty weights, then run once on fake
tensors of the manifest's input specs, so a graph that does not compute the outputs the manifest
promises (a region file of another region, a mangled node) is refused at load, not mid-request."""

import functools
import json
import types
import typing

import torch
from torch._export.serde import serialize
from torch._export.serde.serialize import SerializedArtifact, deserialize
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import BundleError
from ..export_schema import checked_program

NATIVE_CODE = False


class _TypingWithSchemaHintsOnce(types.ModuleType):
    """`typing` for torch's deserializer, resolving each schema class's type hints once: it asks
    again for every node and value it reads (pytorch/pytorch#196452), half of a region's load time
    (a 58-region V4 bundle: 91 s -> 43 s)."""

    def __getattr__(self, name):
        return getattr(typing, name)

    @staticmethod
    def get_type_hints(obj, globalns=None, localns=None, include_extras=False):
        if globalns is vars(serialize.schema) and localns is None and isinstance(obj, type):
            return _schema_hints(obj, include_extras)
        return typing.get_type_hints(obj, globalns, localns, include_extras)


@functools.cache
def _schema_hints(cls: type, include_extras: bool) -> dict:
    return typing.get_type_hints(cls, vars(serialize.schema), None, include_extras)


serialize.typing = _TypingWithSchemaHintsOnce("typing")


def load(data: bytes, region, where: str):
    program = checked_program(data, where)
    try:
        module = deserialize(SerializedArtifact(json.dumps(program).encode(), {}, {}, None)).module()
        with FakeTensorMode():
            fakes = [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in region.inputs]
            outputs = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in module(*fakes)]
    except Exception as err:  # past the allow-list nothing can run: any failure is a malformed graph
        raise BundleError(f"{where}: not a graph this runtime can run on the manifest's inputs "
                          f"({type(err).__name__}: {str(err)[:200]}). Recompile the bundle.") from None
    wanted = [(s.shape, s.dtype) for s in region.outputs]
    if outputs != wanted:
        raise BundleError(f"{where}: computes {outputs} where the manifest says {wanted} (a region file of another "
                          "region?). Recompile the bundle.")

    def call(*args):
        return tuple(module(*args))

    return call

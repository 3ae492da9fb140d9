"""Serialized ExportedPrograms (`.ep.json`), run by PyTorch's eager kernels: the reference backend,
and the one that carries no code: a deployment that refuses native regions runs these.

Loaded without `torch.export.load`, whose archive reader unpickles sample inputs and constants:
the JSON is first held to the allow-list of what deepinfer-compile writes (`export_schema`: why
nothing that passes can run Python), then deserialized with empty weights, then run once on fake
tensors of the manifest's input specs, so a graph that does not compute the outputs the manifest
promises (a region file of another region, a mangled node) is refused at load, not mid-request."""

import dataclasses
import functools
import types
import typing

import torch
from torch._export.serde import serialize
from torch._export.serde.union import _Union
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import grouped_matmul, int_matmul  # noqa: F401  (register the deepinfer ops a region may call)
from ..errors import BundleError
from ..export_schema import checked_program

NATIVE_CODE = False


_NONE = type(None)
_torch_dict_to_dataclass = serialize._dict_to_dataclass


@functools.cache
def _converter(cls):
    """A function turning the JSON value of schema type `cls` into its schema dataclass: what torch's
    `_dict_to_dataclass` does, with the type dispatch and type hints worked out once per type instead
    of at every node and value (pytorch/pytorch#196452). The tiny V4's 12 regions convert in 0.9 s
    instead of 5.5 s (3.6 s with the type hints cached alone) and load in 5.8 s instead of 8.8 s."""
    cls = serialize._resolve_schema_cls(cls)
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin is typing.Annotated:
        return _converter(cls.__origin__)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and _NONE in args:
        return functools.partial(_optional, args[0])
    if isinstance(cls, type) and issubclass(cls, _Union):
        return functools.partial(_union, cls, _hints(cls))
    if dataclasses.is_dataclass(cls):
        hints = _hints(cls)
        return functools.partial(_dataclass, cls, [(f.name, hints[f.name]) for f in dataclasses.fields(cls)])
    if origin is list:
        return functools.partial(_list, args[0])
    if origin is dict:
        return functools.partial(_dict, args[1])
    if cls is float:
        return float
    return functools.partial(_torch_dict_to_dataclass, cls) if origin else _identity


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls, globalns=vars(serialize.schema))


def _identity(data):
    return data


def _optional(cls, data):
    return None if data is None else _converter(cls)(data)


def _union(cls, hints, data: dict):
    (tag, value), = data.items()
    return cls.create(**{tag: _converter(hints[tag])(value)})


def _dataclass(cls, fields, data: dict):
    return cls(**{name: _converter(hint)(data[name]) for name, hint in fields if name in data})


def _list(cls, data: list):
    item = _converter(cls)
    return [item(d) for d in data]


def _dict(cls, data: dict):
    value = _converter(cls)
    return {k: value(v) for k, v in data.items()}


serialize._dict_to_dataclass = lambda cls, data: _converter(cls)(data)


def load(data: bytes, region, where: str):
    program = checked_program(data, where)
    try:
        serialized = _converter(serialize.ExportedProgram)(program)
        module = serialize.ExportedProgramDeserializer().deserialize(serialized, {}, {}, None).module()
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

"""What an export region file may hold: the part of torch.export's JSON that deepinfer-compile
writes, checked field by field before torch's deserializer sees any of it.

Why an allow-list, and not torch's own checks: torch's deserializer is written for files its user
made. It hands symbolic sizes (`as_expr`) and range constraints to `sympy.sympify`, which is
Python's `eval`; it resolves operator names by walking attributes from the `torch` module; it
reads pytree specs and free-form metadata. Our regions are static graphs: every size, stride and
scalar is a number, and every node calls an ATen, prims or deepinfer operator overload (or
`torch.cond` over graphs of the same kind). So a file is read as a tree of exactly the fields our
compiler emits, each with the type it has there; anything else -- a symbolic value, a range
constraint, a custom object, an operator that does not resolve to a registered overload, a field
we never write -- is refused, naming its path. Nothing in a file that passes can name Python code.
Node metadata (source locations, module paths) is then dropped: running a graph needs none of it.
"""

import json
import re

import torch

from .errors import BundleError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
STRING = re.compile(r"[A-Za-z0-9_,.\->]{0,200}")  # einsum equations, reduce / rounding modes
OPERATOR = re.compile(r"torch\.ops\.(aten|prims|deepinfer)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
COND = "torch.ops.higher_order.cond"
GETITEM = "_operator.getitem"
MAX_GRAPH_DEPTH = 3  # a cond's branches may hold a cond; our models need one level
FLOAT_WORDS = ("Infinity", "-Infinity", "NaN")  # how torch's serializer writes non-finite floats


class Refused(Exception):
    def __init__(self, path: str, what: str):
        super().__init__(f"{path}: {what}")


# --- leaves --------------------------------------------------------------------------------

def integer(value, path):
    if type(value) is not int or not -(1 << 63) <= value < 1 << 63:
        raise Refused(path, f"must be a 64-bit integer, not {_show(value)}")


def small_enum(value, path):  # dtype, layout, memory format: torch's enum numbers
    if type(value) is not int or not 0 <= value < 256:
        raise Refused(path, f"must be a small enum number, not {_show(value)}")


def boolean(value, path):
    if type(value) is not bool:
        raise Refused(path, f"must be true or false, not {_show(value)}")


def number(value, path):
    if type(value) not in (int, float) and value not in FLOAT_WORDS:
        raise Refused(path, f"must be a number, not {_show(value)}")


def name(value, path):
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise Refused(path, f"must be an identifier, not {_show(value)}")


def argument_name(value, path):  # "" for a higher-order op's operands
    if value != "":
        name(value, path)


def short_string(value, path):
    if not isinstance(value, str) or not STRING.fullmatch(value):
        raise Refused(path, f"must be a short plain string (an einsum equation, a mode), not {_show(value)}")


def text(value, path):
    if not isinstance(value, str) or len(value) > 200 or not value.isprintable():
        raise Refused(path, f"must be a short printable string, not {_show(value)}")


def string(value, path):  # free-form metadata, dropped before use
    if not isinstance(value, str) or len(value) > 1 << 16:
        raise Refused(path, f"must be a string, not {_show(value)}")


def true(value, path):
    if value is not True:
        raise Refused(path, f"must be true, not {_show(value)}")


def empty(value, path):
    if value not in ({}, []):
        raise Refused(path, f"must be empty: regions are static graphs without {_show(value)}")


def optional(check):
    def check_optional(value, path):
        if value is not None:
            check(value, path)
    return check_optional


def one_of(*values):
    def check_one_of(value, path):
        if value not in values or type(value) is bool:
            raise Refused(path, f"must be one of {list(values)}, not {_show(value)}")
    return check_one_of


# --- structure -----------------------------------------------------------------------------

def fields(**checks):
    """An object with exactly `checks`' keys (torch writes every field of its schema)."""
    def check_fields(value, path):
        if not isinstance(value, dict):
            raise Refused(path, f"must be an object, not {_show(value)}")
        unknown, missing = sorted(set(value) - set(checks)), sorted(set(checks) - set(value))
        if unknown:
            raise Refused(path, f"has field(s) {unknown[:5]} that deepinfer-compile never writes")
        if missing:
            raise Refused(path, f"lacks field(s) {missing[:5]}")
        for key, item in value.items():
            checks[key](item, f"{path}.{key}")
    return check_fields


def union(**checks):
    """torch's tagged union: an object with exactly one of `checks`' names."""
    def check_union(value, path):
        if not isinstance(value, dict) or len(value) != 1:
            raise Refused(path, f"must be an object with one of {sorted(checks)}, not {_show(value)}")
        ((key, item),) = value.items()
        if key not in checks:
            raise Refused(path, f"holds {key!r}, which a static region never has (only {sorted(checks)})")
        checks[key](item, f"{path}.{key}")
    return check_union


def list_of(check, max_items: int = 1 << 20):
    def check_list(value, path):
        if not isinstance(value, list) or len(value) > max_items:
            raise Refused(path, f"must be a list of at most {max_items}, not {_show(value)}")
        for i, item in enumerate(value):
            check(item, f"{path}[{i}]")
    return check_list


def map_of(check):
    def check_map(value, path):
        if not isinstance(value, dict):
            raise Refused(path, f"must be an object, not {_show(value)}")
        for key, item in value.items():
            name(key, f"{path} key")
            check(item, f"{path}.{key}")
    return check_map


# --- torch.export's schema, as deepinfer-compile uses it -------------------------------------

tensor_ref = fields(name=name)
sym_int = union(as_int=integer)  # never as_expr: sympy would evaluate it
device = fields(type=one_of("cpu", "cuda", "meta"), index=optional(integer))
tensor_meta = fields(dtype=small_enum, sizes=list_of(sym_int, 64), strides=list_of(sym_int, 64), storage_offset=sym_int,
                     requires_grad=boolean, device=device, layout=small_enum)
ARGUMENTS = dict(as_none=true, as_tensor=tensor_ref, as_tensors=list_of(tensor_ref), as_int=integer, as_ints=list_of(integer),
                 as_float=number, as_floats=list_of(number), as_bool=boolean, as_bools=list_of(boolean),
                 as_string=short_string, as_scalar_type=small_enum, as_memory_format=small_enum, as_layout=small_enum,
                 as_device=device, as_optional_tensors=list_of(union(as_tensor=tensor_ref, as_none=true)))
argument = union(**ARGUMENTS)
output = union(as_tensor=tensor_ref, as_tensors=list_of(tensor_ref), as_none=true)


def graph(depth: int):
    """A graph; a cond node's operands may hold graphs one level deeper."""
    if depth > MAX_GRAPH_DEPTH:
        def too_deep(value, path):
            raise Refused(path, f"nests graphs deeper than {MAX_GRAPH_DEPTH}")
        return too_deep
    branch = union(**ARGUMENTS, as_graph=fields(name=name, graph=graph(depth + 1)))

    def node(arguments):
        return fields(target=check_target, inputs=list_of(fields(name=argument_name, arg=arguments, kind=one_of(1, 2)), 1024),
                      outputs=list_of(output, 1024), metadata=map_of(string), is_hop_single_tensor_return=optional(boolean),
                      name=name)

    operator_node, cond_node = node(argument), node(branch)

    def check_node(value, path):
        (cond_node if isinstance(value, dict) and value.get("target") == COND else operator_node)(value, path)

    return fields(inputs=list_of(union(as_tensor=tensor_ref)), outputs=list_of(output), nodes=list_of(check_node),
                  tensor_values=map_of(tensor_meta), sym_int_values=empty, sym_bool_values=empty, sym_float_values=empty,
                  custom_obj_values=empty, is_single_tensor_return=boolean)


def check_target(target, path):
    """An operator overload in torch's registry (looked up by its qualified name there, so no
    attribute of any Python object is ever reached), getitem, or torch.cond."""
    if target in (COND, GETITEM):
        return
    match = OPERATOR.fullmatch(target) if isinstance(target, str) else None
    if match is None:
        raise Refused(path, f"calls {_show(target)}, which is not a PyTorch operator")
    namespace, op, overload = match.groups()
    try:
        torch._C._get_schema(f"{namespace}::{op}", "" if overload == "default" else overload)
    except RuntimeError:
        raise Refused(path, f"calls {target!r}, which is not an operator this PyTorch has") from None


def tree_spec(value, path):
    """A pytree spec (JSON in a string) of tuples, dicts and leaves: how the region's flat
    arguments and results are packed."""
    def check_node(node, where, depth):
        fields(type=one_of(None, "builtins.tuple", "builtins.dict", "builtins.list"), context=one_of(None, "null", "[]"),
               children_spec=list_of(lambda child, p: None, 1 << 16))(node, where)
        if depth > 4:
            raise Refused(where, "nests deeper than a region's (args, kwargs)")
        for i, child in enumerate(node["children_spec"]):
            check_node(child, f"{where}.children_spec[{i}]", depth + 1)

    try:
        spec = json.loads(value) if isinstance(value, str) else None
    except (ValueError, RecursionError):
        spec = None
    if not isinstance(spec, list) or len(spec) != 2 or spec[0] != 1:
        raise Refused(path, f"must be a pytree spec, not {_show(value)}")
    check_node(spec[1], path, 0)


call_signature = fields(inputs=empty, outputs=empty, in_spec=tree_spec, out_spec=tree_spec,
                        forward_arg_names=list_of(name))
user_input = union(user_input=fields(arg=union(as_tensor=tensor_ref)))
user_output = union(user_output=fields(arg=union(as_tensor=tensor_ref)))
program = fields(
    graph_module=fields(graph=graph(0), signature=fields(input_specs=list_of(user_input), output_specs=list_of(user_output)),
                        module_call_graph=list_of(fields(fqn=text, signature=optional(call_signature)), 64),
                        metadata=empty, treespec_namedtuple_fields=empty),
    opset_version=map_of(integer), range_constraints=empty, schema_version=fields(major=integer, minor=integer),
    torch_version=text, verifiers=list_of(one_of("TRAINING", "ATEN"), 4), guards_code=empty)


def checked_program(data: bytes, where: str) -> dict:
    """The parsed region file if it passes, with node metadata dropped; BundleError otherwise."""
    def refuse(what: str):
        raise BundleError(f"{where}: {what}. An export region is a static operator graph; this file was not written by "
                          "deepinfer-compile (or was tampered with): recompile the bundle.")

    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        refuse("not a serialized ExportedProgram (JSON)")
    try:
        program(parsed, "region")
    except Refused as err:
        refuse(str(err))
    except RecursionError:
        refuse("nested too deeply")
    _drop_metadata(parsed["graph_module"]["graph"])
    return parsed


def _drop_metadata(graph_body: dict):
    for node in graph_body.get("nodes", []):
        node["metadata"] = {}
        for item in node.get("inputs", []):
            if "as_graph" in item["arg"]:
                _drop_metadata(item["arg"]["as_graph"]["graph"])


def _show(value) -> str:
    return repr(value)[:60]

"""Recipes read as plain data: YAML 1.2's core schema, nothing of YAML 1.1's surprises.

PyYAML's safe loader is YAML 1.1: `4:16` is the integer 256 (base 60), `0400` is octal, `yes` is
true, `2024-01-01` is a date, a repeated key silently keeps the last value, `!!set` and
`!!binary` build Python sets and bytes, and an alias may contain itself. A recipe needs none of
that, and each has shipped a wrong build that looked right. So here:
  - plain scalars resolve as YAML 1.2's core schema: null, true/false, decimal / 0o / 0x
    integers, floats; anything else is a string (`4:16` and `2024-01-01` stay strings, and
    the key's type check then names them); a decimal integer with a leading zero is refused;
  - only the core tags (str, int, float, bool, null, seq, map); no anchors or aliases;
  - a key given twice in one mapping is refused;
  - keys are strings; strings hold no NUL and are Unicode text; integers fit in 64 bits.
Each refusal names the line.
"""

import math
import re

import yaml

from deepinfer.runtime.tokenizer import is_text

CORE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}
LEADING_ZERO = re.compile(r"[-+]?0[0-9]+")


class RecipeYAMLError(ValueError):
    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line = line


class _CoreResolver(yaml.resolver.BaseResolver):
    pass


_CoreResolver.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), list("~nN"))
_CoreResolver.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_CoreResolver.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))
_CoreResolver.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
_CoreResolver.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^$"), [""])  # (an empty value)


class _CoreConstructor(yaml.constructor.SafeConstructor):
    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if LEADING_ZERO.fullmatch(text):
            raise RecipeYAMLError(node.start_mark.line + 1, f"{text} has a leading zero, which YAML 1.1 reads as octal; "
                                  "write the decimal number without it (or 0o... for octal).")
        value = int(text, 0) if len(text) <= 24 else 1 << 64  # (no 64-bit integer is longer; Python refuses past 4300 digits)
        if not -(1 << 63) <= value < 1 << 63:
            raise RecipeYAMLError(node.start_mark.line + 1, f"{text[:20]}... does not fit in 64 bits.")
        return value

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node).lower()
        return {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}.get(text) or float(text)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag != "tag:yaml.org,2002:str":
                raise RecipeYAMLError(key_node.start_mark.line + 1,
                                      f"key {key_node.value!r} is not a string; recipe keys are names.")
            if key_node.value in seen:
                raise RecipeYAMLError(key_node.start_mark.line + 1, f"key {key_node.value!r} is given twice in one mapping.")
            seen.add(key_node.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_str(self, node):
        text = self.construct_scalar(node)
        if "\0" in text or not is_text(text):
            raise RecipeYAMLError(node.start_mark.line + 1, "a string holds a NUL or is not Unicode text (a lone surrogate).")
        return text


_CoreConstructor.add_constructor("tag:yaml.org,2002:int", _CoreConstructor.construct_yaml_int)
_CoreConstructor.add_constructor("tag:yaml.org,2002:float", _CoreConstructor.construct_yaml_float)
_CoreConstructor.add_constructor("tag:yaml.org,2002:str", _CoreConstructor.construct_yaml_str)


class _CoreLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                  _CoreConstructor, _CoreResolver):
    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _CoreConstructor.__init__(self)
        _CoreResolver.__init__(self)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
            raise RecipeYAMLError(self.peek_event().start_mark.line + 1,
                                  "anchors and aliases (&name, *name) are not supported in recipes; write the values out.")
        node = super().compose_node(parent, index)
        if node.tag not in CORE_TAGS:
            raise RecipeYAMLError(node.start_mark.line + 1, f"the tag {node.tag} is not plain data; recipes hold strings, "
                                  "numbers, true/false, null, lists and mappings.")
        return node


def load(text: str):
    """(the document as plain data, its YAML node tree for key lines). Raises RecipeYAMLError
    (with a line) or yaml.YAMLError."""
    loader = _CoreLoader(text)
    try:
        root = loader.get_single_node()
        return (loader.construct_document(root) if root is not None else None), root
    finally:
        loader.dispose()


"""The bundle format: `manifest.json` mirrored by dataclasses, written by the compiler, read here.

A bundle is a directory:
    manifest.json                 this schema
    regions/<fingerprint>.<ext>   one compiled artifact per unique region (no weights inside)
    weights/rank-<r>.safetensors  every graph input that is a weight or buffer, per rank
    tokenizer.json                when the model has one (else the byte-level tokenizer)

Compatibility rules (as ExecuTorch's schema): add fields at the end with a default; never remove
a field or change its meaning; any other change bumps SCHEMA_VERSION, and a runtime refuses a
bundle whose version it does not know.

Integrity: `files` holds the sha256 of every file but the manifest; `checksum` is the sha256 of
the manifest's own canonical JSON without that field. Any flipped byte is caught at load.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import DeepinferError

MAGIC = "deepinfer-bundle"
SCHEMA_VERSION = 1


class BundleError(DeepinferError):
    """A bundle that cannot be used as it is; the message names the file and what to do."""


@dataclass
class TensorSpec:
    shape: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


@dataclass
class Region:
    file: str  # relative to the bundle
    backend: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


@dataclass
class ScheduleStep:
    """`outputs = region(*inputs)`, or a collective over a named group when `collective` is set
    ({"op": "all_reduce", "group": "world"}; region is then ""). Names refer to program inputs,
    kv.<layer>, weights, or earlier outputs."""

    region: str  # fingerprint
    inputs: list[str]
    outputs: list[str]
    collective: dict | None = None


@dataclass
class Program:
    method: str
    bucket: int
    inputs: list[str]  # the Step fields this program reads, in Step.inputs() order
    output: str
    steps: list[ScheduleStep]


@dataclass
class KVSpec:
    max_seqs: int
    max_len: int
    layers: int
    shape: list[int]  # one tensor per layer: [max_seqs + 1, max_len, C]; the last slot is scratch
    dtype: str


@dataclass
class Manifest:
    name: str
    recipe: dict
    model_config: dict
    toolchain: dict  # versions that must match at load: torch, python, deepinfer, backend's own
    parallel: dict
    buckets: dict  # method -> sorted buckets
    kv: KVSpec
    programs: dict[str, Program]  # "method/bucket" -> Program
    regions: dict[str, Region]  # fingerprint -> Region
    weight_files: list[str]  # per rank
    tokenizer: str | None  # relative path of tokenizer.json, or None for bytes
    vocab_size: int
    eos_token_id: int | None
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    magic: str = MAGIC
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        body = asdict(self)
        body["checksum"] = _checksum(body)
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, body: dict) -> "Manifest":
        body = dict(body)
        body.pop("checksum", None)
        body["kv"] = KVSpec(**body["kv"])
        body["programs"] = {
            k: Program(**{**p, "steps": [ScheduleStep(**s) for s in p["steps"]]}) for k, p in body["programs"].items()
        }
        body["regions"] = {
            k: Region(**{**r, "inputs": [TensorSpec(**t) for t in r["inputs"]], "outputs": [TensorSpec(**t) for t in r["outputs"]]})
            for k, r in body["regions"].items()
        }
        return cls(**body)


def _checksum(body: dict) -> str:
    body = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def peek_world_size(bundle: Path) -> int:
    """The bundle's world size, read without verification (read_manifest then checks everything)."""
    try:
        return int(json.loads((Path(bundle) / "manifest.json").read_text())["parallel"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1  # let the verifying reader say what is wrong


def read_manifest(bundle: Path, toolchain: dict, rank: int | None = None) -> Manifest:
    """Read and verify a bundle: magic, schema version, manifest checksum, toolchain, every file
    (with `rank`, of the weight files only that rank's)."""
    bundle = Path(bundle)
    path = bundle / "manifest.json"
    if not path.is_file():
        raise BundleError(f"{path}: no manifest.json. Is {bundle} a bundle written by deepinfer-compile?")
    try:
        body = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{path}: not valid JSON ({err}); the bundle is corrupt. Recompile it with deepinfer-compile.") from None
    if not isinstance(body, dict) or body.get("magic") != MAGIC:
        raise BundleError(f"{path}: not a deepinfer bundle manifest (magic {body.get('magic') if isinstance(body, dict) else None!r}).")
    if body.get("schema_version") != SCHEMA_VERSION:
        raise BundleError(
            f"{path}: bundle schema version {body.get('schema_version')} is not the {SCHEMA_VERSION} this runtime reads. "
            "Recompile the recipe with this version of deepinfer-compile."
        )
    if body.get("checksum") != _checksum(body):
        raise BundleError(f"{path}: the manifest was edited after compilation (its checksum does not match). Recompile the bundle.")
    manifest = Manifest.from_dict(body)
    for key, wanted in manifest.toolchain.items():
        if key in toolchain and toolchain[key] != wanted:
            raise BundleError(
                f"{path}: bundle compiled with {key} {wanted}, but this runtime has {key} {toolchain[key]}. "
                f"Compiled artifacts are tied to the toolchain: recompile the recipe here, or run with {key} {wanted}."
            )
    skipped = set() if rank is None else set(manifest.weight_files) - {manifest.weight_files[rank]}
    for rel, digest in manifest.files.items():
        if rel in skipped:
            continue
        file = bundle / rel
        if not file.is_file():
            raise BundleError(f"{file}: missing from the bundle. Copy the whole bundle directory, or recompile.")
        if sha256_file(file) != digest:
            raise BundleError(f"{file}: checksum mismatch, the file is corrupt or was modified. Recompile the bundle or copy it again.")
    return manifest

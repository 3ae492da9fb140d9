"""The bundle format: `manifest.json` mirrored by dataclasses, written by the compiler, read here.

A bundle is a directory:
    manifest.json                 this schema
    regions/<fingerprint>.<ext>   one compiled artifact per unique region (no weights inside)
    weights/rank-<r>.safetensors  every graph input that is a weight or buffer, per rank
    tokenizer.json                when the model has one (else the byte-level tokenizer)
    chat_template.json            when the checkpoint has a chat template (deepinfer-serve's chat)

Compatibility rules (as ExecuTorch's schema): add fields at the end with a default; never remove
a field or change its meaning; any other change bumps SCHEMA_VERSION, and a runtime refuses a
bundle whose version it does not know.

Integrity: `files` holds the sha256 of every file but the manifest, `sizes` its byte size;
`checksum` is the sha256 of the manifest's own canonical JSON without that field. Any flipped byte
is caught at load: every file's size is checked before it is read (a grown file is never read
whole) and it is hashed as it is read for use (`files.BundleFiles`), so what was checked is what
runs.
"""

import dataclasses
import hashlib
import hmac
import json
import os
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from .errors import BundleError
from .files import MAX_FILE_BYTES, read_regular
from .step import program_key

MAGIC = "deepinfer-bundle"
SCHEMA_VERSION = 1
SIGNATURE_FILE = "manifest.json.hmac"  # HMAC-SHA256 of manifest.json under a deploy key (optional)
MAX_MANIFEST_BYTES = 64 << 20
MAX_KEY_BYTES = 4096
TENSOR_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "bool", "float8_e4m3fn", "uint8", "int8")


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
    state tensors (kv.<layer>.<name>; kv.<layer> in bundles without `state`), weights, or earlier
    outputs."""

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
    context: int | None = None  # the context bucket: its state inputs are views of the first `context` positions

    @property
    def key(self) -> str:
        return program_key(self.method, self.bucket, self.context)


@dataclass
class KVSpec:
    max_seqs: int
    max_len: int
    layers: int  # legacy single-tensor pools (kv.<layer>); 0 when `Manifest.state` lists the state
    shape: list[int]  # one tensor per layer: [max_seqs + 1, max_len, C]; the last slot is scratch
    dtype: str


@dataclass
class StateTensor:
    """One named tensor of a layer's state; programs call it `kv.<layer>.<name>`."""

    name: str
    shape: list[int]  # [max_seqs + 1, ...]: one row per sequence slot, the last one scratch
    dtype: str
    positions_per_entry: int | None = None  # axis 1 holds one entry per this many positions (a context view narrows it)


@dataclass
class WeightTensor:
    """One tensor of a rank's weight file (every rank's file holds the same names and shapes)."""

    name: str
    shape: list[int]
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
    programs: dict[str, Program]  # Program.key ("method/bucket" or "method/bucket/context") -> Program
    regions: dict[str, Region]  # fingerprint -> Region
    weight_files: list[str]  # per rank
    tokenizer: str | None  # relative path of tokenizer.json, or None for bytes
    vocab_size: int
    eos_token_id: int | None
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    magic: str = MAGIC
    schema_version: int = SCHEMA_VERSION
    state: list[list[StateTensor]] | None = None  # per layer; None in bundles that only have `kv`
    chat_template: str | None = None  # relative path of chat_template.json, when the checkpoint has a template
    contexts: dict = field(default_factory=dict)  # method -> sorted context buckets (ending at kv.max_len), when it has them
    speculative: int = 0  # draft tokens a decode step verifies (MTP speculative decoding; 0: off)
    prompt_logprobs: int = 0  # top tokens a score program returns per prompt position (0: no score programs)
    sizes: dict[str, int] = field(default_factory=dict)  # relative path -> bytes, for every file in `files`
    # What each rank's weight file holds, in order. A bundle compiled --no-weights has these and
    # not (yet) the files: `deepinfer-compile weights` adds them, listing each in files and sizes.
    weight_specs: list[WeightTensor] = field(default_factory=list)

    def state_tensors(self) -> dict[str, TensorSpec]:
        """Every state tensor the runtime allocates, by the name programs use."""
        if self.state is None:
            return {f"kv.{i}": TensorSpec(self.kv.shape, self.kv.dtype) for i in range(self.kv.layers)}
        return {f"kv.{i}.{t.name}": TensorSpec(t.shape, t.dtype) for i, layer in enumerate(self.state) for t in layer}

    def to_json(self) -> str:
        body = asdict(self)
        body["checksum"] = _checksum(body)
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, body: dict, where: str = "manifest.json") -> "Manifest":
        """Typed, field by field (a wrong type or a missing field is a BundleError naming it)."""
        body = {k: v for k, v in body.items() if k != "checksum"}
        return typed_value(body, cls, where)


def typed_value(value, annotation, where: str):
    """`value` (parsed JSON) as `annotation`: a dataclass, dict[str, T], list[T], T | None, or a
    plain type. Raises BundleError naming the field path."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise BundleError(f"{where}: must be an object, not {type(value).__name__}")
        fields = {f.name: f for f in dataclasses.fields(annotation)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise BundleError(f"{where}: unknown field(s) {unknown}")
        missing = [n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise BundleError(f"{where}: missing field(s) {missing}")
        hints = typing.get_type_hints(annotation)
        return annotation(**{k: typed_value(v, hints[k], f"{where}.{k}") for k, v in value.items()})
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return typed_value(value, inner, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise BundleError(f"{where}: must be an object, not {type(value).__name__}")
        return {k: typed_value(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise BundleError(f"{where}: must be a list, not {type(value).__name__}")
        return [typed_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    plain = origin or annotation
    if not isinstance(value, plain) or (plain is int and isinstance(value, bool)):
        raise BundleError(f"{where}: must be {plain.__name__}, not {type(value).__name__} ({str(value)[:40]!r})")
    return value


def check_manifest(m: Manifest, where: str):
    """What the types cannot say: sizes in range, paths inside the bundle and checksummed, every
    program step naming a region or a known collective."""
    def bad(message: str):
        raise BundleError(f"{where}: {message}. The manifest is not one deepinfer-compile writes; recompile the bundle.")

    world, tp = m.parallel.get("world_size"), m.parallel.get("tp")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= 4096 or len(m.weight_files) != world:
        bad(f"parallel.world_size {world!r} must be a positive integer equal to the number of weight_files ({len(m.weight_files)})")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world % tp:
        bad(f"parallel.tp {tp!r} must be a positive integer dividing world_size {world}")
    cp = m.parallel.get("cp", 1)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or (world // tp) % cp:
        bad(f"parallel.cp {cp!r} must be a positive integer dividing world_size / tp = {world // tp}")
    node = m.parallel.get("hierarchical_allreduce") or 0
    if not isinstance(node, int) or isinstance(node, bool) or node and (node < 2 or world % node):
        bad(f"parallel.hierarchical_allreduce {node!r} must be 0 or a group size dividing world_size {world}")
    kv = m.kv
    if not (0 < kv.max_seqs <= 1 << 16 and 0 < kv.max_len <= 1 << 24 and 0 <= kv.layers <= 4096
            and len(kv.shape) == 3 and kv.shape[:2] == [kv.max_seqs + 1, kv.max_len] and 0 <= kv.shape[2] <= 1 << 20
            and (kv.shape[2] > 0 or kv.layers == 0)):
        bad(f"kv {kv} is not a pool of [max_seqs + 1, max_len, width] tensors of sane size")
    if kv.dtype not in TENSOR_DTYPES:
        bad(f"kv.dtype {kv.dtype!r} is not one of {TENSOR_DTYPES}")
    if m.state is not None and kv.layers:
        bad("both kv.layers and state describe the state")
    if m.state is not None and len(m.state) > 4096:
        bad(f"state lists {len(m.state)} layers")
    for i, layer in enumerate(m.state or []):
        if len({t.name for t in layer}) != len(layer):
            bad(f"state of layer {i} repeats a name")
        for t in layer:
            if (not t.name.isidentifier() or t.dtype not in TENSOR_DTYPES or not 2 <= len(t.shape) <= 4
                    or t.shape[0] != kv.max_seqs + 1 or not all(0 < d <= 1 << 24 for d in t.shape)):
                bad(f"state tensor {t} of layer {i} is not [max_seqs + 1, ...] of a known dtype and sane size")
    if not 0 < m.vocab_size <= 1 << 22 or (m.eos_token_id is not None and not 0 <= m.eos_token_id < m.vocab_size):
        bad(f"vocab_size {m.vocab_size} / eos_token_id {m.eos_token_id} out of range")
    k = m.speculative
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 16:
        bad(f"speculative {k!r} must be a small count of draft tokens (0: off)")
    top = m.prompt_logprobs
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 64:
        bad(f"prompt_logprobs {top!r} must be a small count of top tokens (0: no score programs)")
    methods = ("prefill", "decode") + ("draft",) * bool(k) + ("score",) * bool(top)
    if set(m.buckets) != set(methods):
        bad(f"buckets name {sorted(m.buckets)}, not the methods {list(methods)}")
    for method in methods:
        buckets = m.buckets.get(method)
        if not isinstance(buckets, list) or not buckets or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets):
            bad(f"buckets.{method} {buckets!r} must be a list of positive integers")
        chunks = method in ("prefill", "score")  # one sequence's prompt chunk
        rows = kv.max_len if chunks else kv.max_seqs * (k + 1)
        if max(buckets) > rows or not chunks and any(b % (k + 1) for b in buckets):
            bad(f"buckets.{method} {buckets} does not fit the KV pool")
        if method == "draft" and buckets != m.buckets["decode"]:
            bad(f"buckets.draft {buckets} are not the decode buckets {m.buckets['decode']}")
        if method == "score" and buckets != m.buckets["prefill"]:
            bad(f"buckets.score {buckets} are not the prefill buckets {m.buckets['prefill']}")
        contexts = m.contexts.get(method, [None])
        if method in m.contexts and (not isinstance(contexts, list) or not contexts or contexts[-1] != kv.max_len
                                   or not all(isinstance(c, int) and not isinstance(c, bool) and 0 < c for c in contexts)
                                   or sorted(set(contexts)) != contexts):
            bad(f"contexts.{method} {contexts!r} must be increasing positive integers ending at kv.max_len={kv.max_len}")
        for bucket in buckets:
            for context in contexts:
                if program_key(method, bucket, context) not in m.programs:
                    bad(f"no program for {program_key(method, bucket, context)}")
    if set(m.contexts) - set(methods):
        bad(f"contexts {sorted(m.contexts)} names a method other than {list(methods)}")
    for t in [t for layer in m.state or [] for t in layer if t.positions_per_entry is not None]:
        ratio = t.positions_per_entry
        if (not isinstance(ratio, int) or ratio < 1 or t.shape[1] * ratio != kv.max_len
                or any(c % ratio for cs in m.contexts.values() for c in cs)):
            bad(f"state tensor {t.name} holds {t.shape[1]} entries of {ratio} positions, which does not fit "
                f"kv.max_len={kv.max_len} and the context buckets {m.contexts}")
    for region in m.regions.values():
        for spec in region.inputs + region.outputs:
            if spec.dtype not in TENSOR_DTYPES or not all(0 <= d <= 1 << 40 for d in spec.shape):
                bad(f"region {region.file} has a bad tensor spec {spec}")
    for key, program in m.programs.items():
        if key != program.key:
            bad(f"program {key} is filed under the wrong key (it is {program.key})")
        for step in program.steps:
            if step.collective is None and step.region not in m.regions:
                bad(f"program {key} calls region {step.region!r}, which the manifest does not list")
            if step.collective is not None and (step.collective.get("op") not in ("all_reduce", "all_gather")
                                                or step.collective.get("group") not in ("world", "tp", "cp") or world == 1
                                                or step.collective.get("hierarchical") and not node):
                bad(f"program {key} runs a collective {step.collective!r} this {world}-rank bundle cannot have")
    referenced = [r.file for r in m.regions.values()] + m.weight_files + [f for f in (m.tokenizer, m.chat_template) if f]
    for rel in list(m.files) + referenced:
        if not _inside(rel):
            bad(f"file {rel!r} is not a plain relative path inside the bundle")
    for rel in referenced:
        if rel not in m.files and not (rel in m.weight_files and m.weight_specs):  # (weights yet to be added)
            bad(f"{rel} is used but has no sha256 in files")
    if any(s.dtype not in TENSOR_DTYPES or not all(isinstance(n, int) and 0 <= n < 1 << 40 for n in s.shape)
           for s in m.weight_specs):
        bad(f"weight_specs must give each tensor's shape and one of the dtypes {TENSOR_DTYPES}")
    if set(m.sizes) != set(m.files) or not all(0 <= n <= MAX_FILE_BYTES for n in m.sizes.values()):
        bad("sizes must give the byte size (up to 1 TiB) of every file in files, and only those (a bundle from a "
            "deepinfer-compile before sizes were recorded: recompile it)")


def _inside(rel: str) -> bool:
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and "\\" not in rel and str(path) == rel


def _checksum(body: dict) -> str:
    body = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """(For the compiler's own files: bundle files are hashed as they are read, by BundleFiles.)"""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def peek_world_size(bundle: Path) -> int:
    """The bundle's world size, read without verification (read_manifest then checks everything)."""
    try:
        world_size = json.loads(read_regular(Path(bundle) / "manifest.json", MAX_MANIFEST_BYTES))["parallel"]["world_size"]
    except (BundleError, ValueError, KeyError, TypeError, RecursionError):
        return 1  # let the verifying reader say what is wrong
    return world_size if isinstance(world_size, int) and 1 < world_size <= 4096 else 1


def read_key(path: str | Path) -> bytes:
    """A deploy key for signing (`--sign-key`) or verifying (`--verify-key`): the file's bytes,
    surrounding whitespace stripped; at least 16 bytes (e.g. `openssl rand -hex 32 > deploy.key`).
    A symlink to the key is fine (Kubernetes mounts secrets so); a FIFO or a device is not."""
    key = read_regular(Path(path), MAX_KEY_BYTES, follow_symlinks=True,
                       advice=f"A deploy key is a small regular file; make one with `openssl rand -hex 32 > {path}`.").strip()
    if len(key) < 16:
        raise BundleError(f"{path}: a deploy key needs at least 16 bytes; make one with `openssl rand -hex 32 > {path}`.")
    return key


def sign(bundle: Path, key: bytes):
    """Write the bundle's signature: HMAC-SHA256 of manifest.json, which lists every file's sha256."""
    manifest = (Path(bundle) / "manifest.json").read_bytes()
    (Path(bundle) / SIGNATURE_FILE).write_text(hmac.new(key, manifest, hashlib.sha256).hexdigest() + "\n")


def _verify_signature(bundle: Path, manifest: bytes, key: bytes):
    path = bundle / SIGNATURE_FILE
    if not os.path.lexists(path):
        raise BundleError(f"{path}: the bundle is not signed, and --verify-key asks for a signed bundle. Compile it with "
                          "`deepinfer-compile RECIPE --sign-key KEYFILE`.")
    signature = read_regular(path, 256).strip()  # 64 hex digits and a newline
    if not hmac.compare_digest(signature, hmac.new(key, manifest, hashlib.sha256).hexdigest().encode()):
        raise BundleError(f"{path}: the signature does not match this manifest under the given key: the bundle was "
                          "changed after it was signed, or signed with another key. Do not run it; recompile and sign it.")


def not_a_bundle(bundle: Path) -> str:
    """What to say of a directory without a manifest: the command that makes a bundle there."""
    return (f"{Path(bundle) / 'manifest.json'}: no bundle here (no manifest.json). deepinfer-compile makes one from a "
            f"recipe: `deepinfer-compile recipes/tiny.yaml --out {bundle}` (or your own recipe).")


def weights_missing(bundle: Path, manifest: Manifest, rank: int) -> str:
    """What to say of a rank whose weight file the bundle does not have yet (compiled --no-weights)."""
    world = len(manifest.weight_files)
    hosts = f", or `--ranks {rank}-{rank}` on the host that runs rank {rank} of {world}" if world > 1 else ""
    return (f"{Path(bundle) / manifest.weight_files[rank]}: rank {rank}'s weights are not in this bundle yet: it was compiled "
            f"with --no-weights (programs and regions, no weights). Add them from the checkpoint: `deepinfer-compile weights "
            f"{bundle} --checkpoint DIR`{' (every rank)' if world > 1 else ''}{hosts}.")


def read_manifest(bundle: Path, toolchain: dict, rank: int | None = None, verify_key: bytes | None = None,
                  weights: bool = True) -> Manifest:
    """Read and verify a bundle: signature (with `verify_key`), magic, schema version, manifest
    checksum, types and ranges, paths, toolchain, every file (with `rank`, of the weight files
    only that rank's). `weights=False` accepts weight files the bundle does not have yet (the
    weights step reads a bundle to add them)."""
    bundle = Path(bundle)
    path = bundle / "manifest.json"
    if not os.path.lexists(path):
        raise BundleError(not_a_bundle(bundle))
    raw = read_regular(path, MAX_MANIFEST_BYTES)
    if verify_key is not None:
        _verify_signature(bundle, raw, verify_key)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
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
    manifest = Manifest.from_dict(body, str(path))
    check_manifest(manifest, str(path))
    missing = sorted(set(toolchain) - set(manifest.toolchain))
    if missing:
        raise BundleError(f"{path}: toolchain does not say which {', '.join(missing)} the bundle was compiled with; "
                          "a bundle runs only on the toolchain it was compiled with. Recompile it.")
    for key, wanted in manifest.toolchain.items():
        if key in toolchain and toolchain[key] != wanted:
            raise BundleError(
                f"{path}: bundle compiled with {key} {wanted}, but this runtime has {key} {toolchain[key]}. "
                f"Compiled artifacts are tied to the toolchain: recompile the recipe here, or run with {key} {wanted}."
            )
    for r in range(len(manifest.weight_files)) if rank is None else [rank]:
        if weights and manifest.weight_files[r] not in manifest.files:
            raise BundleError(weights_missing(bundle, manifest, r))
    skipped = set() if rank is None else set(manifest.weight_files) - {manifest.weight_files[rank]}
    root = bundle.resolve()
    for rel in manifest.files:  # present and inside; each is hashed as it is read (BundleFiles)
        file = bundle / rel
        if rel in skipped:
            continue
        if not file.resolve().is_relative_to(root):
            raise BundleError(f"{file}: leads outside the bundle (a symlinked directory?); a bundle holds its own files.")
        if file.is_symlink() or not file.is_file():
            raise BundleError(f"{file}: missing from the bundle (or not a plain file). Copy the whole bundle directory, or recompile.")
    return manifest

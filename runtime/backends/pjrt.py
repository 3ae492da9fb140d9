"""PJRT executables (`.pjrt`): a region's StableHLO compiled ahead of time by a PJRT plugin --
jaxlib's XLA CPU client here, Neuron's libneuronxla on Trainium, jax's CUDA plugin on NVIDIA
GPUs: one runtime, another plugin (the `xla` extra: jax and jaxlib).

The file is safetensors: tensor `executable`, the serialized executable -- MACHINE CODE for its
platform, run as it is: a pjrt region is code, and only a bundle you built or whose signature you
verify (--verify-key) is safe to load; tensor `stablehlo`, the portable program text any PJRT
platform can compile again; metadata (strings) `platform`, `platform_version` (the plugin's, and
the jaxlib that serialized it), `mutated_inputs` (JSON: the input index of each leading output,
the state a region updates). An executable for another platform, plugin or jaxlib is refused, or
with DEEPINFER_PJRT_RECOMPILE=1 compiled here from the StableHLO. Before a region is accepted, the
program's own signature (parameters, results and which state buffers they alias, read from its
HLO) must be the manifest's region specs: a region file of another region, or one whose
executable and StableHLO disagree, is refused at load, not at its first step.

On the CPU, tensors cross between torch and PJRT by DLPack, without copies where XLA can use the
memory as it is (contiguous, 64-byte aligned: activations, step inputs, the state pool). A tensor
it cannot (most weights: views into the verified weight file at 4-byte offsets) is copied once
and the copy kept while the tensor is unchanged, as an accelerator keeps weights in device
memory. A device platform (Neuron has no DLPack) takes every tensor by a host-to-device copy,
likewise kept while unchanged (weights cross once), and gives outputs back by a copy.

State stays in PJRT buffers. XLA programs are functional: a region that updates state returns
the new state, its input marked as the same buffer (`tf.aliasing_output`), so XLA writes the
update in place into a buffer it owns and the call donates. After its first update a state
tensor (a KV layer of the pool) lives in a PJRT buffer, shared by every region of the process
and handed from call to call; the torch pool tensor is then only its initial value. Nothing in
torch may hold a view of that buffer: an outside reference makes XLA copy instead of donate.
The one exception: a program for a context bucket binds a narrowed view of the pool (not a
buffer of its own), so such a view takes the copy path (its pool tensor's buffer first written
back to torch) -- context buckets on this backend copy their state each call."""

import json
import re
import weakref
from importlib.metadata import version

import jax
import ml_dtypes
import numpy as np
import torch
from jax._src.lib import xla_client

from .. import knobs
from ..errors import BundleError
from ..manifest import TENSOR_DTYPES
from ..weights import header_of, tensors_of

NATIVE_CODE = True


def pjrt_client(platform: str, where: str = "this region"):
    """The PJRT client of `platform` (cpu, neuron, cuda): jax finds installed plugins
    (libneuronxla registers itself as one). `where`: the file that needs it, for the error."""
    jax.config.update("jax_enable_x64", True)  # our regions take int64 positions and ids
    try:
        return jax.devices(platform)[0].client
    except RuntimeError as err:
        raise BundleError(f"{where}: no PJRT plugin for platform {platform!r} on this host ({str(err).splitlines()[0]}); "
                          "install it (Trainium: libneuronxla from AWS's Neuron repository), or recompile the "
                          "bundle for a platform this host has.") from None


def compile_stablehlo(client, text: str):
    return client.compile_and_load(text, client.devices()[:1], xla_client.CompileOptions())


def plugin_version(client) -> str:
    """What an executable is tied to: the plugin's version and the jaxlib that serializes it (the
    CPU client's platform_version is just "cpu", whatever the jaxlib)."""
    return f"{client.platform_version} (jaxlib {version('jaxlib')})"


def host_problem(toolchain: dict) -> str | None:
    """The jaxlib the bundle was compiled with, where it is not this host's (its executables'
    format and its StableHLO's dialect are tied to it), unless DEEPINFER_PJRT_RECOMPILE=1."""
    wanted, here = toolchain.get("jaxlib"), version("jaxlib")
    if wanted == here or knobs.pjrt_recompile():
        return None
    return (f"the bundle's pjrt regions were compiled with jaxlib {wanted} (toolchain.jaxlib), and this host has jaxlib "
            f"{here}. Install jaxlib=={wanted}, set DEEPINFER_PJRT_RECOMPILE=1 to compile the regions' StableHLO here "
            "at load, or recompile the bundle on this host.")


def load(data: bytes, region, where: str):
    platform, compiled_for, mutated, executable, stablehlo = _read_region_file(data, region, where)
    client = pjrt_client(platform, where)
    here = plugin_version(client)
    if here != compiled_for and not knobs.pjrt_recompile():
        raise BundleError(f"{where}: compiled for PJRT platform {platform!r} version {compiled_for!r}, but this host's "
                          f"plugin is {here!r}. Set DEEPINFER_PJRT_RECOMPILE=1 to compile the bundle's StableHLO "
                          "here at load, or recompile the bundle on a host like this one.")
    try:
        if here != compiled_for:
            program = compile_stablehlo(client, stablehlo.decode())
        else:
            program = client.deserialize_executable(executable, client.devices()[:1], xla_client.CompileOptions())
    except Exception as err:  # XLA's parsers say what they could not read; nothing of the file ran
        what = "StableHLO does not compile" if here != compiled_for else "executable cannot be deserialized"
        raise BundleError(f"{where}: its {what} ({type(err).__name__}: {_first_line(err)}): the file is corrupt or "
                          "not a region for this plugin. Recompile the bundle.") from None
    _check_signature(program, region, mutated, where)
    n_mutated = len(mutated)
    by_dlpack = platform in DLPACK_PLATFORMS
    to_torch = torch.from_dlpack if by_dlpack else _from_host
    to_pjrt = _Arguments(None if by_dlpack else client.devices()[0], to_torch)

    def call(*args):
        outputs = program.execute([to_pjrt(a) for a in args])  # (donates the resident state it updates)
        for index, new in zip(mutated, outputs):
            to_pjrt.updated(args[index], new)
        return tuple(to_torch(out) for out in outputs[n_mutated:])

    return call


DLPACK_PLATFORMS = ("cpu",)  # where torch's CPU tensors and PJRT arrays can share memory


def _read_region_file(data: bytes, region, where: str):
    """(platform, platform_version, mutated_inputs, executable bytes, StableHLO bytes) of a region
    file, every field of the type the compiler writes (else a BundleError)."""
    def refuse(what: str):
        raise BundleError(f"{where}: not a PJRT region file ({what}). Recompile the bundle.")

    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    meta = header_of(buffer, where)[0].get("__metadata__")
    parts = tensors_of(buffer, where)
    keys = ("platform", "platform_version", "mutated_inputs")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in keys):
        refuse(f"its metadata must give the strings {list(keys)}, not {str(meta)[:80]}")
    for name in ("executable", "stablehlo"):
        if name not in parts or parts[name].dtype != torch.uint8 or parts[name].dim() != 1:
            refuse(f"no byte tensor {name!r}")
    platform = meta["platform"]
    if not platform.isidentifier():
        refuse(f"platform {platform[:40]!r} is not a PJRT platform name (cpu, cuda, neuron)")
    try:
        mutated = json.loads(meta["mutated_inputs"])
    except (ValueError, RecursionError):
        mutated = meta["mutated_inputs"][:40]
    if (not isinstance(mutated, list) or not all(type(i) is int and 0 <= i < len(region.inputs) for i in mutated)
            or len(set(mutated)) != len(mutated)):
        raise BundleError(f"{where}: mutated_inputs {mutated!r} does not fit the region's inputs. Recompile the bundle.")
    return platform, meta["platform_version"], mutated, parts["executable"].numpy().tobytes(), parts["stablehlo"].numpy().tobytes()


def _check_signature(program, region, mutated: list[int], where: str):
    """The compiled program takes the manifest's inputs and returns the updated state (aliasing the
    inputs `mutated` names, in order) then the manifest's outputs, each of the spec's shape and
    dtype: read from its HLO module, before anything runs."""
    try:
        (module,) = program.hlo_modules()
        shape = xla_client.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    except Exception as err:  # (a plugin that cannot say, an executable of several modules)
        raise BundleError(f"{where}: the executable's signature cannot be read ({type(err).__name__}: {_first_line(err)}), "
                          "so it cannot be checked against the manifest before it runs. Recompile the bundle with this "
                          "plugin.") from None
    results = shape.result_shape()
    got_in = [_spec(s) for s in shape.parameter_shapes()]
    got_out = [_spec(s) for s in (results.tuple_shapes() if results.is_tuple() else [results])]
    wanted_in = [(list(s.shape), s.dtype) for s in region.inputs]
    wanted_out = [wanted_in[i] for i in mutated] + [(list(s.shape), s.dtype) for s in region.outputs]
    checks = (("input", got_in, wanted_in), ("output", got_out, wanted_out),
              ("state update (output: the input it updates in place)", list(_aliases(module).items()), list(enumerate(mutated))))
    for what, got, wanted in checks:
        if got != wanted:
            raise BundleError(f"{where}: the compiled program's {_difference(what, got, wanted)} (a region file of another "
                              "region, or a mangled one). Running it would fail or misread memory; recompile the bundle.")


def _difference(what: str, got: list, wanted: list) -> str:
    """Where two lists first differ, in words."""
    if len(got) != len(wanted):
        return f"{what}s number {len(got)}, but the manifest's region has {len(wanted)}"
    i = next(i for i, (g, w) in enumerate(zip(got, wanted)) if g != w)
    return f"{what} {i} is {got[i]}, but the manifest's region says {wanted[i]}"


def _aliases(module) -> dict[int, int]:
    """output index -> the parameter it updates in place, from the module's header line:
    `HloModule m, input_output_alias={ {0}: (3, {}, may-alias), ... }, entry_computation_layout=...`."""
    header = module.to_string().split("\n", 1)[0]
    table = header.partition("input_output_alias=")[2].partition("entry_computation_layout")[0]
    return {int(output): int(parameter) for output, parameter in re.findall(r"\{(\d+)\}: \((\d+), \{\}", table)}


def _spec(shape) -> tuple[list[int], str]:
    if shape.is_tuple():
        return [], "tuple"
    return list(shape.dimensions()), _DTYPE_NAMES.get(shape.element_type(), str(shape.element_type()))


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else "no message"


class _Arguments:
    """torch tensor -> PJRT array: a state tensor's resident buffer once it has one; on the CPU in
    place where XLA can use the memory; else a copy (to `device`, when given), kept while the
    tensor lives and has not changed (its version), and dropped with it: a step's inputs come and
    go, weights stay."""

    ALIGNMENT = 64  # XLA's CPU client takes memory in place only at this alignment

    def __init__(self, device, to_torch):
        self.device, self.to_torch = device, to_torch
        self.copies: dict[int, tuple] = {}  # id(tensor) -> (version, array), while the tensor lives

    def __call__(self, tensor: torch.Tensor):
        resident = _RESIDENT.get(id(tensor))
        if resident is not None:
            return resident
        if tensor._base is not None and id(tensor._base) in _RESIDENT:  # a context bucket's view of the pool
            tensor._base.copy_(self.to_torch(_RESIDENT.pop(id(tensor._base))))
        if self.device is None and tensor.is_contiguous() and tensor.data_ptr() % self.ALIGNMENT == 0:
            return jax.dlpack.from_dlpack(tensor)
        kept = self.copies.get(id(tensor))
        if kept is not None and kept[0] == tensor._version:
            return kept[1]
        if self.device is None:
            array = jax.dlpack.from_dlpack(tensor.clone(memory_format=torch.contiguous_format))  # (a fresh, aligned block)
        else:
            array = jax.device_put(_to_host(tensor), self.device)
        if kept is None:
            weakref.finalize(tensor, self.copies.pop, id(tensor), None)
        self.copies[id(tensor)] = (tensor._version, array)
        return array

    def updated(self, tensor: torch.Tensor, array):
        """A region's new value of state `tensor`: a whole pool tensor's becomes its resident
        buffer (the next call donates it); a view's is copied into the pool."""
        if tensor._base is not None:
            tensor.copy_(self.to_torch(array))
            return
        if id(tensor) not in _RESIDENT:
            weakref.finalize(tensor, _RESIDENT.pop, id(tensor), None)
        _RESIDENT[id(tensor)] = array


def release_state(tensor: torch.Tensor):
    """The runtime is about to change state `tensor` outside a region (a prefix copy): its resident
    buffer's value goes back into the torch tensor, which the next region call takes again (a
    device platform pays a round trip of the tensor)."""
    resident = _RESIDENT.pop(id(tensor), None)
    if resident is not None:
        tensor.copy_(_from_host(resident))


# id(pool tensor) -> the PJRT buffer holding its current value (every region of the process reads
# and updates the same state); dropped with the tensor.
_RESIDENT: dict[int, object] = {}


# torch dtypes numpy lacks, carried as same-width integers: dtype -> (torch carrier, numpy carrier, ml_dtypes')
_CARRIED = {torch.bfloat16: (torch.uint16, np.uint16, ml_dtypes.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, np.uint8, ml_dtypes.float8_e4m3fn)}
_TORCH_OF = {np.dtype(ml_dtype): (np_carrier, dtype) for dtype, (_, np_carrier, ml_dtype) in _CARRIED.items()}


def _to_host(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.contiguous()
    if tensor.dtype in _CARRIED:
        carrier, _, ml_dtype = _CARRIED[tensor.dtype]
        return tensor.view(carrier).numpy().view(ml_dtype)
    return tensor.numpy()


def _from_host(array) -> torch.Tensor:
    host = np.array(array)  # (the device-to-host copy; writable, as torch wants)
    if host.dtype in _TORCH_OF:
        np_carrier, dtype = _TORCH_OF[host.dtype]
        return torch.from_numpy(host.view(np_carrier)).view(dtype)
    return torch.from_numpy(host)


# numpy dtype (as XLA reports an element type) -> the manifest's dtype name
_DTYPE_NAMES = {_to_host(torch.empty(0, dtype=getattr(torch, name))).dtype: name for name in TENSOR_DTYPES}

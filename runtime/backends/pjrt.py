"""PJRT executables (`.pjrt`): a region's StableHLO compiled ahead of time by a PJRT plugin --
jaxlib's XLA CPU client here, Neuron's libneuronxla on Trainium, jax's CUDA plugin on NVIDIA
GPUs: one runtime, another plugin (the `xla` extra: jax and jaxlib).

The file is safetensors (data: nothing in it is unpickled): tensor `executable`, the serialized
executable (machine code for its platform: a native region); tensor `stablehlo`, the portable
program text any PJRT platform can compile again; metadata `platform`, `platform_version` (the
plugin's), `mutated_inputs` (JSON: the input index of each leading output, the state a region
updates). An executable for another platform or plugin version is refused, or with
DEEPINFER_PJRT_RECOMPILE=1 compiled here from the StableHLO.

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
import weakref

import jax
import ml_dtypes
import numpy as np
import torch
from jax._src.lib import xla_client

from .. import knobs
from ..errors import BundleError
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


def load(data: bytes, region, where: str):
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    meta = header_of(buffer, where)[0].get("__metadata__") or {}
    parts = tensors_of(buffer, where)
    try:
        platform, version, mutated = meta["platform"], meta["platform_version"], json.loads(meta["mutated_inputs"])
        executable, stablehlo = parts["executable"].numpy().tobytes(), parts["stablehlo"].numpy().tobytes().decode()
    except (KeyError, ValueError, UnicodeDecodeError):
        raise BundleError(f"{where}: not a PJRT region file (metadata {sorted(meta)}). Recompile the bundle.") from None
    if not (isinstance(mutated, list) and all(type(i) is int and 0 <= i < len(region.inputs) for i in mutated)):
        raise BundleError(f"{where}: mutated_inputs {mutated!r} does not fit the region's inputs. Recompile the bundle.")
    client = pjrt_client(platform, where)
    if client.platform_version != version:
        if not knobs.pjrt_recompile():
            raise BundleError(f"{where}: compiled for PJRT platform {platform!r} version {version!r}, but this host's "
                              f"plugin is {client.platform_version!r}. Set DEEPINFER_PJRT_RECOMPILE=1 to compile the "
                              "bundle's StableHLO here at load, or recompile the bundle on a host like this one.")
        program = compile_stablehlo(client, stablehlo)
    else:
        program = client.deserialize_executable(executable, client.devices()[:1], xla_client.CompileOptions())
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

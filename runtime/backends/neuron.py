"""NEFFs traced by torch-neuronx (TorchScript wrappers, native code); needs the Neuron runtime on the host."""

import torch

from ..errors import BundleError
from . import private_copy

NATIVE_CODE = True


def load(data: bytes, region, where: str):
    try:
        import torch_neuronx  # noqa: F401  (registers the Neuron ops TorchScript needs)
    except ImportError:
        raise BundleError(f"{where}: a Neuron region needs torch-neuronx and the Neuron runtime, which this host "
                          "lacks; run the bundle on a Trainium or Inferentia host.") from None

    with private_copy(data, ".pt") as path:
        module = torch.jit.load(str(path))

    def call(*args):
        out = module(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return call

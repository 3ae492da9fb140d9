"""NEFFs traced by torch-neuronx (TorchScript wrappers); needs the Neuron runtime on the host."""

import torch


def load(path):
    import torch_neuronx  # noqa: F401  (registers the Neuron ops TorchScript needs)

    module = torch.jit.load(str(path))

    def call(*args):
        out = module(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return call

"""Neuron regions: `.pjrt` files compiled by Neuron's PJRT plugin (libneuronxla) -- loaded exactly
as the pjrt backend's (runtime/backends/pjrt.py): the executable for this host's plugin, tensors
by host-to-device copies (Neuron has no DLPack), weights crossing once. A host without the
plugin refuses the bundle, naming it."""

from .pjrt import NATIVE_CODE, load, release_state  # noqa: F401  (the loader contract)

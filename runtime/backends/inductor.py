"""AOTInductor packages (`.pt2`): compiled C++/CUDA kernels, weights passed in as inputs."""

import torch._inductor


def load(path):
    runner = torch._inductor.aoti_load_package(str(path))

    def call(*args):
        return tuple(runner(*args))

    return call

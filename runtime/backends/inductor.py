"""AOTInductor packages (`.pt2`): compiled C++ kernels (native code), weights passed in as inputs."""

import torch._inductor

from . import private_copy

NATIVE_CODE = True


def load(data: bytes, region, where: str):
    with private_copy(data, ".pt2") as path:
        runner = torch._inductor.aoti_load_package(str(path))
    # The package's __call__ re-parses its pytree specs from JSON on every call; regions take and
    # return flat tensor lists, so the loader's boxed_run is called directly (it consumes its list).
    run = runner.loader.boxed_run

    def call(*args):
        return run(list(args))

    return call

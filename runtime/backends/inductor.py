"""AOTInductor packages (`.pt2`): compiled C++ kernels, weights passed in as inputs."""

import torch._inductor


def load(path):
    runner = torch._inductor.aoti_load_package(str(path))
    # The package's __call__ re-parses its pytree specs from JSON on every call; regions take and
    # return flat tensor lists, so the loader's boxed_run is called directly (it consumes its list).
    run = runner.loader.boxed_run

    def call(*args):
        return run(list(args))

    return call

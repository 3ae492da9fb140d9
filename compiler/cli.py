"""deepinfer-compile: recipe -> bundle.

    deepinfer-compile recipes/tiny.yaml                      # -> artifacts/tiny
    deepinfer-compile recipes/tiny.yaml --backend export --out /tmp/tiny --jobs 4 --timeout 600

Prints a progress bar over the regions and a summary line; exits 2 on a bad recipe, 1 when a
region fails to compile (with a per-region report, and no bundle written).
"""

import sys

import click

from deepinfer.runtime.errors import DeepinferError


class DefaultGroup(click.Group):
    """`deepinfer-compile RECIPE` runs `build`; `deepinfer-compile bisect ...` runs a subcommand."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["build", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup)
def main():
    """Compile a recipe into a bundle (`deepinfer-compile RECIPE`), or bisect a compiler crash."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="bundle directory (default: the recipe's output)")
@click.option("--backend", help="override backend.name: export | inductor | neuron")
@click.option("--jobs", default=2, show_default=True, help="regions compiled in parallel")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="compile cache (default: DEEPINFER_CACHE_DIR or ~/.cache/deepinfer)")
@click.option("--timeout", default=900.0, show_default=True, help="seconds one region may compile before it is killed")
def build(recipe, out, backend, jobs, cache_dir, timeout):
    """Compile RECIPE into a bundle."""
    from .build import compile_recipe
    from .recipe import load_recipe

    try:
        summary = compile_recipe(load_recipe(recipe, backend=backend, output=out), jobs=jobs, cache_dir=cache_dir, timeout=timeout)
    except DeepinferError as err:
        click.echo(f"deepinfer-compile: {err}", err=True)
        sys.exit(err.exit_code)
    click.echo(f"compiled {summary}")


if __name__ == "__main__":
    main()

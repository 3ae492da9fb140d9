"""deepinfer-compile: recipe -> bundle.

    deepinfer-compile recipes/tiny.yaml                      # -> artifacts/tiny
    deepinfer-compile recipes/tiny.yaml --backend export --out /tmp/tiny --jobs 4 --timeout 600
    deepinfer-compile plan recipes/full-size/deepseek-v3-671b.yaml     # what it needs per rank; compiles nothing
    deepinfer-compile recipes/full-size/deepseek-v3-671b.yaml --no-weights   # from config.json alone
    deepinfer-compile weights artifacts/deepseek-v3-671b --checkpoint DIR --ranks 0-7   # then the weights

Prints a progress bar over the regions and a summary line; exits 2 on a bad recipe, 1 when a
region fails to compile (with a per-region report, and no bundle written).
"""

import contextlib
import os
import sys

import click

from deepinfer.runtime.errors import DeepinferError


HELP = {"help_option_names": ["-h", "--help"]}


def exit_now(code: int):
    """Exit without the interpreter's teardown, once everything worth keeping is on disk (workers
    killed, finished regions cached atomically): with torch and inductor loaded, the teardown
    alone took 1 s of CPU after Ctrl-C, 6.6 s at a load of 12 on 2 cores."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def reported(command: str, interrupted: str):
    """An error as its one paragraph and exit code; Ctrl-C as `interrupted` (what is kept) and exit 130."""
    try:
        yield
    except DeepinferError as err:
        click.echo(f"{command}: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo(f"{command}: {interrupted}", err=True)
        exit_now(130)


class DefaultGroup(click.Group):
    """`deepinfer-compile RECIPE` runs `build`; `deepinfer-compile bisect ...` runs a subcommand."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["build", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # before a command's own handler (importing torch): click would say "Aborted!", exit 1
            click.echo(f"{ctx.info_name}: interrupted while starting; nothing was written.", err=True)
            sys.exit(130)

    def format_help(self, ctx, formatter):
        """How to compile (build's own help, under this command's name), then the subcommands."""
        build = self.commands["build"]
        build.format_help(click.Context(build, info_name=ctx.info_name, **HELP), formatter)
        self.format_commands(ctx, formatter)


@click.group(cls=DefaultGroup, context_settings=HELP)
@click.version_option(package_name="deepinfer", prog_name="deepinfer-compile")
def main():
    """Compile a recipe into a bundle (`deepinfer-compile RECIPE`), or bisect a compiler crash."""


@main.command(context_settings=HELP)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="bundle directory (default: the recipe's output)")
@click.option("--backend", help="override backend.name: export | inductor | pjrt | neuron")
@click.option("--jobs", default=2, show_default=True, type=click.IntRange(1, 256), help="regions compiled in parallel")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="compile cache (default: DEEPINFER_CACHE_DIR or ~/.cache/deepinfer)")
@click.option("--timeout", default=900.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="seconds one region may compile before it is killed")
@click.option("--sign-key", type=click.Path(dir_okay=False),
              help="deploy key file: sign the bundle (HMAC-SHA256 of its manifest) for deepinfer-run --verify-key")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="where region compiles run: this machine, or Ray tasks (pip install 'deepinfer[ray]')")
@click.option("--ray-address", help="a running Ray cluster (HOST:PORT or auto); default: start one on this machine")
@click.option("--no-weights", is_flag=True,
              help="compile from the checkpoint's config.json alone; `deepinfer-compile weights` adds the weights later")
def build(recipe, out, backend, jobs, cache_dir, timeout, sign_key, executor, ray_address, no_weights):
    """Compile RECIPE (YAML) into a bundle: trace, split, compile each unique region once, write
    the bundle. Exits 2 on a bad recipe, 1 when a region fails (with a report per region), 130 on
    Ctrl-C (regions that finished stay cached; rerun to continue)."""
    from .build import compile_recipe
    from .pool import Executor
    from .recipe import load_recipe

    from deepinfer.runtime.manifest import read_key

    with reported("deepinfer-compile", "interrupted; every worker was stopped, regions that finished are cached (run "
                  "the same command again to continue), and no bundle was written."):
        key = read_key(sign_key) if sign_key else None
        summary = compile_recipe(load_recipe(recipe, backend=backend, output=out), jobs=jobs, cache_dir=cache_dir,
                                 timeout=timeout, sign_key=key, executor=Executor(executor, ray_address),
                                 weights=not no_weights)
    click.echo(f"compiled {summary}")
    click.echo(summary.where_the_time_went())
    if no_weights:
        click.echo(f"no weights yet: add them with `deepinfer-compile weights {summary.bundle} --checkpoint DIR`")


@main.command("weights", context_settings=HELP)
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="the HF checkpoint directory (config.json + *.safetensors) the bundle was compiled for")
@click.option("--ranks", help="only these ranks' files, e.g. 0-7 (each host writes its own); default: every rank")
@click.option("--sign-key", type=click.Path(dir_okay=False), help="deploy key file: sign the completed manifest again")
def weights_command(bundle, checkpoint, ranks, sign_key):
    """Stream a checkpoint's weights into BUNDLE's per-rank files (a bundle compiled --no-weights),
    one tensor at a time. Resumable: files already whole are kept. Exits 2 when the checkpoint is
    not the bundle's model (nothing is written then), 130 on Ctrl-C."""
    from deepinfer.runtime.manifest import read_key

    from .add_weights import add_weights, parse_ranks

    with reported("deepinfer-compile weights", "interrupted; files already whole are recorded in the manifest, and the "
                  "same command writes the rest."):
        key = read_key(sign_key) if sign_key else None
        written = add_weights(bundle, checkpoint, parse_ranks(ranks) if ranks else None, key)
    click.echo(f"wrote the weights of {len(written)} rank(s) into {bundle}" if written else f"{bundle}: its weights were already whole")


@main.command("plan", context_settings=HELP)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout instead of tables")
def plan_command(recipe, as_json):
    """What RECIPE compiles to, without compiling: programs, region calls and unique regions; per
    rank the weight, state pool and largest-activation bytes; and, when the recipe gives
    parallel.device_memory_gib, whether each rank fits (exit 2 when not). Writes nothing."""
    import json

    from .footprint import format_report, report
    from .recipe import load_recipe

    try:
        plan_report = report(load_recipe(recipe, backend_installed=False))
    except DeepinferError as err:
        click.echo(f"deepinfer-compile plan: {err}", err=True)
        sys.exit(err.exit_code)
    click.echo(json.dumps(plan_report) if as_json else format_report(plan_report))
    if plan_report["problem"]:
        click.echo(f"deepinfer-compile plan: {plan_report['problem']}", err=True)
        sys.exit(2)


@main.command("bisect", context_settings=HELP)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--region", help="bisect this region (fingerprint) only; default: every region that fails")
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="seconds one trial compile may take (a hang is a failure)")
@click.option("--out", type=click.Path(file_okay=False), help="report, repro and state (default: bisect/<recipe name>)")
@click.option("--jobs", default=2, show_default=True, type=click.IntRange(1, 256),
              help="trials (and regions, when looking for failures) compiled in parallel")
@click.option("--cache-dir", type=click.Path(file_okay=False))
@click.option("--apply", is_flag=True, help="write the verified boundaries into RECIPE (only its regions: block changes)")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="where trial compiles run: this machine, or Ray tasks")
@click.option("--ray-address", help="a running Ray cluster (HOST:PORT or auto); default: start one on this machine")
def bisect_command(recipe, region, timeout, out, jobs, cache_dir, apply, executor, ray_address):
    """Find the graph boundary that makes a backend compiler crash; resumable (state on disk)."""
    from pathlib import Path

    from deepinfer.runtime import knobs

    from .bisect import bisect
    from .cache import CompileCache
    from .pool import Executor
    from .recipe import load_recipe

    try:
        loaded = load_recipe(recipe)
        out = Path(out or f"bisect/{loaded.name}")
        findings = bisect(loaded, Path(recipe), out, region, timeout, jobs, CompileCache(cache_dir or knobs.cache_dir()), apply,
                          Executor(executor, ray_address))
    except DeepinferError as err:
        click.echo(f"deepinfer-compile bisect: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo(f"deepinfer-compile bisect: interrupted; trials so far are kept under {out}, and the same command "
                   "resumes from them.", err=True)
        exit_now(130)
    if not findings:
        click.echo("every region compiles; nothing to bisect")
        return
    for f in findings:
        click.echo(f"region {f.region}: {f.signature}; {f.trials} trials, {f.seconds:.1f} s")
        if f.boundary:
            state = "verified" if f.boundary_verified else "NOT verified"
            click.echo(f"  ops: {', '.join(o['target'] for o in f.ops)}\n  boundary ({state}): {f.boundary}")
    click.echo(f"report: {out}/report.md" + ("; boundaries applied to " + recipe if apply else ""))
    sys.exit(0 if all(f.boundary_verified for f in findings) else 1)


if __name__ == "__main__":
    main()

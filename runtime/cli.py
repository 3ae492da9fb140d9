"""deepinfer-run: load a bundle and generate.

    deepinfer-run --bundle artifacts/tiny --prompt "hello"
    deepinfer-run --bundle artifacts/tiny --prompt-ids 1,2,3 --prompt "hi" --max-tokens 16 --json
    deepinfer-run --bundle artifacts/tiny --prompt "hello" --temperature 0.8 --top-p 0.9 --seed 1
    torchrun --nproc-per-node 2 -m deepinfer.runtime.cli --bundle artifacts/tiny-ws2 --prompt "hello"

A bundle compiled for world_size W > 1 runs on W ranks: this process leads and spawns the W-1
followers itself, or, under torchrun, rank 0 leads the ranks torchrun started.

Prints each prompt's continuation, or with --json one object:
    {"results": [{"prompt_ids", "token_ids", "text", "finish_reason", "tokens_per_step", "cached_tokens"}...],
     "timing": {"ttft", "tpot", ...}}
(tokens_per_step: tokens a decode step emitted on average; above 1 with speculative decoding;
cached_tokens: prompt tokens not prefilled, their state reused from an earlier prompt's: prefix caching)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from .collectives import CollectiveFailed, remove_segment_files
from .engine import Engine, Request, check_request
from .errors import DeepinferError
from .launch import Leader
from .manifest import peek_world_size, read_manifest
from .sampling import SamplingParams
from .trust import Trust, trust_options
from .tokenizer import is_text
from .versions import toolchain_versions


def open_bundle(bundle: Path, under_torchrun: bool, trust: Trust = Trust(), on_failure=None):
    """A single-rank executor, or for a multi-rank bundle the leader of its follower ranks
    (`on_failure`: see Leader); rank 0's load shows a progress bar on stderr."""
    from .executor import BundleExecutor

    if peek_world_size(bundle) == 1:
        return BundleExecutor(bundle, trust=trust, progress=True)
    return Leader(bundle, torchrun=under_torchrun, trust=trust, on_failure=on_failure, progress=True)


def parse_ids(text: str) -> list[int]:
    """ASCII digits only: int() would also read other scripts' digits ("١,٢" as 1,2)."""
    ids = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isascii() and t.isdigit() and len(t) < 19 for t in ids):
        raise click.BadParameter(f"{text!r}: give comma-separated token ids, e.g. 1,2,3", param_hint="--prompt-ids")
    return [int(t) for t in ids]


def check_text(text: str) -> str:
    """A --prompt that is Unicode text (invalid UTF-8 in argv arrives as lone surrogates)."""
    if not is_text(text):
        shown = text.encode("utf-8", "backslashreplace").decode()[:60]
        raise click.BadParameter(f"{shown!r} is not valid UTF-8 text", param_hint="--prompt")
    return text


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deepinfer", prog_name="deepinfer-run")
@click.option("--bundle", required=True, type=click.Path(file_okay=False), help="bundle directory from deepinfer-compile")
@click.option("--prompt", "prompts", multiple=True, help="prompt text (repeatable)")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="prompt as token ids, e.g. 1,2,3 (repeatable)")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy")
@click.option("--top-p", default=1.0, show_default=True, help="nucleus mass in (0, 1]")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1), help="sampling seed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@trust_options(default="allow")
def main(bundle, prompts, prompt_ids, max_tokens, temperature, top_p, seed, as_json, verify_key, native_regions):
    """Generate from a compiled bundle. A bundle of inductor, pjrt or neuron regions is machine code,
    run as it is: run only bundles you built, or whose signature you check with --verify-key."""
    from . import knobs
    from .tokenizer import bundle_tokenizer

    if not prompts and not prompt_ids:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    prompts = [check_text(p) for p in prompts]
    ids = [parse_ids(p) for p in prompt_ids]  # (bad ids are a usage error before the bundle loads)
    trust = Trust.of_options(verify_key, native_regions)
    under_torchrun = "RANK" in os.environ and "DEEPINFER_RING_FD" not in os.environ
    if under_torchrun and int(os.environ["RANK"]) > 0:
        from .follower import run_follower

        return run_follower(Path(bundle), trust)
    if peek_world_size(Path(bundle)) > 1 and not under_torchrun:
        signal.signal(signal.SIGINT, _interrupted)
    executor = None
    try:
        sampling = SamplingParams(temperature, top_p, seed)
        sampling.check()  # before the bundle loads: a bad flag should not cost a start-up
        manifest = read_manifest(Path(bundle), toolchain_versions(), rank=0)  # (no file is read but the manifest)
        for prompt in ids:
            check_request(Request(prompt, max_tokens, sampling), manifest.vocab_size, manifest.kv.max_len)
        trace_path = knobs.region_trace_path()
        if manifest.parallel["world_size"] > 1:  # (read at each rank's start; a bad one should not cost a load)
            knobs.collective_timeout_s(), knobs.startup_timeout_s()
        load_start = time.perf_counter()
        executor = open_bundle(Path(bundle), under_torchrun, trust)
        tokenizer = bundle_tokenizer(executor)
        load_seconds = time.perf_counter() - load_start
        engine = Engine.for_bundle(executor)
        all_ids = [tokenizer.encode(p) for p in prompts] + ids
        results = engine.generate([Request(ids, max_tokens, sampling) for ids in all_ids])
    except DeepinferError as err:
        if isinstance(err, CollectiveFailed) and isinstance(executor, Leader):
            executor.check_followers()  # a dead rank is the better message (and exits 1)
        click.echo(f"deepinfer-run: {err}", err=True)
        if isinstance(err, CollectiveFailed):
            _stop_at_once(executor, err.exit_code)  # a stuck follower would not take a stop record
        sys.exit(err.exit_code)
    except KeyboardInterrupt:  # one rank (multi-rank runs exit in _interrupted)
        click.echo("deepinfer-run: interrupted", err=True)
        sys.exit(130)
    finally:
        if isinstance(executor, Leader):
            executor.shutdown()

    texts = [tokenizer.decode(r.token_ids) for r in results]
    _print_results(prompts, prompt_ids, results, texts, as_json, load_seconds, executor.host_seconds)
    failed = [(i, r.error) for i, r in enumerate(results) if r.finish_reason == "error"]
    for i, error in failed:
        click.echo(f"deepinfer-run: prompt {i}: {error}", err=True)
    if executor.trace_events is not None:
        try:
            executor.write_trace(trace_path)
        except OSError as err:  # the results are out already; only the trace is lost
            click.echo(f"deepinfer-run: could not write the region trace to {trace_path}: {err.strerror}", err=True)
            sys.exit(1)
    if failed:
        sys.exit(1)


def _print_results(prompts, prompt_ids, results, texts, as_json: bool, load_seconds: float, host_seconds):
    if as_json:
        timing = {
            "load": load_seconds,
            "ttft": sum(r.ttft for r in results) / len(results),
            "tpot": sum(r.tpot for r in results) / len(results),
        }
        if host_seconds is not None:
            timing["host_region_seconds"] = host_seconds
        out = [{"prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "text": t, "finish_reason": r.finish_reason,
                "tokens_per_step": r.tokens_per_step, "cached_tokens": r.cached_tokens} for r, t in zip(results, texts)]
        click.echo(json.dumps({"results": out, "timing": timing}))
        return
    labels = list(prompts) + [f"ids {p}" for p in prompt_ids]
    for label, result, text in zip(labels, results, texts):
        click.echo(f"{label!r} -> {text!r}  [{len(result.token_ids)} tokens, {result.finish_reason}]")


def _interrupted(signum, frame):
    """Ctrl-C on a multi-rank run: exit at once. The followers die with this process
    (PR_SET_PDEATHSIG), the ring has no name on disk, and a collectives segment still waiting for
    its ranks to open it is unlinked here. Handled here rather than as a KeyboardInterrupt, which
    blocking calls inside torch.distributed may swallow or delay."""
    remove_segment_files()
    sys.stderr.write("deepinfer-run: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def _stop_at_once(executor, code: int):
    """Kill the followers and exit without tearing down the process group: followers may wait in
    a collective the leader left, or a peer may be gone, and destroying the group then can block."""
    if isinstance(executor, Leader):
        executor.shutdown(kill=True)
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

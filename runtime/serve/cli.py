"""deepinfer-serve: an OpenAI-compatible HTTP server over a bundle.

    deepinfer-serve --bundle artifacts/tiny --port 8000
    deepinfer-serve --bundle artifacts/tiny-ws2 --api-key sk-local --max-queue 32
    torchrun --nproc-per-node 2 -m deepinfer.runtime.serve.cli --bundle artifacts/tiny-ws2

The port is bound first (--port 0 takes any free one; the line "listening on http://HOST:PORT"
says which), then the bundle loads on the engine thread while /health answers 503. A multi-rank
bundle serves from rank 0, which spawns and feeds its followers as deepinfer-run does.

SIGTERM or Ctrl-C: new requests get 503, in-flight ones get --grace seconds to finish (the rest
end with a 503 error event), then the followers stop and the process exits 0. A second signal
stops at once. A rank that dies fails every in-flight request with a 503 and exits 1.
"""

import os
import signal
import socket
import sys
from pathlib import Path

import click

from ..errors import DeepinferError
from ..manifest import not_a_bundle, peek_world_size
from ..trust import Trust, trust_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deepinfer", prog_name="deepinfer-serve")
@click.option("--bundle", required=True, type=click.Path(file_okay=False), help="bundle directory from deepinfer-compile")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="requests that may wait for a sequence slot; past that, 429")
@click.option("--api-key", "api_keys", multiple=True, envvar="DEEPINFER_API_KEY",
              help="require 'Authorization: Bearer KEY' on /v1; repeat for several keys (or DEEPINFER_API_KEY, "
                   "keys separated by spaces)")
@click.option("--served-model-name", help="the model id clients send  [default: the bundle's recipe name]")
@click.option("--grace", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="seconds in-flight requests get to finish after SIGTERM")
@click.option("--request-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="seconds a client has to send a request's headers, and then its body")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="reuse the state a finished sequence left in its slot for a prompt that starts with its tokens")
@click.option("--prefix-cache-per-key", is_flag=True,
              help="share cached prompts only among requests of the same API key (each key salts the cache, as a "
                   "request's cache_salt does): one tenant cannot learn another's prompts from cache hits")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN",
              help="a browser origin (https://app.example.com, or * for any) CORS lets call the API; repeatable "
                   "[default: none, browsers on other origins are refused]")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="a line on stderr per request: client, request, status, latency, tokens")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1"]),
              help="return a reasoning model's thinking (up to </think>) as reasoning_content, apart from the answer "
                   "(vLLM's deepseek_r1 parser); structured outputs and tool calls then apply to the answer")
@click.option("--model", hidden=True, expose_value=False, callback=lambda ctx, param, value: _vllms_model(value),
              help="vLLM's flag; see --bundle and --served-model-name")
@trust_options(default="signed")
def main(bundle, host, port, max_queue, api_keys, served_model_name, grace, request_timeout, prefix_caching,
         prefix_cache_per_key, allowed_origins, access_log, reasoning_parser, verify_key, native_regions):
    """Serve a compiled bundle over OpenAI's HTTP API. A bundle of inductor, pjrt or neuron regions is
    machine code: by default it is served only when signed and verified (--verify-key); pass
    --native-regions allow for one you built yourself."""
    try:
        import uvicorn

        from .app import OpenAIServer
        from .server import DrainingServer, head_deadline_protocol
    except ImportError as err:
        raise click.ClickException(f"deepinfer-serve needs the serve extra ({err.name} is missing): "
                                   "pip install 'deepinfer[serve]'") from None
    from ..cli import open_bundle

    bundle = Path(bundle)
    if prefix_cache_per_key and not api_keys:
        raise click.UsageError("--prefix-cache-per-key separates the prefix cache by API key: give the keys with --api-key.")
    trust = Trust.of_options(verify_key, native_regions)
    under_torchrun = "RANK" in os.environ and "DEEPINFER_RING_FD" not in os.environ
    if under_torchrun and int(os.environ["RANK"]) > 0:
        from ..follower import run_follower

        # torchrun passes SIGTERM to every rank: rank 0 drains and then sends the stop record, which
        # a follower that left on the signal would never see (torchrun still SIGKILLs after its own timeout).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return run_follower(bundle, trust)
    if not (bundle / "manifest.json").is_file():  # a wrong path fails here, before the port is taken
        raise click.ClickException(not_a_bundle(bundle))
    try:
        peek_world_size(bundle)
    except DeepinferError as err:
        raise click.ClickException(str(err)) from None
    name = served_model_name or _recipe_name(bundle)
    try:
        sock = socket.create_server((host, port))
    except OSError as err:
        raise click.ClickException(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port "
                                   "(0 takes any free one).") from None

    url = f"http://{host}:{sock.getsockname()[1]}"
    api = OpenAIServer(lambda: open_bundle(bundle, under_torchrun, trust, on_failure=lambda m: api.engine_thread.fail(m)),
                       name, max_queue, api_keys, body_seconds=request_timeout, prefix_caching=prefix_caching,
                       prefix_cache_per_key=prefix_cache_per_key, url=url, access_log=access_log,
                       allowed_origins=allowed_origins, reasoning=reasoning_parser is not None)
    config = uvicorn.Config(api.app, log_level="warning", lifespan="on", http=head_deadline_protocol(request_timeout))
    server = DrainingServer(config, api, grace)
    click.echo(f"deepinfer-serve: listening on {url} (model {name!r}; loading {bundle}, /health answers 503 until "
               "ready)", err=True)
    server.run(sockets=[sock])
    if api.failure is not None:
        click.echo(f"deepinfer-serve: {api.failure}", err=True)
    code = 1 if api.failure is not None else 0
    engine_thread = api.engine_thread
    if engine_thread is not None and engine_thread.thread.is_alive():  # a forced stop, or a step stuck on a dead rank
        if hasattr(engine_thread.executor, "shutdown"):
            engine_thread.executor.shutdown(kill=True)  # kill and reap the followers now
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _vllms_model(value):
    if value is not None:
        raise click.UsageError(
            f"--model {value}: that is vLLM's flag for the model to load. deepinfer-serve serves a compiled bundle: "
            "`deepinfer-serve --bundle DIR` (deepinfer-compile makes one from a recipe naming the checkpoint), and "
            "`--served-model-name NAME` sets the name clients send (default: the recipe's name).")


def _recipe_name(bundle: Path) -> str:
    import json

    try:
        return json.loads((bundle / "manifest.json").read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return bundle.name


if __name__ == "__main__":
    main()

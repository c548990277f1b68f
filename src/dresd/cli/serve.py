"""`dresd serve`: its command-line options and what it does before uvicorn takes over.

The options are `dresd generate`'s (model, sampling defaults, drafter options), with these
changes: `--datastore` may be given several times (a request picks one by its folder name),
`--method` is the default method of requests that name none, and the server's own options
(`--host`, `--port`, `--max-queue`, `--served-model-name`, `--api-key`, `--metrics-open`, and
`--ray [ADDRESS] --replicas N` for replicas on Ray Serve, serve/ray_serve.py).

`build_app` is what one server process loads: the single-process server runs it here, and each
Ray Serve replica runs it at its start. Ray is imported only with `--ray`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from dresd.bench.methods import METHODS
from dresd.cli.options import (
    add_model_options,
    add_prefix_cache_options,
    add_save_outputs_option,
    drafter_options,
    finite_float,
    load_target_from_args,
    output_origin,
    prefix_cache_mb,
    settings_from_args,
)
from dresd.corpus import output_row, save_output
from dresd.decoding.prefix_cache import PrefixCache
from dresd.errors import MissingPackageError, UserError
from dresd.models.target import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from dresd.serve.auth import API_KEY_ENV, exposure_warning, read_key_file
from dresd.serve.engine import (
    DATASTORE_METHODS,
    Engine,
    default_max_kv_bytes,
    load_drafters,
    on_a_passing_thread,
)
from dresd.serve.limits import BYTES_PER_TOKEN

GRACEFUL_SHUTDOWN_S = 5  # open connections get this long to end when the server stops
WORKER_DIED_EXIT = 70  # EX_SOFTWARE: the process exits with it when its worker died


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `serve` subcommand, added to the `dresd` command's parser."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs pip install 'dresd[serve]')",
        conflict_handler="resolve")  # --datastore below replaces the shared single one
    add_model_options(serve)
    serve.add_argument("--datastore", type=Path, action="append", default=[],
                       help="a datastore folder (repeatable); a request names one by its folder "
                            "name in the `datastore` field, the first is the default")
    serve.add_argument("--method", choices=METHODS, default="pld",
                       help="the method of requests that name none (default pld); a request "
                            "may choose another with its `method` field")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=16,
                       help="requests generated together, their rows in one forward per step "
                            "(continuous batching; default 16); more wait in the queue")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="larger request bodies are refused with 413 before they are read "
                            f"(default: {BYTES_PER_TOKEN} bytes per token of the model's "
                            "context length, at least 64 KiB; the default model: 512 KiB)")
    serve.add_argument("--max-kv-mb", type=finite_float, default=None, metavar="MB",
                       help="KV cache memory all running requests hold together at most: a "
                            "request that does not fit beside them waits, one that never fits "
                            "(n x (prompt + max_tokens)) is refused with 400 (default: half the "
                            "memory available at start)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting at most; more are refused with 503 (default 64)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: --model, or "
                            f"{DEFAULT_MODEL_NAME} for the default model)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="every request must carry `Authorization: Bearer KEY` (else 401), "
                            "but GET /health; default: $" + API_KEY_ENV + ", else none. The key "
                            "is never logged")
    serve.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                       help="one `TENANT KEY` per line, instead of --api-key: each tenant's "
                            "prefix cache entries, learned drafting tables and figures are its "
                            "own (docs/serving.md, Tenants)")
    serve.add_argument("--metrics-open", action="store_true",
                       help="with an API key: GET /metrics answers without it too (for a "
                            "Prometheus scraper that holds no key)")
    serve.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="serve from replicas on Ray Serve behind one endpoint (its proxy "
                            "binds --host:--port); ADDRESS: a cluster's (none: $RAY_ADDRESS or a "
                            "local Ray). Needs pip install 'dresd[ray]'")
    serve.add_argument("--replicas", type=int, default=1,
                       help="with --ray: replicas, each loading the model and datastores once "
                            "and using --threads CPUs (default 1)")
    serve.add_argument("--replica-routing", choices=["prefix", "power-of-two"], default="prefix",
                       help="with --ray and more than one replica: `prefix` (default) sends "
                            "every turn of a conversation (its cache_salt and messages up to "
                            "the first user message) to the same replica, whose prefix cache "
                            "holds it, unless that replica's batch is full; `power-of-two`: "
                            "Ray Serve's default, the less busy of two replicas picked at random")
    serve.add_argument("--max-replicas", type=int, default=None,
                       help="with --ray: Ray Serve's autoscaling between --replicas and this "
                            "many, aiming at --max-batch-size requests in flight per replica")
    add_save_outputs_option(serve)
    add_prefix_cache_options(serve, "shared by every request of the same cache_salt")
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.api_key_file is not None:  # the keys by tenant: the app and Ray's ingress take both
        args.api_key = read_key_file(args.api_key_file)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    if args.ray is not None:
        from dresd.serve.ray_serve import serve_on_ray  # Ray is imported with --ray only

        return serve_on_ray(args, build_app, served_model_name(args))
    import uvicorn

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, engine = build_app(args)
    log = logging.getLogger("dresd.serve")
    tenants = f", {len(args.api_key)} tenants" if isinstance(args.api_key, dict) else ""
    open_paths = " and /metrics" if args.metrics_open else ""
    log.info("API key: %s", f"required{tenants} (but GET /health{open_paths})" if args.api_key
             else "none")
    log.info("prefix cache: %s", engine.prefix_cache_line())
    log.info("KV cache: %.0f MB at most, %.1f KB a token", engine.max_kv_bytes / 2**20,
             engine.kv_per_token / 1024)
    # uvicorn's own access log is off: RequestLog writes one line per request instead.
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        limit_concurrency=max_connections(args)))
    # A worker that died takes the process with it (after every waiting request has had its
    # 503): a server that cannot generate must not look alive to its supervisor. uvicorn
    # polls the flag, and stops as it does on Ctrl-C.
    engine.on_death = lambda: setattr(server, "should_exit", True)
    server.run()
    if engine.dead is not None:
        print(f"dresd serve: the generation worker died ({engine.dead}); exiting",
              file=sys.stderr, flush=True)
        return WORKER_DIED_EXIT
    return 0


def max_connections(args: argparse.Namespace) -> int:
    """Open connections uvicorn holds at most (past them it answers 503 at once): twice what
    the batch and the queue can take, room for probes and clients that are refused anyway."""
    return 2 * (args.max_batch_size + args.max_queue) + 32


def check_args(args: argparse.Namespace) -> None:
    """Refuse a command line that cannot serve, before anything is loaded."""
    # The server's packages are an extra: imported here, so that every other command runs
    # without them.
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise MissingPackageError(f"dresd serve needs fastapi and uvicorn ({err}); "
                                  "install them with pip install 'dresd[serve]'") from None
    if args.no_chat_template:
        raise UserError("serve: /v1/chat/completions uses the chat template and /v1/completions "
                        "the raw text; --no-chat-template does not apply")
    prefix_cache_mb(args)  # a negative size is refused before anything loads
    if args.max_kv_mb is not None and args.max_kv_mb <= 0:
        raise UserError(f"--max-kv-mb must be > 0, got {args.max_kv_mb}")
    if args.max_queue < 1:
        raise UserError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise UserError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.max_batch_size < 1:
        raise UserError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be between 1 and 65535, got {args.port}")
    if args.replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {args.replicas}")
    if (args.replicas > 1 or args.max_replicas is not None) and args.ray is None:
        raise UserError("--replicas and --max-replicas need --ray: one process serves one "
                        "replica")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UserError(f"--max-replicas ({args.max_replicas}) must be >= --replicas "
                        f"({args.replicas})")
    if args.api_key_file is not None and args.api_key is not None:
        raise UserError("give --api-key or --api-key-file, not both")
    if args.metrics_open and not (args.api_key or args.api_key_file
                                  or os.environ.get(API_KEY_ENV)):
        raise UserError("--metrics-open needs an API key (--api-key or $" + API_KEY_ENV +
                        "): without one every path is open already")
    for folder in args.datastore:
        if not (folder / "manifest.json").is_file():
            raise UserError(f"{folder} is not a datastore (no manifest.json); "
                            "build one with `dresd build`")
    names = [folder.name for folder in args.datastore]
    if len(set(names)) < len(names):  # the engine refuses it too, but after loading the model
        raise UserError("two --datastore folders have the same name; a request names one by its "
                        "folder name, so give the folders distinct names")
    if args.method in DATASTORE_METHODS and not args.datastore:
        raise UserError(f"--method {args.method} needs --datastore DIR")


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or (DEFAULT_MODEL_NAME if args.model == DEFAULT_MODEL
                                      else args.model)


def build_app(args: argparse.Namespace, metrics=None, metrics_text=None):
    """(the FastAPI app, its engine) of one server process: the model, the datastores and
    drafters, loaded once, on a thread that ends when they are (`on_a_passing_thread` says
    why). `metrics`, `metrics_text`: as `create_app` takes them (a Ray Serve replica reports
    to its deployment's /metrics)."""
    return on_a_passing_thread(_build_app, args, metrics, metrics_text)


def _build_app(args: argparse.Namespace, metrics, metrics_text):
    from dresd.serve.app import create_app

    defaults = settings_from_args(args)  # also applies --threads
    target = load_target_from_args(args)  # --model in --dtype on --device
    # The command line's drafter options, without a datastore: each store gets its own drafter.
    methods = [args.method] + (["draft"] if args.draft_model else [])
    options = drafter_options(argparse.Namespace(**{**vars(args), "datastore": None}), target,
                              methods)
    draft_model = {"model": options.pop("model")} if "model" in options else None
    budget = options.pop("budget", None) is not False
    drafters, names = load_drafters(target, args.datastore, options, draft_model)
    cache_mb = prefix_cache_mb(args)
    engine = Engine(target, drafters, defaults, args.method, names, args.max_queue,
                    output_saver(target, args.save_outputs), max_batch_size=args.max_batch_size,
                    budget=budget,
                    prefix_cache=None if cache_mb is None else PrefixCache(cache_mb),
                    max_kv_bytes=(default_max_kv_bytes() if args.max_kv_mb is None
                                  else int(args.max_kv_mb * 2**20)),
                    tenants=list(args.api_key) if isinstance(args.api_key, dict) else ())
    if args.method != "ar":
        engine.plan(args.method, None, {}, defaults)  # the default method must be servable
    app = create_app(engine, served_model_name(args), model_aliases=(args.model,),
                     max_body_bytes=args.max_body_bytes,
                     api_key=args.api_key, metrics_open=args.metrics_open, metrics=metrics,
                     metrics_text=metrics_text)
    return app, engine


def output_saver(target, path: Path | None):
    """What the engine calls after each generation: with --save-outputs, append the prompt
    and output as a corpus row (`dresd build --append` adds them to a datastore)."""
    if path is None:
        return None
    made_by = output_origin(target)

    def save(prompt_ids: list[int], result) -> None:
        decode = target.tokenizer.decode
        save_output(path, output_row(decode(prompt_ids), decode(result.token_ids,
                                                                 skip_special_tokens=True),
                                     prompt_ids, result.token_ids, made_by))

    return save

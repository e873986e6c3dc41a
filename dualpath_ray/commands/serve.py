"""`dualpath serve --config X [--host H --port P]`: an OpenAI-compatible endpoint.

Deploys the configured cluster (an embedded local one, or the Ray cluster at `--address`) and
serves /v1/completions, /v1/chat/completions (both with `stream: true`) and /v1/models at
http://H:P/v1 until Ctrl-C. The tokenizer comes from model.weights_dir (its Hugging Face
tokenizer.json and tokenizer_config.json) or `--tokenizer DIR`; with neither (the embedded
defaults), or with `--skip-tokenizer-init`, the endpoint serves token ids only: `prompt` as a list
of token ids (or a list of such lists), `token_ids` in every choice, text prompts a 400. A
`session_id` (or `conversation_id`) field keeps a conversation's turns on one request-id chain, so
the whole conversation can be aborted; its prefix reuse shows as
usage.prompt_tokens_details.cached_tokens.

With `--api-key-file PATH` (or `--api-key KEY`, or DUALPATH_API_KEY) every route but /health
needs `Authorization: Bearer KEY`, as OpenAI's API and vLLM's `--api-key` do; without one anyone
who reaches the port can generate, so keep the default loopback --host or set a key. A key on the
command line is visible to every user of the machine (`ps`, /proc/PID/cmdline, shell history):
prefer the file. The file holds one key per line ('#' starts a comment line); each key is a
tenant, and with several keys tenants never share cached prefixes (so usage.cached_tokens tells
no tenant about another's prompts); a request's `cache_salt` field separates it further.

What one client may hold is bounded (api/http_limits.py): the body (`--max-body-bytes`, 413), the
prompts of a request (`--max-prompts`, 400), connections and requests at once
(`--limit-concurrency`, 503), the time a request's headers (`--head-timeout-s`) and its body
(`--body-timeout-s`) take to arrive (408, the connection closed), the headers' size
(`--max-head-bytes`, 431) and an idle kept-alive connection (`--keep-alive-s`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

from dualpath_ray.api.api_keys import API_KEY_ENV, ApiKeyFileError, read_api_key_file
from dualpath_ray.api.http_limits import HttpLimits
from dualpath_ray.commands.serve_stop import (
    DEFAULT_SHUTDOWN_GRACE_S,
    RunProcesses,
    Served,
    StopRequested,
    StopSignals,
    exit_now,
    say,
    stop_deadline_s,
    stop_serving,
)
from dualpath_ray.config import load_config

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP endpoint", description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory with tokenizer.json (default: model.weights_dir when it has one; with "
                             "neither, token ids only)")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="serve token ids only even when model.weights_dir has a tokenizer (as vLLM's flag)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health. The KEY shows in `ps` "
                             "and /proc to every user of this machine, and in shell history: prefer --api-key-file "
                             f"or ${API_KEY_ENV} (the default; unset: no key)")
    parser.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                        help="require one of the keys in this file (one per line, blank lines and '#' comment lines "
                             "skipped); each key is a tenant: with several, tenants never share cached prefixes")
    limits = HttpLimits()
    parser.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                        help=f"largest request body; a larger one is a 413 (default {limits.max_body_bytes}, 8 MiB)")
    parser.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                        help="most prompts in one /v1/completions request (each is a turn of its own); more is a 400 "
                             f"naming `prompt` (default {limits.max_prompts})")
    parser.add_argument("--limit-concurrency", type=int, default=limits.limit_concurrency,
                        help="most connections and requests at once; past it uvicorn answers 503 (default "
                             f"{limits.limit_concurrency}; keep it under the process's open-files limit)")
    parser.add_argument("--head-timeout-s", type=float, default=limits.head_timeout_s,
                        help="a request's line and headers must arrive whole within this many seconds of the "
                             "connection opening or of the previous response; else 408 and the connection is closed "
                             f"(slow clients; default {limits.head_timeout_s:g})")
    parser.add_argument("--body-timeout-s", type=float, default=limits.body_timeout_s,
                        help="a request body must arrive whole within this many seconds of its headers; else 408 and "
                             f"the connection is closed (default {limits.body_timeout_s:g})")
    parser.add_argument("--keep-alive-s", type=float, default=limits.keep_alive_s,
                        help=f"an idle kept-alive connection is closed after this many seconds (default "
                             f"{limits.keep_alive_s:g})")
    parser.add_argument("--max-head-bytes", type=int, default=limits.max_head_bytes,
                        help=f"largest request line and headers; larger is a 431 (default {limits.max_head_bytes})")
    parser.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                        help="on SIGTERM or Ctrl-C, requests in flight get this many seconds to finish before they "
                             "are aborted; the whole stop then takes at most "
                             f"{stop_deadline_s(0.0):g} s more, and a second signal kills at once (default "
                             f"{DEFAULT_SHUTDOWN_GRACE_S:g}: stopped within "
                             f"{stop_deadline_s(DEFAULT_SHUTDOWN_GRACE_S):g} s)")
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start an embedded one)")
    parser.add_argument("--replace", action="store_true",
                        help="kill actors another deployment left in runtime.namespace instead of refusing to start")
    parser.set_defaults(func=main)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys to require: the --api-key-file's, else --api-key, else $DUALPATH_API_KEY; none
    when no file is given and the others are unset or empty, as vLLM treats --api-key /
    VLLM_API_KEY."""
    if args.api_key_file is not None:
        if args.api_key:
            raise SystemExit("dualpath serve: pass --api-key-file or --api-key, not both (prefer the file: a key on "
                             "the command line shows in `ps`)")
        try:
            keys = read_api_key_file(args.api_key_file)
        except ApiKeyFileError as exc:
            raise SystemExit(f"dualpath serve: {exc}") from None
        if args.api_key_file.stat().st_mode & 0o077:
            print(f"dualpath serve: {args.api_key_file} can be read by other users; chmod 600 it", file=sys.stderr,
                  flush=True)
        return keys
    key = args.api_key or os.environ.get(API_KEY_ENV)
    return [key] if key else []


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The HttpLimits of the flags; a bad one ends the command naming the flag."""
    try:
        return HttpLimits(args.max_body_bytes, args.max_prompts, args.limit_concurrency, args.head_timeout_s,
                          args.body_timeout_s, args.keep_alive_s, args.max_head_bytes)
    except ValueError as exc:
        raise SystemExit(f"dualpath serve: {exc}") from None


def _check_flags(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"dualpath serve: --port must be in [0, 65535] (got {args.port})")
    if not args.shutdown_grace_s >= 0:  # NaN included
        raise SystemExit(f"dualpath serve: --shutdown-grace-s must be >= 0 (got {args.shutdown_grace_s})")


def main(args: argparse.Namespace) -> NoReturn:
    from dualpath_ray.api.openai_server import start_openai_server, tokenizer_dir
    from dualpath_ray.api.tokenizer import HFTokenizer
    from dualpath_ray.cluster import DualPathCluster

    _check_flags(args)
    limits = http_limits(args)
    keys = api_keys(args)
    cfg = load_config(args.config)
    tokenizer = tokenizer_dir(cfg, args.tokenizer, args.skip_tokenizer_init)
    if tokenizer is not None:
        HFTokenizer.from_dir(tokenizer, cfg.model.vocab_size)  # before starting anything
    if not keys and args.host not in LOOPBACK_HOSTS:
        print(f"dualpath serve: listening on {args.host} without an API key: anyone who reaches the port can "
              f"generate; pass --api-key or set {API_KEY_ENV}", file=sys.stderr, flush=True)
    # Marked before anything starts, so every process this run starts carries the mark; the
    # handlers before anything starts, so a signal during the start-up stops it as well.
    processes = RunProcesses.mark()
    signals = StopSignals(processes)
    signals.install()
    served = Served(embedded=not args.address)
    failed = True
    try:
        served.cluster = DualPathCluster.connect(cfg, args.address) if args.address else DualPathCluster.start(cfg)
        signals.install()  # again: ray.init replaced the SIGTERM handler
        if served.cluster.local_cluster is not None:
            processes.session_dir = served.cluster.local_cluster.head_node.get_session_dir_path()
        served.cluster.deploy(replace_existing=args.replace)
        served.cluster.server()
        served.actor, url = start_openai_server(cfg, args.host, args.port, tokenizer, api_keys=keys, limits=limits,
                                                skip_tokenizer_init=tokenizer is None)
        print(json.dumps({"url": url, "model": cfg.model.model_id, "namespace": cfg.runtime.namespace,
                          "tokenizer": str(tokenizer) if tokenizer is not None else None,
                          "api_key_required": bool(keys), "tenants": len(keys)}), flush=True)
        threading.Event().wait()  # until a signal raises StopRequested
    except StopRequested as stop:
        failed = False
        say(f"{stop}: stopping (in-flight requests get {args.shutdown_grace_s:g} s, then are aborted; "
            "a second signal kills at once)")
    finally:
        signals.stopping = True  # a signal from now on forces the stop (StopSignals)
        stop_serving(served, processes, signals, args.shutdown_grace_s, 1 if failed else 0)
        signals.restore()
    exit_now(0)  # a failed start-up went on with its exception, shown by the interpreter

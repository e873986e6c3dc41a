"""`dualpath serve --config X [--host H --port P]`: an OpenAI-compatible endpoint.

Deploys the configured cluster (an embedded local one, or the Ray cluster at `--address`) and
serves /v1/completions, /v1/chat/completions (both with `stream: true`) and /v1/models at
http://H:P/v1 until Ctrl-C. The tokenizer comes from model.weights_dir (its Hugging Face
tokenizer.json and tokenizer_config.json) or `--tokenizer DIR`. A `session_id` (or
`conversation_id`) field keeps a conversation's turns on one request-id chain, so the whole
conversation can be aborted; its prefix reuse shows as usage.prompt_tokens_details.cached_tokens.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from dualpath_ray.config import load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP endpoint", description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory with tokenizer.json (default: model.weights_dir)")
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start an embedded one)")
    parser.add_argument("--replace", action="store_true",
                        help="kill actors another deployment left in runtime.namespace instead of refusing to start")
    parser.set_defaults(func=main)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the endpoint and the cluster as Ctrl-C does


def main(args: argparse.Namespace) -> int:
    from dualpath_ray.api.openai_server import start_openai_server, tokenizer_dir
    from dualpath_ray.api.tokenizer import HFTokenizer
    from dualpath_ray.cluster import DualPathCluster

    if not 0 <= args.port <= 65535:
        raise SystemExit(f"dualpath serve: --port must be in [0, 65535] (got {args.port})")
    cfg = load_config(args.config)
    HFTokenizer.from_dir(tokenizer_dir(cfg, args.tokenizer), cfg.model.vocab_size)  # before starting anything
    cluster = DualPathCluster.connect(cfg, args.address) if args.address else DualPathCluster.start(cfg)
    try:
        cluster.deploy(replace_existing=args.replace)
        cluster.server()
        actor, url = start_openai_server(cfg, args.host, args.port, args.tokenizer)
        print(json.dumps({"url": url, "model": cfg.model.model_id, "namespace": cfg.runtime.namespace}), flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("dualpath serve: stopping", flush=True)
        import ray

        ray.kill(actor, no_restart=True)
    finally:
        if args.address:
            cluster.teardown()
        else:
            cluster.shutdown()
    return 0

"""What one client may hold of the OpenAI-compatible endpoint (pure: no Ray, no HTTP library).

Each limit bounds what a client (a careless one, or one that means harm) can make the endpoint
hold or the cluster do, whatever it sends:
- `max_body_bytes`: a request body (413 past it, before it is parsed);
- `max_prompts`: the prompts of one /v1/completions request (400 naming `prompt`): each prompt is
  its own turn on the cluster, so without it one small body of many one-token prompts would
  fan out into as many turns;
- `limit_concurrency`: connections and requests at once (uvicorn answers 503 past it);
- `head_timeout_s`: a request's head (request line and headers) must arrive whole within this
  of the connection opening or of the previous response's end (408 and the connection closed),
  and `max_head_bytes` bounds its size (431): a client that sends headers byte by byte
  (slowloris) cannot hold a connection;
- `body_timeout_s`: the body must arrive whole within this of its head (408, connection closed);
- `keep_alive_s`: an idle kept-alive connection is closed after this.
Every field is a `dualpath serve` flag (commands/serve.py) of the same name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

DEFAULT_MAX_BODY_BYTES = 8 << 20
# A batch beyond this is better sent as several requests: each prompt is a turn of its own.
DEFAULT_MAX_PROMPTS = 256
# Above the concurrency an endpoint in one process serves well; lower it to the open-files limit.
DEFAULT_LIMIT_CONCURRENCY = 4096
DEFAULT_HEAD_TIMEOUT_S = 10.0
# An 8 MiB body (the default cap) arrives in 60 s at about 1.1 Mbit/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_MAX_HEAD_BYTES = 64 << 10


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag(field.name)} must be a finite number > 0 (got {value!r})")
            if field.type == "int" and not isinstance(value, int):
                raise ValueError(f"{flag(field.name)} must be a whole number (got {value!r})")
        if self.limit_concurrency < 2:
            # uvicorn counts the connection of the request it checks: 1 would refuse every request.
            raise ValueError(f"--limit-concurrency must be >= 2 (got {self.limit_concurrency})")


def flag(name: str) -> str:
    """The `dualpath serve` flag of a field."""
    return "--" + name.replace("_", "-")

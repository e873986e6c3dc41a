"""`dualpath serve`'s limit flags, without starting anything: `--help` lists them; the HTTP
limits come from their flags, and a bad one ends the command naming its flag."""

from __future__ import annotations

import argparse
import re

import pytest

from dualpath_ray.api.http_limits import HttpLimits
from dualpath_ray.cli import build_parser
from dualpath_ray.commands.serve import http_limits


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_help_lists_the_limit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-prompts", "--limit-concurrency", "--head-timeout-s", "--body-timeout-s", "--keep-alive-s",
                 "--max-head-bytes"):
        assert flag in text, f"{flag} is a serve flag"


def test_the_limits_come_from_their_flags_and_a_bad_one_is_named() -> None:
    limits = http_limits(serve_args("--max-prompts", "8", "--limit-concurrency", "64", "--head-timeout-s", "2.5",
                                    "--body-timeout-s", "7", "--keep-alive-s", "3", "--max-head-bytes", "2048",
                                    "--max-body-bytes", "4096"))
    assert limits == HttpLimits(max_body_bytes=4096, max_prompts=8, limit_concurrency=64, head_timeout_s=2.5,
                                body_timeout_s=7.0, keep_alive_s=3.0, max_head_bytes=2048), "each flag sets its limit"
    assert http_limits(serve_args()) == HttpLimits(), "no flags: the defaults"
    for flag, value in (("--max-prompts", "0"), ("--head-timeout-s", "-1"), ("--body-timeout-s", "inf"),
                        ("--limit-concurrency", "1"), ("--max-body-bytes", "0")):
        with pytest.raises(SystemExit, match=re.escape(flag)):
            http_limits(serve_args(flag, value))

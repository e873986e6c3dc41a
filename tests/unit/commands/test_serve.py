"""`dualpath serve`'s key and limit flags, without starting anything: `--help` warns that a key
on the command line shows in `ps`; `--api-key-file` reads the file's keys (and refuses a bad file,
or the file with --api-key, naming the flag and the fix); the HTTP limits come from their flags,
and a bad one ends the command naming its flag."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from dualpath_ray.api.api_keys import API_KEY_ENV
from dualpath_ray.api.http_limits import HttpLimits
from dualpath_ray.cli import build_parser
from dualpath_ray.commands.serve import api_keys, http_limits


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_help_says_a_key_on_the_command_line_shows_in_ps_and_offers_the_file(capsys: pytest.CaptureFixture[str],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width: one line per option
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    api_key_help = next(line for line in text.splitlines() if line.strip().startswith("--api-key KEY"))
    assert "`ps`" in api_key_help, f"--api-key's help warns that the key shows in ps: {api_key_help}"
    assert "--api-key-file" in api_key_help, "and points to the key file"
    for flag in ("--max-prompts", "--limit-concurrency", "--head-timeout-s", "--body-timeout-s", "--keep-alive-s",
                 "--max-head-bytes"):
        assert flag in text, f"{flag} is a serve flag"


def test_the_key_file_gives_the_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    path = tmp_path / "keys"
    path.write_text("# tenants\nsk-alpha\nsk-beta\n")
    os.chmod(path, 0o600)
    assert api_keys(serve_args("--api-key-file", str(path))) == ["sk-alpha", "sk-beta"], "one key per line"
    assert api_keys(serve_args("--api-key", "sk-x")) == ["sk-x"], "--api-key still works"
    assert api_keys(serve_args()) == [], "neither flag nor variable: no key"
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert api_keys(serve_args()) == ["sk-env"], f"${API_KEY_ENV} when no flag is given"
    assert api_keys(serve_args("--api-key-file", str(path))) == ["sk-alpha", "sk-beta"], "the file wins over the variable"


def test_a_bad_key_file_or_both_key_flags_end_the_command_naming_the_flag(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"
    path.write_text("\n# nothing\n")
    with pytest.raises(SystemExit, match="--api-key-file .* holds no key"):
        api_keys(serve_args("--api-key-file", str(path)))
    path.write_text("sk-alpha\n")
    with pytest.raises(SystemExit, match="--api-key-file or --api-key, not both"):
        api_keys(serve_args("--api-key-file", str(path), "--api-key", "sk-x"))
    os.chmod(path, 0o644)
    assert api_keys(serve_args("--api-key-file", str(path))) == ["sk-alpha"], "a readable file still serves"
    assert "chmod 600" in capsys.readouterr().err, "but a key file other users can read is warned about"


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

"""The endpoint's keys (api/api_keys.py): the key file's format and its errors, several keys each
opening the endpoint, and the tenant salt each names (none with a single key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath_ray.api.api_keys import ApiKey, ApiKeyFileError, ApiKeys, read_api_key_file

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.config import parse_config  # noqa: E402
from tests.unit.api.fake_rollout_server import FakeRolloutServer  # noqa: E402


def key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_the_key_file_holds_one_key_per_line_with_comments_and_blank_lines(tmp_path: Path) -> None:
    path = key_file(tmp_path, "# team A\nsk-alpha\n\n   sk-beta  \n  # sk-retired\nsk-gamma#2\n")
    assert read_api_key_file(path) == ["sk-alpha", "sk-beta", "sk-gamma#2"], (
        "keys in file order, whitespace around them dropped, '#' lines and blank lines skipped, '#' inside a key kept"
    )


@pytest.mark.parametrize("text, message", [
    ("# only a comment\n\n", "holds no key"),
    ("sk-alpha\nsk two words\n", "line 2: the key holds ' '"),
    ("sk-alpha\nsk-\u00e9t\u00e9\n", "line 2: the key holds"),
    ("sk-alpha\nsk-beta\nsk-alpha\n", "line 3: the same key as line 1"),
])
def test_a_bad_key_file_is_refused_naming_the_file_the_line_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = key_file(tmp_path, text)
    with pytest.raises(ApiKeyFileError, match=message) as refused:
        read_api_key_file(path)
    assert str(path) in str(refused.value), "the error names the file"


def test_a_missing_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyFileError, match="no such file"):
        read_api_key_file(tmp_path / "absent")


def test_each_key_opens_the_endpoint_and_names_its_own_tenant() -> None:
    keys = ApiKeys.of(["sk-alpha", "sk-beta"])
    http = TestClient(build_app(OpenAIEndpoint(FakeRolloutServer(), None, parse_config({})), keys))
    for key in ("sk-alpha", "sk-beta"):
        answer = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, f"{key}: every listed key opens the endpoint"
    assert http.get("/v1/models", headers={"Authorization": "Bearer sk-gamma"}).status_code == 401, "an unlisted key does not"
    assert keys.match("Basic sk-alpha") is None, "only the Bearer scheme presents a key"
    alpha, beta = keys.keys
    assert keys.match("Bearer sk-beta") == beta and keys.match("bearer  sk-alpha ") == alpha, "the matching key is found"
    salts = {keys.tenant_salt(alpha), keys.tenant_salt(beta)}
    assert len(salts) == 2 and None not in salts, "with several keys each key is a tenant of its own salt"
    for salt in salts:
        assert salt is not None and "sk-" not in salt, "a salt does not hold its key"
        assert bytes.fromhex(salt) not in (alpha.digest, beta.digest), "nor the digest that authenticates it"
    single = ApiKeys.of(["sk-alpha"])
    assert single.tenant_salt(single.keys[0]) is None, "with one key there is one tenant: no salt, all share"
    assert ApiKey.of("sk-alpha").accepts("Bearer sk-alpha"), "a single ApiKey still checks its header"

"""Ray's auth token is its owner's only: ~/.ray 0700, auth_token 0600, whatever umask wrote them;
and a driver joining a cluster sends it wherever there is one."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import UserError
from orchestrator.ray_token import (
    AUTH_MODE,
    secure_token_files,
    send_token_to_clusters,
    token_to_send,
)


ROOT = Path(__file__).resolve().parent.parent


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_token_and_its_folder_are_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    secure_token_files()  # before Ray starts: the folder exists, private, before Ray writes into it
    assert mode(tmp_path / ".ray") == 0o700 and not (tmp_path / ".ray" / "auth_token").exists()

    os.chmod(tmp_path / ".ray", 0o755)  # as Ray 2.60 leaves them under a 022 umask
    token = tmp_path / ".ray" / "auth_token"
    token.write_text("t" * 32)
    os.chmod(token, 0o644)
    secure_token_files()
    assert mode(tmp_path / ".ray") == 0o700 and mode(token) == 0o600
    assert token.read_text() == "t" * 32


def test_a_token_that_is_already_private_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir(mode=0o700)
    token = tmp_path / ".ray" / "auth_token"
    token.write_text("t")
    os.chmod(token, 0o400)  # stricter than ours: kept
    secure_token_files()
    assert mode(token) == 0o400


def test_a_home_where_the_token_folder_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    home = tmp_path / "not-a-folder"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(UserError) as refused:
        secure_token_files()
    assert str(refused.value) == (
        f"cannot make {home / '.ray'} private (Not a directory): Ray keeps the cluster's token there; "
        "run with HOME set to a folder you can write"
    )


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    """A user's shell with a home of its own and none of Ray's token variables."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", AUTH_MODE):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_token_is_found_where_ray_looks_for_it(no_token, monkeypatch):
    assert not token_to_send()
    (no_token / ".ray").mkdir()
    (no_token / ".ray" / "auth_token").write_text("t" * 32)
    assert token_to_send()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(no_token / "elsewhere"))  # named: only that file counts
    assert not token_to_send()
    (no_token / "elsewhere").write_text("t" * 32)
    assert token_to_send()
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    (no_token / ".ray" / "auth_token").unlink()
    monkeypatch.setenv("RAY_AUTH_TOKEN", " ")
    assert not token_to_send()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    assert token_to_send()


def test_the_token_is_sent_only_where_there_is_one_and_the_user_chose_no_mode(no_token):
    """In a fresh process each, as the command runs it: before Ray is imported."""
    def mode_set(**env: str) -> str | None:
        code = ("from orchestrator.ray_token import send_token_to_clusters; send_token_to_clusters(); "
                "import os, sys; assert 'ray' not in sys.modules; print(os.environ.get('RAY_AUTH_MODE'))")
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=ROOT, check=True,
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip()

    assert mode_set() == "None"  # no token: Ray's own default, which a cluster without authentication takes
    assert mode_set(RAY_AUTH_TOKEN="t" * 32) == "token"
    assert mode_set(RAY_AUTH_TOKEN="t" * 32, RAY_AUTH_MODE="disabled") == "disabled"


def test_once_ray_is_imported_the_mode_is_left_alone(no_token, monkeypatch):
    """This process's client read its mode on import: setting one now would reach only its children."""
    import ray  # noqa: F401

    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    send_token_to_clusters()
    assert AUTH_MODE not in os.environ

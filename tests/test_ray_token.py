"""Ray's auth token is its owner's only: ~/.ray 0700, auth_token 0600, whatever umask wrote them."""

import os
import stat

from orchestrator.ray_token import secure_token_files


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

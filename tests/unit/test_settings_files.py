"""Files a stage's settings name (stage token files, the YAML config file) are read bounded and without
hanging: a FIFO nothing writes, a folder or a huge file given by mistake is refused with an error naming
it, instead of hanging the start (a FIFO's open blocks until a writer comes; Ctrl-C cannot end a blocked
read in the main thread) or reading gigabytes into memory; a pipe that is written
(``--config <(envsubst < mammoth.yaml)``) is read as before."""

from __future__ import annotations

import os
import threading

import pytest

from mammoth_core.settings import ARSettings, SettingsError, read_config_file


def _within(seconds: float, fn):
    """``fn()``'s result or exception, failing the test if it does not return within ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still reading after {seconds} s (blocked)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "token.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("reader", ["auth", "role", "config"])
def test_a_fifo_nothing_writes_is_refused_in_bounded_time_naming_it(fifo, reader, monkeypatch):
    from mammoth_core import small_files

    monkeypatch.setattr(small_files, "PIPE_WAIT_S", 0.5)  # the pipe wait
    read = {
        "auth": lambda: ARSettings(auth_token_file=str(fifo)).read_auth_token(),
        "role": lambda: ARSettings(gateway_token_file=str(fifo)).read_role_tokens(),
        "config": lambda: read_config_file(fifo, "ar"),
    }[reader]
    with pytest.raises(SettingsError, match=f"{fifo}: a pipe or FIFO whose writer did not finish within 0.5 s"):
        _within(5, read)


def test_a_written_pipe_is_read_as_a_file(fifo):
    """Process substitution and named FIFOs a process writes keep working: the reader waits for the writer."""
    def write():
        with open(fifo, "w") as f:  # blocks until the reader has opened it
            f.write("port: 4321\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert _within(5, lambda: read_config_file(fifo, "gateway")) == {"port": 4321}
    read_end, write_end = os.pipe()  # an anonymous pipe by its /proc path, as bash's <(...) gives /dev/fd/63
    os.write(write_end, b"s3cret\n")
    os.close(write_end)
    try:
        assert ARSettings(auth_token_file=f"/proc/self/fd/{read_end}").read_auth_token() == "s3cret"
    finally:
        os.close(read_end)


@pytest.mark.parametrize("reader", ["auth", "config"])
def test_a_folder_or_an_oversized_file_is_refused_naming_it(tmp_path, reader):
    big = tmp_path / "big"
    big.write_bytes(b"x" * (2 << 20))
    for path, message in ((tmp_path, "not a regular file \\(nor a pipe\\)"), (big, "larger than")):
        read = (lambda p=path: ARSettings(auth_token_file=str(p)).read_auth_token()) if reader == "auth" else \
            (lambda p=path: read_config_file(p, "ar"))
        with pytest.raises(SettingsError, match=f"{path}: .*{message}"):
            read()


def test_token_and_config_files_still_read_as_before(tmp_path):
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    config = tmp_path / "mammoth.yaml"
    config.write_text("port: 1234\nar:\n  slots: 4\n")
    assert ARSettings(auth_token_file=str(token)).read_auth_token() == "s3cret"
    assert ARSettings(ar_token_file=str(token)).read_role_tokens() == {"ar": "s3cret"}
    assert read_config_file(config, "ar") == {"port": 1234, "slots": 4}
    with pytest.raises(OSError):
        ARSettings(auth_token_file=str(tmp_path / "missing")).read_auth_token()


def test_a_piped_config_and_token_read_twice_give_the_same_content():
    """(break-it pass, 2026-12-08: ``gateway --config <(...)`` started with the defaults: the unknown-key
    check read the pipe, the values read EOF; ``client_token`` re-read a piped token file and got None.)"""
    from mammoth_core.settings import GatewaySettings, resolve_settings

    read_end, write_end = os.pipe()
    os.write(write_end, b"port: 1234\n")
    os.close(write_end)
    token_read, token_write = os.pipe()
    os.write(token_write, b"s3cret\n")
    os.close(token_write)
    try:
        settings = resolve_settings(GatewaySettings, config_file=f"/proc/self/fd/{read_end}", env={})
        assert settings.port == 1234
        tokens = ARSettings(auth_token_file=f"/proc/self/fd/{token_read}")
        assert tokens.read_auth_token() == "s3cret" and tokens.client_token("ar") == "s3cret"
    finally:
        os.close(read_end)
        os.close(token_read)

"""The first hour with the ``mammoth`` command: every ordinary mistake gets one line, no traceback.

Each test runs the real console command (``python -m mammoth_app.cli``) as a new user would type it,
and checks the exit status, that stderr is exactly one line saying what is wrong and what to do, and
that nothing was half done (no image request sent, no file written).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mammoth(*args: str, cwd: pathlib.Path = ROOT, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "mammoth_app.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed command (asserts: exit 1 or 2, no traceback, one line)."""
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_generate_into_a_missing_folder_is_refused_before_the_request(tmp_path):
    port = free_port()  # nothing listens: the path must be checked before any connection
    line = one_line(mammoth("generate", "a fox", "-o", "missing_dir/x.png", "--url",
                            f"http://127.0.0.1:{port}", cwd=tmp_path))
    assert "missing_dir" in line and "does not exist" in line, line
    assert "127.0.0.1" not in line  # it never tried the gateway


def test_generate_format_and_extension_must_agree(tmp_path):
    line = one_line(mammoth("generate", "a fox", "--format", "jpeg", "-o", "x.png", "--url",
                            f"http://127.0.0.1:{free_port()}", cwd=tmp_path))
    assert "jpeg" in line and "x.png" in line, line
    assert not (tmp_path / "x.png").exists()


def test_up_with_a_missing_checkpoint_folder(tmp_path):
    line = one_line(mammoth("up", "--checkpoint", str(tmp_path / "missing"), "--port", "0",
                            MAMMOTH_CACHE_DIR=str(tmp_path / "cache")))
    assert "missing" in line and "does not exist" in line and "check-checkpoint" in line, line


def test_up_generate_into_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    line = one_line(mammoth("up", "--generate", "a fox", "-o", "missing_dir/x.png", "--port", "0",
                            cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "cache")))
    assert "missing_dir" in line and "does not exist" in line, line
    assert not (tmp_path / "cache").exists()  # not even the built-in checkpoint was made


def test_download_model_without_a_scheme(tmp_path):
    line = one_line(mammoth("download-model", "org/repo", str(tmp_path / "dest")))
    assert "hf://org/repo" in line, line
    assert not (tmp_path / "dest").exists()


def test_make_checkpoint_with_an_unknown_preset(tmp_path):
    line = one_line(mammoth("make-checkpoint", str(tmp_path / "ckpt"), "--preset", "huge"))
    assert "huge" in line and "tiny" in line, line


def test_make_checkpoint_into_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("mine")
    line = one_line(mammoth("make-checkpoint", str(tmp_path / "ckpt")))
    assert "not empty" in line, line


def test_generate_with_nothing_running_names_the_url_and_mammoth_up(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(mammoth("generate", "a fox", "--url", url, "-o", "fox.png", cwd=tmp_path))
    assert url in line and "mammoth up" in line, line
    assert not (tmp_path / "fox.png").exists()


def test_bench_with_nothing_running_names_the_url_and_mammoth_up():
    url = f"http://127.0.0.1:{free_port()}"
    proc = mammoth("bench", "--url", url, "--requests", "1", "--concurrency", "1")
    line = one_line(proc)
    assert url in line and "mammoth up" in line, line
    assert "nan" not in proc.stdout, proc.stdout


def test_every_flag_has_help_and_the_help_pages_show_defaults():
    from mammoth_app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, page in sub.choices.items():
        for action in page._actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without help: {missing}"
    for command, flag, default in (("generate", "--url", "http://127.0.0.1:8000"), ("up", "--port", "8000"),
                                   ("bench", "--concurrency", "1,2,4"), ("make-checkpoint", "--preset", "tiny")):
        text = sub.choices[command].format_help()  # what `mammoth COMMAND --help` prints
        assert f"(default: {default})" in " ".join(text.split()), (command, flag, text)
    shown = mammoth("up", "--help")  # one page through the console command itself
    assert shown.returncode == 0 and " ".join(shown.stdout.split()) == " ".join(sub.choices["up"].format_help().split())


def test_the_progress_token_count_ends_at_the_usage_count(pipeline, tmp_path):
    import re

    import httpx

    proc = mammoth("generate", "a fox", "--url", pipeline.url, "--size", "64x96", "--steps", "2",
                   "--seed", "3", "-o", "fox.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = re.findall(r"AR \[[#-]*\] (\d+)/(\d+) tokens", proc.stderr)
    assert shown, proc.stderr
    done, total = map(int, shown[-1])
    body = {"prompt": "a fox", "size": "64x96", "num_inference_steps": 2, "seed": 3}
    usage = httpx.post(f"{pipeline.url}/v1/images/generations", json=body, timeout=120).json()["usage"]
    assert done == total == usage["output_tokens"], (shown[-1], usage)


@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_stage_that_cannot_load_its_checkpoint_says_why_and_exits_cleanly(tmp_path, role):
    """``mammoth ar`` / ``mammoth dit`` (what a pod runs) with an unusable checkpoint: exit 1, the
    stage's own log says it could not start and why, naming the checkpoint; no traceback, and the gRPC
    server it had opened for the health probes is stopped, not left to the interpreter's teardown
    (``Event loop is closed``, ``coroutine ... was never awaited``)."""
    missing = tmp_path / "missing-checkpoint"
    proc = mammoth(role, "--checkpoint", str(missing), "--port", "0", "--metrics-port", "-1",
                   "--insecure-no-auth", "true", "--device", "cpu", MAMMOTH_CACHE_DIR=str(tmp_path / "cache"))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Event loop is closed" not in proc.stderr and "never awaited" not in proc.stderr, proc.stderr[-3000:]
    failure = [line for line in proc.stderr.splitlines() if "could not start" in line]
    assert len(failure) == 1 and "ERROR" in failure[0] and str(missing) in failure[0], proc.stderr[-3000:]

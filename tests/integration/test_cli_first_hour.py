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

from pipeline_harness import has_ipv6_loopback

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


@pytest.mark.parametrize("size,words", [("abc", "WIDTHxHEIGHT"), ("100x100", "multiple of 16"),
                                        ("16384x16384", "pixels")])
def test_up_generate_with_a_size_the_gateway_refuses_is_refused_before_anything_starts(tmp_path, size, words):
    """``up --generate --size`` is checked by the gateway's own size rule (its settings as ``up`` would
    start it) before any process starts: not a pipeline started, then a 400, then a stop."""
    line = one_line(mammoth("up", "--generate", "a fox", "--size", size, "-o", "x.png", "--port", "0",
                            cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "cache")))
    assert "--size" in line and size in line and words in line, line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("steps", ["0", "-1", "100000"])
def test_up_generate_with_steps_the_gateway_refuses_is_refused_before_anything_starts(tmp_path, steps):
    """``up --generate --steps`` outside the gateway's ``[1, max_steps]`` (the rule `check_image`
    enforces) is refused before any process starts (break-it pass, 2026-12-07: the whole pipeline
    started, about 10 s, then the gateway's 400, then a stop)."""
    line = one_line(mammoth("up", "--generate", "a fox", "--steps", steps, "-o", "x.png", "--port", "0",
                            cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "cache")))
    assert "--steps" in line and steps in line and "num_inference_steps" in line, line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("where", ["file", "env"])
def test_up_with_a_max_steps_below_its_local_default_steps_keeps_to_it(tmp_path, where):
    """``up`` sets ``default_steps: 20`` for the built-in checkpoint where the user did not; with a
    ``max_steps`` of 10 (config file or environment) it now takes 10, and ``--steps 11`` is refused by
    that limit (break-it pass, 2026-12-07: ``mammoth up: default_steps must not exceed max_steps``, a
    setting the user never set, even for a valid ``--steps 5``)."""
    config = tmp_path / "flat.yaml"
    config.write_text("max_steps: 10\n")
    args = ("--config", str(config)) if where == "file" else ()
    env = {} if where == "file" else {"MAMMOTH_MAX_STEPS": "10"}
    line = one_line(mammoth("up", *args, "--generate", "a fox", "--steps", "11", "-o", "x.png", "--port", "0",
                            cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "cache"), **env))
    assert "--steps 11" in line and "[1, 10]" in line, line
    assert "default_steps" not in line, line


def test_up_generate_with_steps_only_the_dit_refuses_is_refused_before_anything_starts(tmp_path):
    """The DiT enforces its own ``max_steps`` (a config file's ``dit:`` section); ``up`` checks ``--steps``
    against it too (break-it pass, 2026-12-07: with ``dit: {max_steps: 10}`` and ``--steps 11`` the whole
    pipeline started, then the DiT refused the request)."""
    config = tmp_path / "dit.yaml"
    config.write_text("dit:\n  max_steps: 10\n")
    line = one_line(mammoth("up", "--config", str(config), "--generate", "a fox", "--steps", "11", "-o", "x.png",
                            "--port", "0", cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "cache")))
    assert "--steps 11" in line and "[1, 10]" in line, line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "x.png").exists()


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


# -- a first-hour break-it pass (2026-12-07): each of these was a traceback, a wrong exit status or a
# -- raw server page before


@pytest.mark.parametrize("args,words", [
    (("up", "--port", "99999"), ("99999", "0-65535")),
    (("down", "--port", "-1"), ("-1", "0-65535")),
    (("generate", "a fox", "--timeout", "-1"), ("--timeout", "above 0")),
    (("generate", "a fox", "--timeout", "0"), ("--timeout", "above 0")),
    (("generate", "a fox", "--guidance", "nan"), ("--guidance", "finite")),
    (("generate", "a fox", "--guidance", "inf"), ("--guidance", "finite")),
    # not "invalid port_number value" (the name of a function of ours; break-it pass, 2026-12-07)
    (("up", "--port", "80.5"), ("80.5", "0-65535")),
    (("generate", "a fox", "--timeout", "soon"), ("--timeout", "above 0")),
    (("generate", "a fox", "--guidance", "high"), ("--guidance", "finite")),
])
def test_out_of_range_flag_values_are_refused_when_parsed(tmp_path, args, words):
    """Before: ``up --port 99999`` ended in ``OverflowError`` from ``bind``, ``--timeout -1`` in 60
    lines of httpx traceback (``0``: "Resource temporarily unavailable"), ``--guidance nan`` in
    "Out of range float values are not JSON compliant"."""
    proc = mammoth(*args, "--url", f"http://127.0.0.1:{free_port()}", cwd=tmp_path) if args[0] == "generate" \
        else mammoth(*args, cwd=tmp_path)
    line = one_line(proc)
    assert proc.returncode == 2 and all(w in line for w in words), line


def test_generate_into_a_file_posing_as_a_folder_or_an_unwritable_place_is_refused_before_the_request(tmp_path):
    """Before: ``-o afile/x.png`` said the folder "does not exist", and ``-o /proc/x.png`` (or /sys,
    where ``os.access`` says yes to root) generated the image and lost it in a traceback."""
    (tmp_path / "afile").write_text("not a folder")
    for output, words in (("afile/x.png", "is a file, not a folder"), ("/proc/mammoth-first-hour.png", "cannot write")):
        line = one_line(mammoth("generate", "a fox", "-o", output, "--url", f"http://127.0.0.1:{free_port()}",
                                cwd=tmp_path))
        assert words in line and "127.0.0.1" not in line, line  # refused before any connection


def test_up_on_an_address_not_of_this_machine_or_with_a_cache_dir_that_is_a_file(tmp_path):
    """Before: ``OSError: [Errno 99] Cannot assign requested address`` and ``NotADirectoryError``
    tracebacks."""
    line = one_line(mammoth("up", "--host", "192.0.2.1", "--port", "0", "--generate", "a fox", "-o",
                            str(tmp_path / "x.png"), cwd=tmp_path))
    assert "192.0.2.1" in line and "cannot listen" in line, line
    (tmp_path / "afile").write_text("not a folder")
    line = one_line(mammoth("up", "--port", "0", "--generate", "a fox", "-o", str(tmp_path / "x.png"),
                            cwd=tmp_path, MAMMOTH_CACHE_DIR=str(tmp_path / "afile")))
    assert "MAMMOTH_CACHE_DIR" in line and "afile" in line, line
    assert not (tmp_path / "x.png").exists()


def test_sigterm_to_up_generate_is_not_a_success(tmp_path):
    """``mammoth up --generate`` stopped by SIGTERM wrote no image, so it must not exit 0 (it did:
    a script or ``mammoth down`` saw success and no file); a plain ``up`` still exits 0 on SIGTERM."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    proc = subprocess.Popen([sys.executable, "-m", "mammoth_app.cli", "up", "--port", "0", "--generate", "a fox",
                             "--steps", "4", "-o", str(tmp_path / "x.png")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)  # starting its stages
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and not (tmp_path / "x.png").exists()


def test_generate_against_a_server_that_is_not_a_gateway_says_so(tmp_path):
    """Before: the whole HTML page of the server's 501 (``python -m http.server``), or just ``404: ``."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        line = one_line(mammoth("generate", "a fox", "-o", "x.png", "--url",
                                f"http://127.0.0.1:{server.server_address[1]}", cwd=tmp_path))
    finally:
        server.shutdown()
    assert "501" in line and "mammoth gateway" in line and "--url" in line and "<" not in line, line
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("role,flag", [("ar", "--port"), ("ar", "--metrics-port"), ("dit", "--port"),
                                       ("dit", "--metrics-port"), ("gateway", "--port")])
def test_a_component_on_a_port_in_use_says_which_and_exits_cleanly(tmp_path, role, flag):
    """``mammoth ar|dit|gateway`` (what a pod or a user's own supervisor runs) on a port something else
    holds: exit 1 and one error line naming the port and its flag, no traceback (break-it pass,
    2026-12-07: a 47-52 line ``OSError: [Errno 98] Address already in use`` or grpc ``Failed to bind``
    traceback; the gateway exited 3). The port is checked before the checkpoint is read."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        ports = ({"--port": "0"} if role == "gateway" else {"--port": "0", "--metrics-port": "-1"}) | {flag: port}
        stage = () if role == "gateway" else ("--checkpoint", str(tmp_path / "missing"), "--device", "cpu")
        auth = () if role == "gateway" else ("--insecure-no-auth", "true")
        proc = mammoth(role, *stage, "--host", "127.0.0.1", *(a for kv in ports.items() for a in kv), *auth,
                       MAMMOTH_CACHE_DIR=str(tmp_path / "cache"), timeout=60)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]  # (gRPC's C core logs its own line)
    assert len(errors) == 1 and port in errors[0] and flag in errors[0], proc.stderr[-3000:]


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_up_on_an_ipv6_host_serves_an_image(tmp_path):
    """``mammoth up --host ::1``: before, it failed at once ("cannot listen on --host ::1 --port 0 (Address
    family for hostname not supported)"): the DiT's port was chosen on an IPv4 socket; past that the AR's
    gRPC address was ``::1:PORT`` (gRPC read it as ``[::0.1.0.0]:443``), the DiT's metrics server was
    IPv4-only, and the banner printed ``grpc://::1:PORT``."""
    proc = mammoth("up", "--host", "::1", "--port", "0", "--generate", "a red boat", "--size", "256x256",
                   "--steps", "2", "-o", "boat.png", cwd=tmp_path, timeout=240,
                   MAMMOTH_CACHE_DIR=str(tmp_path / "cache"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert (tmp_path / "boat.png").read_bytes().startswith(b"\x89PNG")
    banner = proc.stdout + proc.stderr
    for scheme in ("http", "grpc"):
        assert f"{scheme}://[::1]:" in banner, banner
    assert "://::1:" not in banner, banner

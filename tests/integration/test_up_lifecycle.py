"""``mammoth up`` as a real process: its components end with it, and it names a stale instance.

Each test runs ``python -m mammoth_app.cli up`` in its own session (as a terminal's foreground job:
the signals go to its process group) with the tiny checkpoint, finds its components as the
processes whose parent it is, and after the signal checks that none of them remains and that every
port they listened on can be bound again.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """A ``mammoth up`` process with its output collected line by line (stdout and stderr)."""

    def __init__(self, checkpoint: pathlib.Path | str, cache: pathlib.Path, port: int, *extra: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
        env["MAMMOTH_CACHE_DIR"] = str(cache)
        # its work folder (stage tokens) under the test's tmp_path: a SIGKILLed `up` cannot remove it
        env["TMPDIR"] = str(cache.parent / "tmp")
        os.makedirs(env["TMPDIR"], exist_ok=True)
        cmd = [sys.executable, "-m", "mammoth_app.cli", "up", "--port", str(port), "--checkpoint",
               str(checkpoint), "--log-level", "warning", *extra]
        self.port = port
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_up(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any("Press Ctrl-C" in line for line in self.out):
            assert self.proc.poll() is None, f"mammoth up exited {self.proc.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"mammoth up not up after {timeout} s:\n{self.text()}"
            time.sleep(0.1)

    def text(self) -> str:
        return "".join(self.out) + "\n--- stderr ---\n" + "".join(self.err)

    def children(self) -> list[int]:
        """Pids whose parent is this ``mammoth up``."""
        return children_of(self.proc.pid)

    def ports(self) -> list[int]:
        """Every port the banner names (gateway, AR, DiT, metrics)."""
        banner = "".join(self.out)
        return sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", banner)})

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    kids = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                status = (proc / "status").read_text()
            except OSError:
                continue
            if re.search(rf"^PPid:\s+{pid}$", status, re.M):
                kids.append(int(proc.name))
    return kids


def ready_files(pid: int) -> list[str]:
    """The ``--ready-file`` paths on the command line of process ``pid``."""
    argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--ready-file"]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s+Z", status, re.M)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def assert_all_gone(children: list[int], ports: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (any(map(alive, children)) or not all(map(port_free, ports))):
        time.sleep(0.1)
    left = [pid for pid in children if alive(pid)]
    held = [port for port in ports if not port_free(port)]
    try:
        assert not left and not held, f"components left running: pids {left}, ports held {held}"
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(tiny_checkpoint, tmp_path):
    started: list[Up] = []

    def start(*extra: str, port: int | None = None, checkpoint: str | None = None) -> Up:
        u = Up(checkpoint or tiny_checkpoint, tmp_path / "cache", port or free_port(), *extra)
        started.append(u)
        return u

    yield start
    for u in started:
        kids = u.children()
        u.stop()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _slow_request(url: str) -> threading.Thread:
    """A request that keeps the gateway busy for many seconds (the first Ctrl-C waits for it)."""
    def run() -> None:
        try:
            httpx.post(f"{url}/v1/images/generations", timeout=120,
                       json={"prompt": "slow", "size": "1024x1024", "num_inference_steps": 200})
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_for_active_pipeline(u: Up, timeout: float = 60.0) -> None:
    """Until the gateway of ``u`` reports an image pipeline in progress (its ``/metrics``)."""
    from pipeline_harness import metric_samples

    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{u.port}/metrics"
    while sum(metric_samples(url, "mammoth_gateway_active_pipelines")) < 1:
        assert time.monotonic() < deadline, f"no request in progress after {timeout} s:\n{u.text()}"
        time.sleep(0.05)


def test_second_ctrl_c_stops_every_component_now(up):
    u = up()
    u.wait_up()
    children, ports = u.children(), u.ports()
    assert len(children) == 3 and u.port in ports
    _slow_request(f"http://127.0.0.1:{u.port}")
    wait_for_active_pipeline(u)  # the request is in the pipeline: a graceful stop would wait for it
    u.signal_group(signal.SIGINT)
    time.sleep(1.0)
    assert u.proc.poll() is None, "the first Ctrl-C must drain, not exit at once"
    t0 = time.monotonic()
    u.signal_group(signal.SIGINT)
    u.proc.wait(15)
    assert time.monotonic() - t0 < 10
    assert_all_gone(children, ports, within=5.0)
    assert "Traceback" not in u.text(), u.text()


def test_sighup_closing_the_terminal_stops_every_component(up):
    u = up()
    u.wait_up()
    children, ports = u.children(), u.ports()
    u.signal_group(signal.SIGHUP)
    u.proc.wait(60)
    assert_all_gone(children, ports, within=5.0)


def test_two_up_at_the_same_moment_the_loser_says_one_line_and_sigkill_of_the_winner_kills_all(up, tmp_path):
    """Two ``mammoth up`` on one port: the loser ends with one line naming the winner, which comes
    up unaffected; then SIGKILL of that winner kills every one of its components (one ``mammoth
    up`` serves both checks: each start costs 10-30 s of a CI run). The work folder (stage tokens)
    of an earlier ``mammoth up`` killed with SIGKILL is removed by the next one; a live one's is kept."""
    port = free_port()
    tmpdir = tmp_path / "tmp"  # the TMPDIR `Up` gives its `mammoth up`
    tmpdir.mkdir(exist_ok=True)
    stale = tmpdir / "mammoth-up-stale"  # as a SIGKILLed `mammoth up` leaves it: lock not held
    (stale / "tokens").mkdir(parents=True)
    (stale / "owner.lock").touch()
    old = time.time() - 60  # older than WorkFolder.MIN_AGE_S
    os.utime(stale, (old, old))
    a, b = up(port=port), up(port=port)
    deadline = time.monotonic() + 180
    while a.proc.poll() is None and b.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    loser, winner = (a, b) if a.proc.poll() is not None else (b, a)
    assert loser.proc.poll() is not None, "neither mammoth up gave way"
    loser.proc.wait(10)
    time.sleep(0.3)  # the reader threads have the last lines
    assert loser.proc.returncode == 1
    lines = [line for line in loser.err if line.strip()]
    assert len(lines) == 1, loser.text()
    assert f"another mammoth up (pid {winner.proc.pid})" in lines[0], lines
    winner.wait_up()  # the winner is unaffected
    assert not stale.exists(), "the SIGKILLed run's work folder is still there"
    (mine,) = tmpdir.glob("mammoth-up-*")  # the winner's (the loser removed its own)

    children, ports = winner.children(), winner.ports()
    assert len(children) == 3 and port in ports
    os.kill(winner.proc.pid, signal.SIGKILL)
    winner.proc.wait(10)
    assert_all_gone(children, ports, within=5.0)
    from mammoth_app.supervise import WorkFolder
    os.utime(mine, (old, old))
    assert WorkFolder.sweep_stale(tmpdir) == [mine]  # its lock went with it: the next `up` removes it


def test_a_stale_component_on_the_port_is_named(up, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    stale = subprocess.Popen(
        [sys.executable, "-m", "mammoth_app.cli", "gateway", "--port", str(port), "--ar", "127.0.0.1:9",
         "--dit", "127.0.0.1:9", "--log-level", "warning"], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while port_free(port):
            assert time.monotonic() < deadline and stale.poll() is None, "the stale gateway did not listen"
            time.sleep(0.1)
        u = up(port=port)
        assert u.proc.wait(60) == 1
        time.sleep(0.3)
        lines = [line for line in u.err if line.strip()]
        assert len(lines) == 1, u.text()
        assert f"pid {stale.pid}" in lines[0] and "mammoth" in lines[0] and f"kill {stale.pid}" in lines[0], lines
    finally:
        stale.kill()
        stale.wait()


def seed_builtin_tiny(tiny_checkpoint: pathlib.Path, cache: pathlib.Path) -> None:
    """Put the session's tiny checkpoint in ``cache`` as the built-in ``tiny`` one, complete (the same
    files: both are `make_checkpoint`'s ``tiny`` preset with its default seed). ``mammoth up`` making
    it in an empty cache is `test_readme_generate_part_in_a_fresh_clone`'s case."""
    from mammoth_core.checkpoint import builtin_folder

    target = builtin_folder("tiny", cache)
    shutil.copytree(tiny_checkpoint, target)
    (target / ".complete").write_text("ok\n")


def test_local_defaults_suit_the_builtin_checkpoint_and_the_banner_commands_work(up, tiny_checkpoint, tmp_path):
    from PIL import Image

    seed_builtin_tiny(tiny_checkpoint, tmp_path / "cache")
    u = up(checkpoint="builtin://tiny")
    u.wait_up()
    banner = "".join(u.out)
    assert "Request defaults: 256x256, 20 steps" in banner, banner

    # The banner's two commands, pasted into a shell whose PATH has no virtual environment; neither
    # sends a size: their images show the defaults in force.
    commands = [line.strip() for line in banner.splitlines() if " generate " in line or line.strip().startswith("curl")]
    assert len(commands) == 2, banner
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAMMOTH_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (pathlib.Path(p) / "mammoth").exists())
    for command in commands:
        assert "size" not in command and "steps" not in command, command
        work = tmp_path / f"paste{commands.index(command)}"
        work.mkdir()
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        assert len(proc.stdout) < 1000, f"{command!r} printed {len(proc.stdout)} characters"
        (image,) = list(work.iterdir())
        with Image.open(image) as opened:
            assert opened.format == "PNG" and opened.size == (256, 256), (command, opened.format, opened.size)


def instance_lock_running(env: dict[str, str], port: int) -> bool:
    """True once the ``mammoth up`` on ``port`` (cache of ``env``) says it is running."""
    from mammoth_app.background import instance_lock
    return instance_lock(port, env).info().get("state") == "running"


def test_up_detach_then_down(tiny_checkpoint, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAMMOTH_")}
    env["MAMMOTH_CACHE_DIR"] = str(tmp_path / "cache")

    def mammoth(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mammoth_app.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)

    cmd = [sys.executable, "-m", "mammoth_app.cli", "up", "--detach", "--port", str(port), "--checkpoint",
           str(tiny_checkpoint), "--log-level", "warning"]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        first = proc.stdout.readline()  # said at once, not after the whole start-up in silence
        still_starting = proc.poll() is None and not instance_lock_running(env, port)
        out, err = proc.communicate(timeout=240)
    started = subprocess.CompletedProcess(cmd, proc.returncode, first + out, err)
    found = re.search(r"background \(pid (\d+)", started.stdout)
    pid = int(found.group(1)) if found else None
    try:  # every check inside: a failed one must not leave the detached pipeline running
        assert started.returncode == 0 and pid, started.stdout + started.stderr
        assert still_starting and "starting in the background" in first and "up-" in first, first
        assert "Mammoth pipeline is up" in started.stdout and f"mammoth down --port {port}" in started.stdout
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        children = children_of(pid)
        assert len(children) == 3
        (workdir,) = {pathlib.Path(f).parent for c in children for f in ready_files(c)}
        assert (workdir / "tokens").is_dir()
        second = mammoth("up", "--port", str(port), "--checkpoint", str(tiny_checkpoint))
        assert second.returncode == 1 and f"`mammoth down --port {port}`" in second.stderr, second
        ports = sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", started.stdout)})
        stopped = mammoth("down", "--port", str(port))
        assert stopped.returncode == 0 and f"stopped mammoth up (pid {pid})" in stopped.stdout, stopped
        assert not alive(pid)
        assert_all_gone(children, ports, within=5.0)
        assert not workdir.exists(), f"{workdir} (ready files, stage tokens) outlived mammoth up"
        again = mammoth("down", "--port", str(port))
        assert again.returncode == 1 and again.stderr.strip() == f"mammoth down: no mammoth up is running on port {port}"
    finally:
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
        elif pid is None:
            mammoth("down", "--port", str(port), "--timeout", "5")

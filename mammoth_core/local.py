"""``mammoth up``: the whole pipeline as three processes on loopback.

Starts the DiT and AR stages (each on a free port), waits until both report SERVING, then starts the
gateway pointed at them, prints where everything listens, and keeps running until Ctrl-C/SIGTERM,
when it stops the gateway first and the stages after (each drains its in-flight work).

``--generate PROMPT`` instead makes one request through the HTTP API once everything is up, writes
the image to ``--output`` and shuts everything down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from mammoth_core.checkpoint import resolve_checkpoint
from mammoth_core.settings import default_cache_dir

logger = logging.getLogger("mammoth.up")


class StartupError(RuntimeError):
    """A component exited or did not become ready in time; the message names it and its log."""


@dataclasses.dataclass
class Component:
    """A started component process and where it listens."""

    name: str
    proc: subprocess.Popen
    ready_file: pathlib.Path
    address: str = ""
    info: dict = dataclasses.field(default_factory=dict)

    def wait_ready(self, timeout: float) -> str:
        """Block until the component wrote its ready file; returns ``host:port``.

        Raises:
            StartupError: the process exited first, or ``timeout`` seconds passed.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.is_file() and self.ready_file.stat().st_size > 0:
                info = json.loads(self.ready_file.read_text())
                self.info = info
                self.address = info["address"]
                return self.address
            code = self.proc.poll()
            if code is not None:
                raise StartupError(f"{self.name} exited with code {code} before it was ready")
            time.sleep(0.05)
        raise StartupError(f"{self.name} was not ready after {timeout:.0f} s")


def _check_port_free(host: str, port: int) -> None:
    """Raise `StartupError` with a one-line reason when ``host:port`` cannot be bound."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {host}:{port} ({exc.strerror}); choose another port with --port"
            ) from None


def _spawn(name: str, argv: Sequence[str], workdir: pathlib.Path, env: dict[str, str]) -> Component:
    ready = workdir / f"{name}.ready.json"
    cmd = [sys.executable, "-m", "mammoth_core.cli", *argv, "--ready-file", str(ready)]
    logger.debug("starting %s: %s", name, " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    return Component(name=name, proc=proc, ready_file=ready)


def start_pipeline(
    *,
    checkpoint: str = "builtin://tiny",
    host: str = "127.0.0.1",
    gateway_port: int = 8000,
    slots: int = 2,
    config: str | None = None,
    torch_threads: int = 1,
    log_level: str = "info",
    extra_env: dict[str, str] | None = None,
    ready_timeout: float = 300.0,
    workdir: pathlib.Path | None = None,
    ar_args: Sequence[str] = (),
    dit_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> list[Component]:
    """Start DiT, AR and gateway processes; returns them once the gateway is ready.

    Raises:
        StartupError: a component failed to start (the others are stopped).
    """
    env = dict(os.environ)
    env.update(extra_env or {})
    if gateway_port:
        _check_port_free(host, gateway_port)  # fail before the stages spend time loading
    cache_dir = env.get("MAMMOTH_CACHE_DIR") or default_cache_dir()
    ckpt_path = resolve_checkpoint(checkpoint, cache_dir)  # create the built-in one once, up front
    workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="mammoth-up-"))
    common = ["--host", host, "--log-level", log_level]
    if config:
        common += ["--config", config]
    stage = [*common, "--checkpoint", str(ckpt_path), "--port", "0", "--torch-threads", str(torch_threads)]
    components: list[Component] = []
    try:
        dit = _spawn("dit", ["dit", *stage, "--slots", str(slots), "--metrics-port", "0", *dit_args], workdir, env)
        components.append(dit)
        ar = _spawn("ar", ["ar", *stage, "--metrics-port", "0", *ar_args], workdir, env)
        components.append(ar)
        dit_addr = dit.wait_ready(ready_timeout)
        ar_addr = ar.wait_ready(ready_timeout)
        gw = _spawn(
            "gateway",
            ["gateway", *common, "--port", str(gateway_port), "--ar", ar_addr, "--dit", dit_addr, *gateway_args],
            workdir,
            env,
        )
        components.append(gw)
        gw.wait_ready(ready_timeout)
    except BaseException:
        stop_pipeline(components)
        raise
    return components


def stop_pipeline(components: Sequence[Component], timeout: float = 30.0) -> None:
    """SIGTERM the gateway first, then the stages; SIGKILL whatever is left after ``timeout`` s."""
    for comp in sorted(components, key=lambda c: c.name != "gateway"):
        if comp.proc.poll() is None:
            comp.proc.send_signal(signal.SIGTERM)
            try:
                comp.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", comp.name, timeout)
                comp.proc.kill()
                comp.proc.wait()


def _metrics_hint(comp: Component) -> str:
    """``   (metrics http://host:port/metrics)`` for a stage that reported its metrics port."""
    port = comp.info.get("metrics_port")
    if not isinstance(port, int) or port <= 0:
        return ""
    return f"   (metrics http://{comp.address.rsplit(':', 1)[0]}:{port}/metrics)"


def run_up(args: argparse.Namespace) -> int:
    """Implementation of ``mammoth up`` (see the module docstring)."""
    stop = {"flag": False}

    def _on_signal(signum, frame):  # noqa: ARG001
        stop["flag"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    print("mammoth up: preparing the checkpoint and starting DiT, AR and gateway...", flush=True)
    try:
        components = start_pipeline(
            checkpoint=args.checkpoint,
            host=args.host,
            gateway_port=args.port,
            slots=args.slots,
            config=args.config,
            torch_threads=args.torch_threads,
            log_level=args.log_level or ("warning" if args.generate else "info"),
        )
    except StartupError as exc:
        print(f"mammoth up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    by_name = {c.name: c for c in components}
    url = f"http://{by_name['gateway'].address}"
    print(
        "\nMammoth pipeline is up:\n"
        f"  gateway  {url}   (OpenAI images API: POST {url}/v1/images/generations; /metrics, /readyz)\n"
        f"  AR       grpc://{by_name['ar'].address}{_metrics_hint(by_name['ar'])}\n"
        f"  DiT      grpc://{by_name['dit'].address}{_metrics_hint(by_name['dit'])}\n"
        f"Try:  mammoth generate \"a lighthouse at dusk\" --url {url} -o out.png\n"
        f"  or: curl -s {url}/v1/images/generations -H 'content-type: application/json' "
        "-d '{\"prompt\": \"a lighthouse\", \"size\": \"256x256\"}'\n",
        flush=True,
    )
    code = 0
    try:
        if args.generate is not None:
            from mammoth_core.client import generate_to_file

            code = generate_to_file(url, args.generate, args.output, args)
        else:
            print("Press Ctrl-C to stop.", flush=True)
            while all(c.proc.poll() is None for c in components):
                time.sleep(0.5)
            dead = [c.name for c in components if c.proc.poll() is not None]
            print(f"mammoth up: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 0 if stop["flag"] else 130
    finally:
        print("mammoth up: stopping...", flush=True)
        stop_pipeline(components)
    return code

"""The local pipeline: AR, DiT and gateway as three processes on loopback.

`start_pipeline` starts the DiT and AR stages (each on a free port), waits until both report
SERVING, then starts the gateway pointed at them. Each component runs in its own session and dies
with the process that started it (`mammoth_app.supervise.die_with_parent`). `stop_pipeline` stops
the gateway first and the stages after (each drains its in-flight work). The ``mammoth up`` command
around them (signals, instance lock, banner) is `mammoth_app.up`.
"""

from __future__ import annotations

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

from mammoth_app.make_checkpoint import materialize_checkpoint
from mammoth_core.addresses import format_address
from mammoth_core.settings import default_cache_dir
from mammoth_app.supervise import WorkFolder, kill_now, port_holder

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


def _listen_once(host: str, port: int, flag: str) -> int:
    """Bind ``host:port`` as the gateway will (`mammoth_core.runtime.listen_sockets`: every address
    ``host`` resolves to, IPv6 too), close the sockets, return the port bound.

    Raises:
        mammoth_core.runtime.StageStartError: it cannot be bound (`cannot_listen`, naming ``flag``).
    """
    from mammoth_core.runtime import listen_sockets

    sockets = listen_sockets(host, port, flag)
    try:
        return int(sockets[0].getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()


def _check_port_free(host: str, port: int) -> None:
    """Raise `StartupError` with a one-line reason when the gateway could not listen on ``host:port``
    (`_listen_once`); a port in use also names the process holding it."""
    import errno

    from mammoth_core.runtime import StageStartError

    try:
        _listen_once(host, port, "--port")
    except StageStartError as exc:
        message = str(exc)
        holder = port_holder(port) if getattr(exc.__cause__, "errno", None) == errno.EADDRINUSE else None
        if holder:
            kind = "a stale mammoth component" if "mammoth" in holder[1] else "another process"
            message += f" ({kind} holds it, pid {holder[0]}: {holder[1][:120]}; `kill {holder[0]}` frees it)"
        raise StartupError(message) from None


def cache_dir(env: dict[str, str]) -> str:
    """The cache folder (built-in checkpoints, instance locks): ``MAMMOTH_CACHE_DIR`` or the default."""
    return env.get("MAMMOTH_CACHE_DIR") or default_cache_dir()


def generate_role_tokens(workdir: pathlib.Path) -> dict[str, str]:
    """Fresh per-role stage tokens for one run (secure by default).

    Writes ``<workdir>/tokens/gateway.token`` and ``ar.token`` (256 random bits each, URL-safe
    base64, mode 0600 in a 0700 folder) and returns the environment that points every component at
    them (``MAMMOTH_GATEWAY_TOKEN_FILE``, ``MAMMOTH_AR_TOKEN_FILE``).
    """
    import secrets

    folder = pathlib.Path(workdir) / "tokens"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {}
    for role in ("gateway", "ar"):
        path = folder / f"{role}.token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        env[f"MAMMOTH_{role.upper()}_TOKEN_FILE"] = str(path)
    return env


def _auth_configured(env: dict[str, str], config: str | None) -> bool:
    """Whether the caller configured stage auth itself for any component: a token file or
    ``insecure_no_auth`` true, in the environment or the settings file (read as the component will)."""
    from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings, SettingsError, resolve_settings

    for cls in (DiTSettings, ARSettings, GatewaySettings):
        try:
            s = resolve_settings(cls, env=env, config_file=config)
        except SettingsError:
            continue  # the component itself reports the bad setting
        if s.insecure_no_auth or s.auth_token_file or s.gateway_token_file or s.ar_token_file:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound and released: another process could take it), on every
    address ``host`` resolves to (`_listen_once`; IPv6 too).

    Raises:
        StartupError: ``host`` does not resolve, or nothing can be bound on it (the message says which).
    """
    from mammoth_core.runtime import StageStartError

    try:
        return _listen_once(host, 0, "--host")
    except StageStartError as exc:
        raise StartupError(str(exc)) from None


def _spawn(name: str, argv: Sequence[str], workdir: pathlib.Path, env: dict[str, str]) -> Component:
    """Start one component in its own session; it dies with this process (`supervise.die_with_parent`)."""
    ready = workdir / f"{name}.ready.json"
    cmd = [sys.executable, "-m", "mammoth_app.cli", *argv, "--ready-file", str(ready),
           "--parent-pid", str(os.getpid())]
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
    ckpt_path = materialize_checkpoint(checkpoint, cache_dir(env))  # create the built-in one once, up front
    workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix=WorkFolder.PREFIX))
    if not _auth_configured(env, config):
        env.update(generate_role_tokens(workdir))
    # The DiT's port is chosen up front: the AR dials only the DiT it was told about.
    dit_address = format_address(host, free_port(host))
    common = ["--host", host, "--log-level", log_level]
    if config:
        common += ["--config", config]
    stage = [*common, "--checkpoint", str(ckpt_path), "--port", "0", "--torch-threads", str(torch_threads)]
    components: list[Component] = []
    try:
        dit = _spawn("dit", ["dit", *stage, "--port", dit_address.rsplit(":", 1)[1], "--slots", str(slots),
                             "--metrics-port", "0", *dit_args], workdir, env)
        components.append(dit)
        # The AR may push to its own DiT and to whatever MAMMOTH_DIT_ALLOW_LIST adds.
        allowed = ",".join(filter(None, [dit_address, env.get("MAMMOTH_DIT_ALLOW_LIST")]))
        ar = _spawn("ar", ["ar", *stage, "--metrics-port", "0", "--dit-allow-list", allowed, *ar_args],
                    workdir, env)
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
    """SIGTERM the gateway first, then the stages; SIGKILL whatever is left after ``timeout`` s.

    A `KeyboardInterrupt` while waiting (the second Ctrl-C) kills every remaining component at once
    (`supervise.kill_now`) and is raised again.
    """
    try:
        for comp in sorted(components, key=lambda c: c.name != "gateway"):
            if comp.proc.poll() is None:
                comp.proc.send_signal(signal.SIGTERM)
                try:
                    comp.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within %.0f s; killing it", comp.name, timeout)
                    kill_now(comp.proc)
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third Ctrl-C changes nothing
        try:
            for comp in components:
                kill_now(comp.proc)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise

"""``mammoth up``: the whole pipeline on this machine, as a command a person runs in a terminal.

Around `mammoth_app.local.start_pipeline` (which starts the three processes) this adds:

- one instance per gateway port: ``mammoth up`` holds `supervise.InstanceLock` for its port, so a
  second one on the same port, started at the same moment or later, ends with one line naming the
  first (pid, URL); a port held by any other process is named too (`supervise.port_holder`);
- signals: Ctrl-C, SIGTERM and SIGHUP (the terminal was closed) stop the gateway first, then the
  stages, each draining its work; a second one stops everything at once (SIGKILL). Whatever ends
  ``mammoth up``, SIGKILL included, its components die with it (`supervise.die_with_parent`);
- request defaults for the built-in checkpoint (`LOCAL_REQUEST_DEFAULTS`), unless the environment
  or the ``--config`` file sets them; the banner states the defaults in force;
- one line, never a traceback, for a missing checkpoint folder, an unusable ``--config`` file, a
  ``--host`` that is not this machine's or an unusable ``MAMMOTH_CACHE_DIR``;
- exit status: 0 when a SIGTERM stops serving, ``128 + signal`` otherwise, and always with
  ``--generate`` once a signal stopped it before the image was written;
- a private work folder (``$TMPDIR/mammoth-up-*``: the components' ready files and the run's stage
  tokens), removed once the components have stopped; after a SIGKILL of ``mammoth up`` the next
  ``mammoth up`` removes it (`supervise.WorkFolder`).

``--generate PROMPT`` instead makes one request through the HTTP API once everything is up, writes
the image to ``--output`` and shuts everything down.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import pathlib
import shlex
import shutil
import signal
import socket
import sys
import time

import yaml

from mammoth_core import settings as settings_mod
from mammoth_core.checkpoint import BUILTIN_SCHEME, CheckpointError, check_files, resolve_checkpoint
from mammoth_app.local import Component, StartupError, cache_dir, start_pipeline, stop_pipeline
from mammoth_app.supervise import AlreadyRunning, InstanceLock, WorkFolder

#: Gateway request defaults with a built-in checkpoint (random weights: its images are noise), sized
#: so that a request without ``size``/``num_inference_steps`` takes seconds on a CPU.
LOCAL_REQUEST_DEFAULTS = {"default_size": "256x256", "default_steps": 20}


def _say(text: str, err: bool = False) -> None:
    """Print and flush; a closed terminal (SIGHUP) must not stop the shutdown."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


def local_gateway_settings(checkpoint: str, env: dict[str, str], config: str | None) -> dict[str, object]:
    """`LOCAL_REQUEST_DEFAULTS` not set by the environment or the config file (built-in only); the
    local ``default_steps`` at most the ``max_steps`` the environment or the file sets (else the
    gateway would refuse a default the user never set)."""
    if not checkpoint.startswith(BUILTIN_SCHEME):
        return {}
    config = config or env.get(settings_mod.ENV_PREFIX + "CONFIG")
    in_file = settings_mod.read_config_file(config, "gateway") if config else {}

    def user_value(key: str) -> object:
        return env.get(settings_mod.ENV_PREFIX + key.upper(), in_file.get(key))

    local = {k: v for k, v in LOCAL_REQUEST_DEFAULTS.items() if user_value(k) is None}
    if "default_steps" in local:
        try:
            cap = int(str(user_value("max_steps")))
        except ValueError:  # not set (None), or not a number: the gateway's validation says so
            cap = 0
        if cap >= 1:  # (below 1 the gateway refuses max_steps itself)
            local["default_steps"] = min(int(local["default_steps"]), cap)
    return local


def _preflight(args: argparse.Namespace, env: dict[str, str]) -> dict[str, object]:
    """Check what can be checked before any process starts; returns the gateway's local defaults.

    Raises:
        StartupError: ``--generate``'s ``--output`` cannot be written (`client.output_problem`), or its
            ``--size`` or ``--steps`` is one the gateway would refuse (`gateway.image_job.parse_size`,
            `mammoth_core.limits.check_steps`).
        CheckpointError: ``--checkpoint`` names no usable checkpoint folder.
        settings_mod.SettingsError: the ``--config`` file is missing or not a YAML mapping.
    """
    if args.generate is not None:
        from mammoth_app.client import output_problem

        problem = output_problem(args.output, args.format)
        if problem:
            raise StartupError(problem)
    if args.config and not pathlib.Path(args.config).is_file():
        raise settings_mod.SettingsError(f"--config {args.config}: no such file")
    if not args.checkpoint.startswith(BUILTIN_SCHEME):
        folder = resolve_checkpoint(args.checkpoint, cache_dir(env))
        problems = check_files(folder)
        if problems:
            raise CheckpointError(args.checkpoint, problems)
    try:
        overrides = local_gateway_settings(args.checkpoint, env, args.config)
        # the defaults in force, with the precedence the gateway applies (for the banner)
        effective = settings_mod.resolve_settings(settings_mod.GatewaySettings, cli=overrides, env=env,
                                                  config_file=args.config)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:  # one line, not a traceback
        raise settings_mod.SettingsError(" ".join(f"--config {args.config}: {exc}".split())) from None
    if args.generate is not None and args.size is not None:
        from gateway.errors import InvalidRequestError
        from gateway.image_job import parse_size  # the gateway's own rule, with the settings it will have

        try:
            parse_size(args.size, effective)
        except InvalidRequestError as exc:
            raise StartupError(f"--size {args.size}: {exc.message}") from None
    if args.generate is not None and getattr(args, "steps", None) is not None:
        from mammoth_core import limits

        # the rule and limits of both components that enforce them: the gateway's, then the DiT's
        # (a config file's ``dit:`` section may set its own max_steps)
        dit = settings_mod.resolve_settings(settings_mod.DiTSettings, env=env, config_file=args.config,
                                            warn_unknown_keys=False)
        try:
            for component in (effective, dit):
                limits.check_steps(args.steps, limits.from_settings(component))
        except limits.LimitError as exc:
            raise StartupError(f"--steps {args.steps}: {exc.message}") from None
    return {"overrides": overrides, "effective": effective}


def _checkpoint_message(exc: CheckpointError) -> str:
    return (f"--checkpoint {exc.path}: {'; '.join(exc.problems[:3])}; give a checkpoint folder (check it "
            "with `mammoth check-checkpoint DIR`) or leave --checkpoint out for the built-in one")


def mammoth_command() -> str:
    """How to run this ``mammoth`` from another terminal: ``mammoth`` when PATH finds this one, else
    its full path (``python -m mammoth_app.cli`` when run from a source tree without the script)."""
    here = pathlib.Path(sys.executable).parent / "mammoth"
    if not here.is_file():
        return f"{shlex.quote(sys.executable)} -m mammoth_app.cli"
    on_path = shutil.which("mammoth")
    if on_path and pathlib.Path(on_path).resolve() == here.resolve():
        return "mammoth"
    return shlex.quote(str(here))


def curl_example(url: str, output: str = "lighthouse.png") -> str:
    """A ``curl`` line that writes the image to ``output`` (no base64 on the terminal)."""
    request = (f"curl -s {url}/v1/images/generations -H 'content-type: application/json' "
               "-d '{\"prompt\": \"a lighthouse\"}'")
    if shutil.which("jq") and shutil.which("base64"):
        return f"{request} | jq -r '.data[0].b64_json' | base64 -d > {output}"
    python = "python3" if shutil.which("python3") else shlex.quote(sys.executable)
    return (f"{request} | {python} -c 'import base64, json, sys; sys.stdout.buffer.write("
            f"base64.b64decode(json.load(sys.stdin)[\"data\"][0][\"b64_json\"]))' > {output}")


def _metrics_hint(comp: Component) -> str:
    """``   (metrics http://host:port/metrics)`` for a stage that reported its metrics port."""
    port = comp.info.get("metrics_port")
    if not isinstance(port, int) or port <= 0:
        return ""
    return f"   (metrics http://{comp.address.rsplit(':', 1)[0]}:{port}/metrics)"


def banner(components: list[Component], gateway: settings_mod.GatewaySettings, local_defaults: bool,
           try_commands: bool = True) -> str:
    """What ``mammoth up`` prints once everything is ready (``try_commands``: two commands to paste)."""
    by_name = {c.name: c for c in components}
    url = f"http://{by_name['gateway'].address}"
    why = ("sized for the built-in checkpoint on a CPU; a request's size and num_inference_steps win"
           if local_defaults else "a request's size and num_inference_steps win")
    text = (
        "\nMammoth pipeline is up:\n"
        f"  gateway  {url}   (OpenAI images API: POST {url}/v1/images/generations; /metrics, /readyz)\n"
        f"  AR       grpc://{by_name['ar'].address}{_metrics_hint(by_name['ar'])}\n"
        f"  DiT      grpc://{by_name['dit'].address}{_metrics_hint(by_name['dit'])}\n"
        f"Request defaults: {gateway.default_size}, {gateway.default_steps} steps ({why}).\n"
    )
    if try_commands:
        text += ("Try, in another terminal:\n"
                 f"  {mammoth_command()} generate \"a lighthouse at dusk\" --url {url} -o lighthouse.png\n"
                 f"  {curl_example(url)}\n")
    return text


def _install_signal_handlers() -> dict[str, int | None]:
    """SIGINT, SIGTERM and SIGHUP raise `KeyboardInterrupt`; the first signal's number is kept."""
    state: dict[str, int | None] = {"signal": None}

    def on_signal(signum, frame):  # noqa: ARG001
        if state["signal"] is None:
            state["signal"] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return state


def _shutdown(components: list[Component]) -> None:
    """Stop gracefully; a second signal while stopping kills everything now."""
    if not any(c.proc.poll() is None for c in components):
        return
    _say("mammoth up: stopping (Ctrl-C again to stop now)...")
    try:
        stop_pipeline(components)
    except KeyboardInterrupt:
        _say("mammoth up: stopped now (every component killed)", err=True)


def _exit_code(signum: int | None, generate: bool = False) -> int:
    """The exit status after ``signum`` stopped ``mammoth up``: 0 for a SIGTERM that stopped a
    plain ``up`` (serving ended as asked), else ``128 + signum``; with ``--generate`` a signal
    always means the image was not written (a SIGTERM used to exit 0 with no file)."""
    if signum is None or (signum == signal.SIGTERM and not generate):
        return 0
    return 128 + int(signum)


def _os_error_message(exc: OSError, args: argparse.Namespace, env: dict[str, str]) -> str:
    """One line for an `OSError` while starting: the file it names (under ``MAMMOTH_CACHE_DIR``
    when it is there) or the address it could not use."""
    if exc.filename is not None:
        where = str(exc.filename)
        cache = cache_dir(env)
        hint = (f"; check {settings_mod.ENV_PREFIX}CACHE_DIR ({cache})"
                if where.startswith(str(cache)) else "")
        return f"{where}: {exc.strerror or exc}{hint}"
    if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EACCES):
        return (f"cannot listen on --host {args.host} --port {args.port} ({exc.strerror or exc}); "
                "give an address of this machine (127.0.0.1: this machine only)")
    return f"cannot start the pipeline: {exc.strerror or exc}"


def _start(args: argparse.Namespace, env: dict[str, str], workdir: pathlib.Path
           ) -> tuple[list[Component], dict[str, object]]:
    plan = _preflight(args, env)
    flags = [a for k, v in plan["overrides"].items() for a in ("--" + k.replace("_", "-"), str(v))]
    _say("mammoth up: preparing the checkpoint and starting DiT, AR and gateway...")
    components = start_pipeline(
        checkpoint=args.checkpoint, host=args.host, gateway_port=args.port, slots=args.slots,
        config=args.config, torch_threads=args.torch_threads,
        log_level=args.log_level or ("warning" if args.generate else "info"), gateway_args=flags,
        workdir=workdir,
    )
    return components, plan


def run_up(args: argparse.Namespace) -> int:
    """Implementation of ``mammoth up`` (see the module docstring); returns the exit code."""
    env = dict(os.environ)
    state = _install_signal_handlers()
    lock = InstanceLock(pathlib.Path(cache_dir(env)) / "run", args.port) if args.port else None
    components: list[Component] = []
    WorkFolder.sweep_stale()  # folders of `mammoth up`s killed with SIGKILL (their stage tokens)
    work = WorkFolder()  # ready files, stage tokens
    workdir = work.path
    try:
        try:
            if lock:
                lock.acquire()
            components, plan = _start(args, env, workdir)
        except (AlreadyRunning, StartupError, settings_mod.SettingsError) as exc:
            _say(f"mammoth up: {exc}", err=True)
            return 1
        except CheckpointError as exc:
            _say(f"mammoth up: {_checkpoint_message(exc)}", err=True)
            return 1
        except KeyboardInterrupt:
            return _exit_code(state["signal"] or signal.SIGINT, args.generate is not None)
        except OSError as exc:  # a --host that is not this machine's, an unusable cache folder
            _say(f"mammoth up: {_os_error_message(exc, args, env)}", err=True)
            return 1
        return _serve(args, components, plan, lock, state)
    finally:
        _shutdown(components)
        work.remove()  # the components are gone: nothing reads it now
        if lock:
            lock.release()


def _serve(args: argparse.Namespace, components: list[Component], plan: dict[str, object],
           lock: InstanceLock | None, state: dict[str, int | None]) -> int:
    """Print the banner, then run ``--generate`` or wait for a signal or a component's exit."""
    url = f"http://{next(c for c in components if c.name == 'gateway').address}"
    try:
        _say(banner(components, plan["effective"], bool(plan["overrides"]), args.generate is None))
        if lock:  # after the banner: `up --detach` prints it from the log once it reads "running"
            lock.update(state="running", url=url, components={c.name: c.proc.pid for c in components})
        if args.generate is not None:
            from mammoth_app.client import generate_to_file

            return generate_to_file(url, args.generate, args.output, args)
        _say("Press Ctrl-C to stop.")
        while all(c.proc.poll() is None for c in components):
            time.sleep(0.5)
        dead = [c.name for c in components if c.proc.poll() is not None]
        _say(f"mammoth up: {', '.join(dead)} exited; stopping the rest", err=True)
        return 1
    except KeyboardInterrupt:
        return _exit_code(state["signal"] or signal.SIGINT, args.generate is not None)

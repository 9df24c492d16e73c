"""The ``mammoth`` command: one entry point for every component and the local tools.

Subcommands:
  up                 the whole pipeline locally (AR, DiT, gateway as processes on 127.0.0.1)
  down               stop the ``mammoth up`` of a port (``up --detach`` runs it in the background)
  ar | dit | gateway one component, as its container runs it
  operator           the Kubernetes operator (kopf)
  generate           call a gateway and write the image, with a progress display
  make-checkpoint    write the small built-in checkpoint (real layout, random weights)
  check-checkpoint   validate a checkpoint folder against the model its configs describe
  quantize-checkpoint  copy a checkpoint with the AR's visual-token weights stored as FP8
  download-model     fetch ``hf://org/repo@revision`` into a folder (init container)
  bench              serving benchmark against a gateway URL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
from typing import Iterator, Sequence

from mammoth_core import settings as settings_mod
from mammoth_core.logging import setup_logging
from mammoth_core.runtime import StageStartError, exit_after_drain

logger = logging.getLogger("mammoth")


class CommandError(RuntimeError):
    """An ordinary mistake or an unreachable service: `main` prints the message as one line, exit 1."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for every flag with a real default (not for None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == "" \
                or not action.option_strings:  # `is`: a default of 0 is shown (0 == False)
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (``mammoth up: argument --port: ... (see --help)``), exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _component_parser(sub: argparse._SubParsersAction, name: str, cls: type, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    settings_mod.add_arguments(p, cls)
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # set by `mammoth up`
    p.set_defaults(settings_cls=cls)


def _settings_from_args(args: argparse.Namespace) -> settings_mod.BaseSettings:
    if args.parent_pid is not None:  # started by `mammoth up`: end with it, whatever ends it
        from mammoth_app.supervise import die_with_parent

        die_with_parent(args.parent_pid)
    cls = args.settings_cls
    names = {f for f in cls.__dataclass_fields__} | {"config"}
    explicit = {k: v for k, v in vars(args).items() if k in names}
    return settings_mod.resolve_settings(cls, cli=explicit, warn_unknown_keys=args.parent_pid is None)


def _apply_torch_threads(s: settings_mod.StageSettings) -> None:
    if getattr(s, "torch_threads", 0):
        import torch

        torch.set_num_threads(int(s.torch_threads))


def _materialize_builtin(s: settings_mod.StageSettings) -> None:
    """Make a ``builtin://`` checkpoint in the cache before the stage starts (the stage only finds
    it there: making it builds both stages' models, which is this layer's business)."""
    from mammoth_core.checkpoint import BUILTIN_SCHEME

    if s.checkpoint.startswith(BUILTIN_SCHEME):
        from mammoth_app.make_checkpoint import materialize_checkpoint

        materialize_checkpoint(s.checkpoint, s.cache_dir)


def _run_stage(args: argparse.Namespace, role: str) -> int:
    """`mammoth ar` / `mammoth dit`: settings, logging, torch threads, the built-in checkpoint, then
    the stage's ``serve`` (imported only now: the gateway and operator never load torch)."""
    s = _settings_from_args(args)
    setup_logging(role, s.log_format, s.log_level)
    _apply_torch_threads(s)
    _materialize_builtin(s)
    if role == "ar":
        from stage_ar.server import serve
    else:
        from stage_dit.server import serve

    try:
        asyncio.run(serve(s, ready_file=args.ready_file))
    except StageStartError as exc:  # what it was given is unusable: one error line in the stage's log
        logging.getLogger("mammoth_app.cli").error("%s", exc)
        exit_after_drain(1)
    exit_after_drain(0)  # skip the interpreter's slow teardown (mammoth_core.runtime)


def cmd_ar(args: argparse.Namespace) -> int:
    return _run_stage(args, "ar")


def cmd_dit(args: argparse.Namespace) -> int:
    return _run_stage(args, "dit")


def cmd_gateway(args: argparse.Namespace) -> int:
    s = _settings_from_args(args)
    setup_logging("gateway", s.log_format, s.log_level)
    from gateway.app import serve

    try:
        asyncio.run(serve(s, ready_file=args.ready_file))
    except StageStartError as exc:  # a port it cannot listen on: one error line, as the stages
        logging.getLogger("mammoth_app.cli").error("%s", exc)
        return 1
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    setup_logging("operator", args.log_format, args.log_level)
    import mammoth_operator

    mammoth_operator.run(
        namespaces=args.namespace or None,
        all_namespaces=args.all_namespaces,
        liveness=args.liveness,
        metrics_port=(args.metrics_port if args.metrics_port is not None
                      else int(os.environ.get("MAMMOTH_OPERATOR_METRICS_PORT") or -1)),
    )
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "info")
    from mammoth_app.make_checkpoint import make_checkpoint

    try:
        path = make_checkpoint(args.dir, preset=args.preset, seed=args.seed)
    except (ValueError, OSError) as exc:
        raise CommandError(f"{exc}; give an empty or new folder") from None
    print(path)
    return 0


def cmd_check_checkpoint(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "warning")
    from mammoth_app.check_checkpoint import check_checkpoint

    report = check_checkpoint(args.dir)
    print(report.render())
    return 0 if report.ok else 1


@contextlib.contextmanager
def _ending_signals_unwind() -> Iterator[None]:
    """Within: SIGTERM (how Kubernetes ends a pod) and SIGHUP (a closed terminal) raise
    ``SystemExit(128 + signal)`` as SIGINT raises KeyboardInterrupt, so that the command's clean-up runs
    (a partial copy removed) before the process exits with the status a shell gives a process that
    signal ended. A second one during the clean-up is ignored; the previous handlers are restored."""
    ending = (signal.SIGTERM, signal.SIGHUP)

    def unwind(signum: int, _frame: object) -> None:
        for sig in ending:
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, unwind) for sig in ending}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_quantize_checkpoint(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "info")
    from mammoth_core.checkpoint import CheckpointError
    from stage_ar.fp8_checkpoint import write_fp8_checkpoint

    try:
        with _ending_signals_unwind():
            path = write_fp8_checkpoint(args.source, args.dest)
    except CheckpointError as exc:
        raise CommandError(f"{exc.path}: " + "; ".join(exc.problems[:3])
                           + (f" (and {len(exc.problems) - 3} more: mammoth check-checkpoint)"
                              if len(exc.problems) > 3 else "")) from None
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc).replace("\n", " ")) from None
    print(path)
    return 0


def cmd_download_model(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "info")
    from mammoth_core.model_source import download_model

    try:
        download_model(args.uri, args.dest)
    except (ValueError, OSError, ImportError) as exc:
        raise CommandError(str(exc).replace("\n", " ")) from None
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", args.log_level or "info")
    if args.detach:
        from mammoth_app.background import detach

        if args.generate is not None:
            raise CommandError("--detach and --generate do not go together: --generate stops after one image")
        return detach([a for a in args.argv[1:] if a != "--detach"], args.port)
    from mammoth_app.up import run_up

    args.api_key = _api_key(args)
    return run_up(args)


def cmd_down(args: argparse.Namespace) -> int:
    from mammoth_app.background import down

    return down(args.port, timeout=args.timeout)


def cmd_generate(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "warning")
    from mammoth_app.client import run_generate

    args.api_key = _api_key(args)
    return run_generate(args)


def cmd_bench(args: argparse.Namespace) -> int:
    setup_logging("cli", "text", "warning")
    from mammoth_app.bench import run_bench

    args.api_key = _api_key(args)
    return run_bench(args)


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``OPENAI_API_KEY`` (read here, not at parse time: help never shows it)."""
    return args.api_key or os.environ.get("OPENAI_API_KEY") or None


def port_number(value: str) -> int:
    """An argparse type: a TCP port, an integer 0-65535 (0: any free one).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints its message, not this function's name).
    """
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= settings_mod.MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give an integer 0-{settings_mod.MAX_PORT} "
                                         "(0: any free port)")
    return port


def _float_or_nan(value: str) -> float:
    """``float(value)``, or nan where it is not a number (the argparse types below refuse nan)."""
    try:
        return float(value)
    except ValueError:
        return math.nan


def positive_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds above 0.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    seconds = _float_or_nan(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value}: give a number of seconds above 0")
    return seconds


def finite_number(value: str) -> float:
    """An argparse type: a finite float (no nan or inf, which JSON cannot carry).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    number = _float_or_nan(value)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value}: give a finite number")
    return number


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``generate`` and ``up --generate``."""
    p.add_argument("--size", default=None,
                   help="WIDTHxHEIGHT, multiples of 16 (default: the gateway's default_size; 256x256 "
                        "with mammoth up's built-in checkpoint)")
    p.add_argument("--steps", type=int, default=None,
                   help="num_inference_steps (default: the gateway's default_steps; 20 with mammoth "
                        "up's built-in checkpoint)")
    p.add_argument("--guidance", type=finite_number, default=None,
                   help="text_guidance_scale (default: the gateway's)")
    p.add_argument("--seed", type=int, default=None, help="seed (random when omitted)")
    p.add_argument("--negative-prompt", default=None, help="what the image should not show")
    p.add_argument("--format", default="png", choices=("png", "jpeg", "webp"),
                   help="image format; must agree with the output file's extension")
    p.add_argument("--api-key", default=None, help="gateway API key (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds to wait for the image")
    p.add_argument("--no-progress", action="store_true", help="no progress display")


def _up_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run the whole pipeline locally (AR, DiT, gateway processes)",
                        description="Run the whole pipeline locally: AR, DiT and gateway processes on "
                                    "loopback. Ctrl-C stops them (twice: at once).")
    up.add_argument("--checkpoint", default="builtin://tiny", help="checkpoint folder or builtin://tiny")
    up.add_argument("--host", default="127.0.0.1", help="address every component listens on")
    up.add_argument("--port", type=port_number, default=8000, help="gateway HTTP port (0: any free)")
    up.add_argument("--slots", type=int, default=2, help="DiT slots (images denoised at once)")
    up.add_argument("--config", default=None, help="YAML settings file passed to every component")
    up.add_argument("--log-level", default=None,
                    help="components' log level (default info; warning with --generate, so their "
                         "per-request lines do not break the progress display)")
    up.add_argument("--torch-threads", type=int, default=1, help="torch threads per stage process")
    up.add_argument("--generate", metavar="PROMPT", default=None,
                    help="generate one image through the HTTP API, write it to --output, then stop")
    up.add_argument("-o", "--output", default="mammoth.png", help="with --generate: output file")
    up.add_argument("--detach", action="store_true",
                    help="run in the background once up (log in the cache's run/ folder); stop it with "
                         "mammoth down")
    add_generate_arguments(up)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the mammoth up running on a port (detached or not)")
    down.add_argument("--port", type=port_number, default=8000, help="the gateway port of that mammoth up")
    down.add_argument("--timeout", type=positive_seconds, default=60.0,
                      help="seconds to let it drain before it is killed")
    down.set_defaults(func=cmd_down)


def _tool_parsers(sub: argparse._SubParsersAction) -> None:
    from mammoth_app.make_checkpoint import PRESETS

    gen = sub.add_parser("generate", help="generate an image through a gateway")
    gen.add_argument("prompt", help="what the image should show")
    gen.add_argument("-o", "--output", default="mammoth.png", help="output file (its folder must exist)")
    gen.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    mk = sub.add_parser("make-checkpoint", help="write the built-in small checkpoint to DIR")
    mk.add_argument("dir", help="new or empty folder")
    mk.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="checkpoint dimensions")
    mk.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    mk.set_defaults(func=cmd_make_checkpoint)

    ck = sub.add_parser("check-checkpoint", help="validate a checkpoint folder (no GPU, no weights loaded)")
    ck.add_argument("dir", help="checkpoint folder (config.json, safetensors, tokenizer files)")
    ck.set_defaults(func=cmd_check_checkpoint)

    qc = sub.add_parser("quantize-checkpoint",
                        help="copy a checkpoint with the AR's visual-token weights stored as FP8 E4M3 "
                             "(loaded as they are by weights_dtype fp8 or fp8-w8a8)")
    qc.add_argument("source", help="checkpoint folder (bf16 or float32 weights)")
    qc.add_argument("dest", help="new or empty folder for the copy")
    qc.set_defaults(func=cmd_quantize_checkpoint)

    dl = sub.add_parser("download-model", help="download hf://org/repo@revision into DEST")
    dl.add_argument("uri", help="hf://org/repo or hf://org/repo@revision")
    dl.add_argument("dest", help="folder to download into (created)")
    dl.set_defaults(func=cmd_download_model)

    bench = sub.add_parser("bench", help="serving benchmark against a gateway")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    bench.add_argument("--concurrency", default="1,2,4", help="requests kept in flight (comma list)")
    bench.add_argument("--requests", type=int, default=8, help="timed requests per level")
    bench.add_argument("--warmup", type=int, default=1, help="untimed requests before each level")
    bench.add_argument("--size", default="256x256", help="WIDTHxHEIGHT (comma list)")
    bench.add_argument("--ar-grid", default="", help="ar_grid per level, e.g. auto,32x32 (comma list; "
                       "default: none sent, the gateway's default_ar_grid)")
    bench.add_argument("--steps", default="20", help="num_inference_steps (comma list)")
    bench.add_argument("--json", default=None, help="write results as JSON to this file")
    bench.add_argument("--api-key", default=None, help="gateway API key (default: $OPENAI_API_KEY)")
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    """The ``mammoth`` argument parser (help pages show every default; errors are one line)."""
    parser = _Parser(prog="mammoth", description=__doc__.split("\n")[0].replace("``", "")
                     + " `mammoth COMMAND --help` lists a command's flags.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _up_parser(sub)

    _component_parser(sub, "ar", settings_mod.ARSettings, "run the AR stage (gRPC)")
    _component_parser(sub, "dit", settings_mod.DiTSettings, "run the DiT stage (gRPC)")
    _component_parser(sub, "gateway", settings_mod.GatewaySettings, "run the HTTP gateway")
    for name, fn in (("ar", cmd_ar), ("dit", cmd_dit), ("gateway", cmd_gateway)):
        sub.choices[name].set_defaults(func=fn)

    op = sub.add_parser("operator", help="run the Kubernetes operator")
    op.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    op.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint")
    op.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus /metrics port: reconcile counts and durations (default: env "
                         "MAMMOTH_OPERATOR_METRICS_PORT, else -1: off)")
    op.add_argument("--log-format", default="text", choices=("text", "json"), help="log line format")
    op.add_argument("--log-level", default="info", help="log level (debug, info, warning, error)")
    op.set_defaults(func=cmd_operator)
    _tool_parsers(sub)
    for choice in sub._choices_actions:  # a page without its own description says what `mammoth --help` says
        page = sub.choices[choice.dest]
        page.description = page.description or choice.help
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mammoth`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except settings_mod.SettingsError as exc:
        print(f"mammoth: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"mammoth {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

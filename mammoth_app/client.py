"""``mammoth generate``: call a gateway's images API and write the image, with live progress.

Uses the streaming form of ``POST /v1/images/generations`` (``stream: true``, server-sent events):
``image_generation.progress`` (our documented extension: AR tokens, DiT steps) drives the progress
display, ``image_generation.completed`` carries the image (``b64_json``). Errors come back in the
OpenAI envelope and are printed as such.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import sys
import time
from typing import Any, Iterator

import httpx


class GenerateError(RuntimeError):
    """The gateway answered with an error (message from its OpenAI error envelope)."""


def _sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Decode ``data: {...}`` server-sent events into dicts (``event:`` lines are advisory)."""
    data_lines: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data_lines.append(line[5:].strip())
        elif line == "" and data_lines:
            payload = "\n".join(data_lines)
            data_lines = []
            if payload == "[DONE]":
                return
            yield json.loads(payload)
    if data_lines and data_lines != ["[DONE]"]:
        yield json.loads("\n".join(data_lines))


class ProgressLine:
    """A one-line progress display on stderr: ``AR 120/273 tokens | DiT 3/20 steps``.

    On a terminal the line is redrawn in place at most every `TERMINAL_INTERVAL_S`; otherwise (a
    log file, a pipe) a whole line is written at most every `LOG_INTERVAL_S`, and on a forced update.
    """

    TERMINAL_INTERVAL_S = 0.1
    LOG_INTERVAL_S = 10.0

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.ar = (0, 0)
        self.dit = (0, 0)
        self._last = 0.0
        self._drawn = False

    @staticmethod
    def _bar(done: int, total: int, width: int = 20) -> str:
        filled = int(width * done / total) if total else 0
        return "#" * filled + "-" * (width - filled)

    def update(self, event: dict[str, Any], force: bool = False) -> None:
        if not self.enabled:
            return
        if "tokens_generated" in event or "total_tokens" in event:
            self.ar = (int(event.get("tokens_generated", self.ar[0])), int(event.get("total_tokens", self.ar[1])))
        if "step" in event or "total_steps" in event:
            self.dit = (int(event.get("step", self.dit[0])), int(event.get("total_steps", self.dit[1])))
        now = time.monotonic()
        interval = self.TERMINAL_INTERVAL_S if self.tty else self.LOG_INTERVAL_S
        if not force and self._drawn and now - self._last < interval:
            return
        self._last = now
        line = (
            f"AR [{self._bar(*self.ar)}] {self.ar[0]}/{self.ar[1] or '?'} tokens  "
            f"DiT [{self._bar(*self.dit)}] {self.dit[0]}/{self.dit[1] or '?'} steps"
        )
        sys.stderr.write("\r" + line if self.tty else line + "\n")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        """End the progress line (nothing when nothing was drawn, or each line ended already)."""
        if self.enabled and self._drawn and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def request_body(prompt: str, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    """The JSON body for ``POST /v1/images/generations`` from CLI arguments."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n": 1,
        "response_format": "b64_json",
        "output_format": args.format,
        "stream": stream,
    }
    if stream:
        body["partial_images"] = 0
        body["stream_progress"] = True  # the progress display reads the extension events
    if args.size is not None:
        body["size"] = args.size
    if args.steps is not None:
        body["num_inference_steps"] = args.steps
    if args.guidance is not None:
        body["text_guidance_scale"] = args.guidance
    if args.seed is not None:
        body["seed"] = args.seed
    if args.negative_prompt:
        body["negative_prompt"] = args.negative_prompt
    return body


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        err = json.loads(response.read())["error"]
        message = f"{response.status_code} {err.get('type', '')}: {err.get('message', '')}"
        if err.get("param"):
            message += f" (param: {err['param']})"
    except Exception:  # noqa: BLE001 - not an envelope: not a mammoth gateway (or a proxy in front of one)
        message = (f"{response.url} answered HTTP {response.status_code} {response.reason_phrase} without "
                   "an OpenAI error envelope: is it a mammoth gateway? Check --url")
    raise GenerateError(message)


def generate(url: str, prompt: str, args: argparse.Namespace) -> tuple[bytes, dict[str, Any]]:
    """One image from the gateway at ``url``; returns (image bytes, completed event).

    Raises:
        GenerateError: the gateway answered an error, or the stream ended without an image.
        httpx.HTTPError: the gateway could not be reached.
    """
    headers = {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}
    progress = ProgressLine(enabled=not getattr(args, "no_progress", False))
    body = request_body(prompt, args, stream=True)
    try:
        with httpx.stream(
            "POST", f"{url.rstrip('/')}/v1/images/generations", json=body, headers=headers,
            timeout=httpx.Timeout(args.timeout, connect=10.0),
        ) as response:
            _raise_for_error(response)
            for event in _sse_events(response):
                kind = event.get("type", "")
                if kind == "error" or "error" in event:
                    err = event.get("error", event)
                    raise GenerateError(f"{err.get('type', 'error')}: {err.get('message', err)}")
                if kind.endswith("progress"):
                    progress.update(event)
                elif kind.endswith("completed"):
                    progress.update(event, force=True)
                    return base64.b64decode(event["b64_json"]), event
    finally:
        progress.close()
    raise GenerateError("the stream ended without an image")


#: File extensions each ``--format`` may be written to.
EXTENSIONS = {"png": (".png",), "jpeg": (".jpg", ".jpeg"), "webp": (".webp",)}


def output_problem(output: str, fmt: str) -> str | None:
    """Why ``output`` cannot receive a ``fmt`` image (checked before any request), else None."""
    path = pathlib.Path(output)
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        return f"-o {output}: {folder} is a file, not a folder; choose another path"
    if not folder.is_dir():
        return f"-o {output}: the folder {folder} does not exist; create it or choose another path"
    if not os.access(folder, os.W_OK):
        return f"-o {output}: the folder {folder} is not writable; choose another path"
    if path.is_dir():
        return f"-o {output} is a folder; give a file name such as {path / ('image' + EXTENSIONS[fmt][0])}"
    problem = _cannot_create(path)
    if problem:
        return f"-o {output}: cannot write there ({problem}); choose another path"
    ext = path.suffix.lower()
    known = {e for exts in EXTENSIONS.values() for e in exts}
    if ext in known and ext not in EXTENSIONS[fmt]:
        return (f"-o {output} is a {ext[1:]} file name but --format is {fmt}: use "
                f"-o {path.with_suffix(EXTENSIONS[fmt][0])} or --format {_format_of(ext)}")
    return None


def _cannot_create(path: pathlib.Path) -> str | None:
    """Why ``path`` cannot be opened for writing (the OS's reason), else None; a file this creates
    is removed again. ``os.access`` says yes to root everywhere, also on /sys and /proc, where the
    write after the image was generated then failed with a traceback (a first-hour pass)."""
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _format_of(ext: str) -> str:
    return next(fmt for fmt, exts in EXTENSIONS.items() if ext in exts)


def generate_to_file(url: str, prompt: str, output: str, args: argparse.Namespace) -> int:
    """Generate and write ``output``; prints the path and size. Returns a process exit code.

    ``output`` is checked first (`output_problem`), so a bad path never costs a generated image; an
    unreachable gateway is told as the URL tried and how to start one.
    """
    problem = output_problem(output, args.format)
    if problem:
        print(f"mammoth generate: {problem}", file=sys.stderr)
        return 1
    try:
        data, event = generate(url, prompt, args)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        print(f"mammoth generate: no gateway answers at {url} ({exc}); start the pipeline with "
              "`mammoth up` (in another terminal) or pass --url", file=sys.stderr)
        return 1
    except (GenerateError, httpx.HTTPError) as exc:
        print(f"mammoth generate: {exc}", file=sys.stderr)
        return 1
    path = pathlib.Path(output)
    try:
        path.write_bytes(data)
    except OSError as exc:  # the path changed since the check
        print(f"mammoth generate: cannot write {path} ({exc.strerror or exc}); the {len(data)}-byte image "
              "was not saved", file=sys.stderr)
        return 1
    seed = event.get("seed")
    print(f"wrote {path} ({len(data)} bytes{f', seed {seed}' if seed is not None else ''})")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Implementation of ``mammoth generate``."""
    return generate_to_file(args.url, args.prompt, args.output, args)

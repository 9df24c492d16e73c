"""``python -m gateway [--config F] [--port 8000] --ar ... --dit ...``: the gateway alone.

Same flags as ``mammoth gateway`` (every `GatewaySettings` field is a flag).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.app import serve
from mammoth_core.settings import GatewaySettings, SettingsError, add_arguments, resolve_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_arguments(parser, GatewaySettings)
    args = vars(parser.parse_args(argv))
    try:
        settings = resolve_settings(GatewaySettings, cli=args)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())

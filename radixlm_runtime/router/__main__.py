"""`python -m radixlm_runtime.router --worker-urls URL [URL ...]` or `radixlm-router ...`: the router in
front of running radixlm (or SGLang) servers."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

import uvicorn

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.router.app import create_router_app
from radixlm_runtime.server_args import add_config_args
from radixlm_runtime.utils.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlm-router", description=__doc__)
    add_config_args(parser, RouterConfig)
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)}
    try:
        config = RouterConfig(**values | {"worker_urls": tuple(values["worker_urls"])})
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_level)
    # uvicorn shuts down on SIGTERM/SIGINT, then raises the signal again: exit 0 then, not -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    uvicorn.run(create_router_app(config), host=config.host, port=config.port, log_level=config.log_level)


if __name__ == "__main__":
    main()

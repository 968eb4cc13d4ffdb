"""`verispec` command line: one module per subcommand, each with `add_parser(subparsers)` and `run(args)`.

Bad input exits with code 2 and a one-line message (`CliError`), never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import threading

# Subcommand name -> module under verispec.cli. Modules are imported lazily so `verispec --help` stays fast.
COMMANDS = {
    "generate": "generate",
    "serve": "serve",
    "bench": "bench",
    "distill": "distill",
    "pairs": "pairs",
}


class CliError(Exception):
    """A user's mistake on the command line: printed as `verispec: error: ...` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Exact speculative decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"verispec.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"verispec.cli.{module}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Importing a command's modules (torch, transformers) makes ~200k long-lived objects: the cyclic collector would
    # scan them all several times on the way and at each full collection after (~0.3 s of a start). So it is off
    # while they are imported, and they are kept out of its view (frozen) while the command runs; unfrozen after,
    # so a caller that runs many commands in one process (the tests) collects what an earlier one left.
    gc.disable()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    finally:
        gc.freeze()
        gc.enable()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every start are noise in a CLI
    try:
        return int(args.run(args) or 0)
    except (CliError, ValueError) as exc:
        # ValueError is how the API reports a user's mistake (configs, model paths, vocab mismatch, lengths).
        parser.exit(2, f"verispec: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    finally:
        gc.unfreeze()


def entry_point() -> None:
    """`verispec` as a program (the console script, `python -m verispec`): `main`, then the process ends without the
    interpreter's teardown where nothing else is still running. Freeing every module and object one by one takes
    0.3-0.8 s once torch and transformers are loaded (measured: 0.26 s after `import torch` alone); the exit
    handlers (atexit, weakref finalizers) still run and the output is flushed first."""
    code = main()
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if any(t.is_alive() for t in others):
        sys.exit(code)  # the ordinary exit waits for them
    atexit._run_exitfuncs()  # what the interpreter's exit runs first (CPython's own hook)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    entry_point()

"""The command line's error path, shared by ``vllm-bi`` and ``python -m vllm_bi.trainer``.

A mistake the user can fix is a :class:`UserError`: its message is one line naming the problem and the fix, its
``exit_code`` one of the statuses below, each with one meaning in every command. :func:`run_command` runs a
command's body and turns such an error into that line on stderr and its status; Ctrl-C into one line and status
130; any other exception keeps its traceback (a bug stays visible).

This module imports nothing of vllm_bi, so every module can raise these errors.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

__all__ = ["OK", "DIFFER", "USAGE", "ENVIRONMENT", "MISMATCH", "INTERRUPTED", "exit_status_help", "UserError",
           "UsageError", "EnvironmentProblem", "SettingsMismatch", "OutputExists", "OneLineParser", "one_line", "run_command"]

OK = 0  # the check passed (every token / module bitwise equal), or the command did its work
DIFFER = 1  # the check ran and found a difference (the trainer: a check of the run's own numbers failed)
USAGE = 2  # bad input: arguments, files, model directory, recipe, reward function, VLLM_BI_* values
ENVIRONMENT = 3  # the server (did not start, did not answer, refused or failed a request) or this machine
MISMATCH = 4  # vllm_bi settings that decide the bits differ between two sides that must share them
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

_USAGE_TEXT = ("usage error (a bad argument, file, model directory, recipe, reward function or VLLM_BI_* value; "
               "what can be checked is checked before a server starts)")
_ENVIRONMENT_TEXT = ("server or environment error (the server did not start, did not answer, refused or failed a "
                     "request; a missing package or device; a file that cannot be read or written)")


def exit_status_help(ok: str, differ: str | None = None, mismatch: str | None = None,
                     environment: str = _ENVIRONMENT_TEXT) -> str:
    """A command's ``--help`` epilog: the statuses it can end with, each in the meaning above."""
    parts = [f"0 {ok}"] + ([f"1 {differ}"] if differ else []) + [f"2 {_USAGE_TEXT}", f"3 {environment}"]
    parts += ([f"4 {mismatch}"] if mismatch else []) + ["130 interrupted (Ctrl-C)"]
    return "Exit status: " + "; ".join(parts) + ". An error is one line on stderr naming the problem and the fix."


class UserError(Exception):
    """A mistake the user can fix. The message names the problem and the fix; ``exit_code`` is its status."""

    exit_code = USAGE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(UserError, ValueError):
    """Bad input (status 2): an argument, a file, a model directory, a recipe, a setting."""

    exit_code = USAGE


class EnvironmentProblem(UserError, RuntimeError):
    """The server or this machine (status 3): a server that does not answer, a missing package or device."""

    exit_code = ENVIRONMENT


class SettingsMismatch(UserError, RuntimeError):
    """Two sides that must share the vllm_bi settings that decide the bits do not (a server and a trainer or a model
    adapted to it; a difference between them would say nothing about the infra): status 4."""

    exit_code = MISMATCH


class OutputExists(FileExistsError):
    """An output directory holds something else (``path``, ``what``). ``str()`` names the Python parameter
    (``overwrite=True``); a command says its own flag instead."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        super().__init__(f"{path} {what}; pass overwrite=True or another path")


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the spaces around them) turned into single spaces."""
    return re.sub(r"\s*\n\s*", " ", str(text).strip())


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, ``PROG: error: MESSAGE (see PROG --help)``, status 2."""

    def error(self, message: str):
        self.exit(USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def run_command(prog: str | None, body: Callable[[], int],
                translate: Callable[[BaseException], UserError | None] | None = None, stream=None) -> int:
    """``body()``'s status. A :class:`UserError` (or an exception ``translate`` maps to one) prints
    ``PROG: error: MESSAGE`` (``error: MESSAGE`` without ``prog``) on one line and returns its status; Ctrl-C prints
    ``PROG: interrupted`` and returns 130; anything else propagates with its traceback."""
    stream = stream or sys.stderr
    head = f"{prog}: " if prog else ""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{head}interrupted", file=stream, flush=True)
        return INTERRUPTED
    except Exception as e:
        err = e if isinstance(e, UserError) else translate(e) if translate else None
        if err is None:
            raise
        print(f"{head}error: {one_line(err)}", file=stream, flush=True)
        return err.exit_code

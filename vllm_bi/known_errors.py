"""The known errors of the layers below the commands, as one-line :class:`~vllm_bi.errors.UserError` s.

``vllm-bi`` and ``python -m vllm_bi.trainer`` hand :func:`explain` whatever their body raised: the HTTP client's
:class:`~vllm_bi.client.ServerUnreachable` and :class:`~vllm_bi.client.ServerError`, the launcher's
:class:`~vllm_bi.launcher.ServerStartError`, an occupied output directory, a missing package, a file the system
refuses. Each becomes one line naming the problem and the fix, status 3 (2 for an output directory); anything else
is None, so it keeps its traceback.
"""

from __future__ import annotations

import re

from vllm_bi.client import ServerError, ServerUnreachable
from vllm_bi.errors import EnvironmentProblem, OutputExists, UsageError, UserError
from vllm_bi.launcher import _ERROR_LINE, ServerStartError

__all__ = ["explain", "server_line"]


def server_line(e: BaseException, width: int = 400) -> str:
    """A server error's message on one line: its first line, the last error line quoted below it (a server log's
    excerpt) and the log's path, cut to ``width`` characters each."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
    text = lines[0]
    errors = [x for x in lines[1:] if _ERROR_LINE.match(x)]  # the excerpt's cause ends at such a line
    if errors:
        text = f"{text} {errors[-1]}"
    where = re.search(r"\((whole log|server log): [^)]*\)", str(e))
    text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{text} {where.group(0)}" if where and where.group(0) not in text else text


def explain(e: BaseException, unreachable_fix: str, output_fix: str = "pass --overwrite to replace it, or give "
            "another directory") -> UserError | None:
    """``e`` as a one-line :class:`UserError`, or None when it is not a known error. ``unreachable_fix`` is what
    the command says to do about a server that does not answer; ``output_fix`` about an occupied output
    directory."""
    if isinstance(e, ServerUnreachable):
        return EnvironmentProblem(f"{server_line(e)}; {unreachable_fix}")
    if isinstance(e, ServerError):
        if e.status == 401:
            return EnvironmentProblem(f"{server_line(e)}; pass the server's key with --api-key or VLLM_API_KEY")
        if e.status == 403:
            return EnvironmentProblem(f"the server refused the call: {server_line(e)}")
        return EnvironmentProblem(f"the server failed a request: {server_line(e)}")
    if isinstance(e, ServerStartError):
        return EnvironmentProblem(f"the vLLM server did not start: {server_line(e)}")
    if isinstance(e, OutputExists):
        return UsageError(f"{e.path} {e.what}; {output_fix}")
    if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] != "vllm_bi":
        return EnvironmentProblem(f"the Python package {e.name.split('.')[0]} is not installed in this environment; "
                                  "install vllm_bi with its extras (README: Using it)")
    if isinstance(e, OSError) and not isinstance(e, ConnectionError) and e.filename:
        return EnvironmentProblem(f"{e.filename}: {e.strerror or e}; check the path and its permissions")
    return None

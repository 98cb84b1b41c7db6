"""``docs/security.md`` lists every route of vLLM's API server (built here in-process with the dev-mode routes, no
engine), so a route that a new vLLM adds cannot go unlisted; and the guard wraps the app ``build_app`` returns."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
from vllm.entrypoints.launchers.api_server.entry import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_bi.patch.control import ControlGuard, guard_build_app, route_table
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "x"])
app = guard_build_app(build_app)(args, ("generate",), None)
stack = [m.cls for m in app.user_middleware] if app.middleware_stack is None else [type(app.middleware_stack)]
assert ControlGuard in stack, stack
print("\\n".join(route_table(app)))
"""


def test_every_route_is_listed_in_the_security_page():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_BATCH_INVARIANT="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    paths = {line.split(" ", 1)[1] for line in r.stdout.splitlines() if " /" in line}
    assert len(paths) > 50 and "/collective_rpc" in paths
    page = open(os.path.join(ROOT, "docs", "security.md")).read()
    listed = set(re.findall(r"(/[\w{}/.-]+)", page))
    missing = sorted(p for p in paths if p not in listed)
    assert missing == [], f"routes of vLLM's API server not in docs/security.md: {missing}"

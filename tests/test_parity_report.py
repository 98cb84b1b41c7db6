"""`vllm-bi parity`'s report says how the server ran: its CUDA-graph mode from ``vllm_bi_info``."""

import json

from vllm_bi.parity import ParityReport, server_execution


def test_server_line_names_the_cuda_graph_mode():
    assert server_execution(None) == "" and server_execution({"gdn_mode": "recurrent"}) == ""  # an older server
    assert server_execution({"cuda_graphs": "NONE"}) == "eager (no CUDA graphs)"
    assert server_execution({"cuda_graphs": "FULL_DECODE_ONLY"}) == "CUDA graphs FULL_DECODE_ONLY"
    rep = ParityReport("m", "vllm_bi", 1, 2, 2, 0.0, 0.0, None, "GDN recurrent", "CUDA graphs FULL_DECODE_ONLY")
    assert "server" in rep.table() and "CUDA graphs FULL_DECODE_ONLY" in rep.table()
    assert json.loads(rep.to_json())["server"] == "CUDA graphs FULL_DECODE_ONLY"
    assert not any(ln.startswith("server ") for ln in ParityReport("m", "hf", 1, 2, 2, 0.0, 0.0, None).table().splitlines())

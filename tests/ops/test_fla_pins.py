"""``pin_fla_chunk_configs`` on CPU, with a stand-in autotuned Triton kernel in place of fla-core's: the
wanted config becomes the kernel's only one and its tuning cache is cleared; a wanted config the kernel does
not have is refused with an error naming the kernel (no silent fallback to another config)."""

import os
import sys
import types

import pytest

triton = pytest.importorskip("triton")

from vllm_bi.gdn import chunk as gdn_chunk  # noqa: E402


def _module():
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=4),
                              triton.Config({"B": 32}, num_warps=8)], key=["n"])
    @triton.jit
    def standin_kernel(x_ptr, n, B: tl.constexpr):
        pass

    mod = types.ModuleType("vllm_bi_test_standin")
    mod.standin_kernel = standin_kernel
    return mod


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_bi_test_standin", _module())
    monkeypatch.setattr(gdn_chunk, "_pinned", {})
    for k in gdn_chunk._FLA_ENV_OFF:
        monkeypatch.setenv(k, os.environ.get(k, "1"))
    return sys.modules["vllm_bi_test_standin"].standin_kernel


def test_pins_the_wanted_config(standin, monkeypatch):
    standin.cache[("key",)] = standin.configs[0]  # as if autotuning had run
    monkeypatch.setattr(gdn_chunk, "FLA_CHUNK_PINS", {("vllm_bi_test_standin", "standin_kernel"):
                                                      {"B": 32, "num_warps": 8}})
    pinned = gdn_chunk.pin_fla_chunk_configs()
    assert len(standin.configs) == 1
    cfg = standin.configs[0]
    assert cfg.kwargs == {"B": 32} and cfg.num_warps == 8
    assert standin.cache == {}
    assert set(pinned) == {"standin_kernel"}
    assert all(os.environ[k] == "0" for k in gdn_chunk._FLA_ENV_OFF)  # fla-core's re-dispatch is off


def test_refuses_a_config_the_kernel_lacks(standin, monkeypatch):
    monkeypatch.setattr(gdn_chunk, "FLA_CHUNK_PINS", {("vllm_bi_test_standin", "standin_kernel"): {"B": 64}})
    with pytest.raises(RuntimeError, match="standin_kernel has no config"):
        gdn_chunk.pin_fla_chunk_configs()
    assert len(standin.configs) == 3  # left as it was

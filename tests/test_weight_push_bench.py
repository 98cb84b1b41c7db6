"""``benchmarks/weight_push.py``'s pure parts: every push carries new bits in every tensor (else the digest check
after a push could pass on weights that never moved), and the state sent is the checkpoint's minus the MTP drafter."""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("weight_push_bench", os.path.join(ROOT, "benchmarks", "weight_push.py"))
WP = importlib.util.module_from_spec(spec)
spec.loader.exec_module(WP)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bump_changes_every_tensor_and_only_its_first_element(dtype):
    state = {"a": torch.randn(4, 3, dtype=dtype), "b": torch.zeros(5, dtype=dtype)}
    before = {k: v.clone() for k, v in state.items()}
    WP.bump(state)
    for k, v in state.items():
        assert not torch.equal(v.view(-1)[:1], before[k].view(-1)[:1]), k
        assert torch.equal(v.view(-1)[1:], before[k].view(-1)[1:]), k
    WP.bump(state)  # again: new bits again
    assert not torch.equal(state["b"][:1], before["b"][:1])


def test_load_state_drops_the_mtp_drafter_and_refuses_an_empty_dir(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(4), "mtp.fc.weight": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    save_file({"lm_head.weight": torch.ones(3, 4)}, str(tmp_path / "b.safetensors"))
    assert sorted(WP.load_state(str(tmp_path), "cpu")) == ["lm_head.weight", "model.norm.weight"]
    with pytest.raises(SystemExit, match="no \\*.safetensors"):
        WP.load_state(str(tmp_path / "nothing"), "cpu")

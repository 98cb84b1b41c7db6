"""``WeightSync.push`` against a fake server client and a fake model (no server, no model files): the swap's
calls in order, the version folder it writes, pruning of old versions, and the digest check (a server that
reports other weights raises ``WeightMismatch``)."""
import os

import pytest
import torch

from vllm_bi.trainer.sync import WeightMismatch, WeightSync
from vllm_bi.weights import weight_digest


class FakeModel:
    """``save_pretrained`` writes one file holding the values it was given; ``hf_state_dict`` counts its calls."""

    def __init__(self, scale: float = 1.0):
        self.state = {"model.layers.0.w": torch.arange(6.0).reshape(2, 3) * scale, "lm_head.weight": torch.ones(4)}
        self.saved: list[tuple[str, str, dict]] = []
        self.state_calls = 0

    def hf_state_dict(self) -> dict:
        self.state_calls += 1
        return dict(self.state)

    def save_pretrained(self, path, like=None, state_dict=None):
        os.makedirs(path)
        torch.save(state_dict, os.path.join(path, "weights.pt"))
        self.saved.append((path, like, state_dict))


class FakeClient:
    """Records every call; serves the digest of what was last reloaded (or ``digest_of`` when given)."""

    def __init__(self, digest_of: dict | None = None, fail_reload: bool = False):
        self.calls: list[tuple] = []
        self.digest_of, self.fail_reload = digest_of, fail_reload
        self.loaded: dict | None = None

    def pause(self, mode="wait"):
        self.calls.append(("pause", mode))

    def reload_weights(self, weights_path, timeout=600.0):
        self.calls.append(("reload_weights", weights_path))
        if self.fail_reload:
            raise ConnectionError("reload failed")
        self.loaded = torch.load(os.path.join(weights_path, "weights.pt"))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))

    def resume(self):
        self.calls.append(("resume",))

    def weight_digest(self):
        self.calls.append(("weight_digest",))
        return weight_digest((self.digest_of if self.digest_of is not None else self.loaded).items())


def names(calls):
    return [c[0] for c in calls]


def test_push_swaps_in_order_and_writes_the_version(tmp_path):
    client, model = FakeClient(), FakeModel()
    sync = WeightSync(client, str(tmp_path), "/base/model", keep=3)
    timings = sync.push(model, 7)
    path = os.path.abspath(str(tmp_path / "weights" / "v000007"))
    assert client.calls == [("pause", "wait"), ("reload_weights", path), ("reset_prefix_cache",),
                            ("set_weight_version", "7"), ("resume",), ("weight_digest",)]
    assert sync.path(7) == str(tmp_path / "weights" / "v000007")
    assert os.path.isfile(os.path.join(path, "weights.pt")) and not os.path.exists(path + ".tmp")
    assert model.saved[0][1] == "/base/model" and model.saved[0][0] == path + ".tmp"  # written aside, then renamed
    assert torch.equal(client.loaded["model.layers.0.w"], model.state["model.layers.0.w"])
    assert model.state_calls == 1  # no state given: push gathers it itself
    assert set(timings) == {"time/sync_save_s", "time/sync_swap_s", "time/sync_verify_s"}


def test_push_uses_the_given_state(tmp_path):
    client, model = FakeClient(), FakeModel()
    state = FakeModel(scale=2.0).state
    WeightSync(client, str(tmp_path), "base", keep=3).push(model, 1, state)
    assert model.state_calls == 0
    assert model.saved[0][2] is state and torch.equal(client.loaded["model.layers.0.w"], state["model.layers.0.w"])


def test_push_without_verify_does_not_ask_for_the_digest(tmp_path):
    client = FakeClient(digest_of=FakeModel(scale=3.0).state)  # would mismatch if asked
    WeightSync(client, str(tmp_path), "base", keep=3, verify=False).push(FakeModel(), 1)
    assert names(client.calls) == ["pause", "reload_weights", "reset_prefix_cache", "set_weight_version", "resume"]


def test_resume_even_when_the_reload_fails(tmp_path):
    client = FakeClient(fail_reload=True)
    with pytest.raises(ConnectionError):
        WeightSync(client, str(tmp_path), "base", keep=3).push(FakeModel(), 1)
    assert names(client.calls) == ["pause", "reload_weights", "resume"]


def test_old_versions_beyond_keep_are_pruned(tmp_path):
    client, model = FakeClient(), FakeModel()
    sync = WeightSync(client, str(tmp_path), "base", keep=2)
    other = tmp_path / "weights" / "vnotes"  # not a version folder: left alone
    other.write_text("not a version")
    for v in range(5):
        sync.push(model, v)
        kept = sorted(n for n in os.listdir(tmp_path / "weights") if n[1:].isdigit())
        assert kept == [f"v{u:06d}" for u in range(max(0, v - 1), v + 1)]
    assert other.exists()


def test_digest_mismatch_raises(tmp_path):
    client = FakeClient(digest_of=FakeModel(scale=2.0).state)  # the server holds other weights
    sync = WeightSync(client, str(tmp_path), "base", keep=3)
    with pytest.raises(WeightMismatch, match=r"(?s)version 5.*differ.*layer000.*Refusing"):
        sync.push(FakeModel(), 5)
    assert names(client.calls)[-2:] == ["resume", "weight_digest"]  # the swap completed, then the check failed
    assert os.path.isdir(sync.path(5))


def test_digest_mismatch_on_a_missing_tensor(tmp_path):
    server_state = FakeModel().state
    del server_state["lm_head.weight"]  # a partial load: the server lacks the "other" group
    client = FakeClient(digest_of=server_state)
    with pytest.raises(WeightMismatch, match="other"):
        WeightSync(client, str(tmp_path), "base", keep=3).push(FakeModel(), 1)

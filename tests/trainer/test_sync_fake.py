"""``WeightSync.push`` against a fake server client and a fake model (no server, no model files): the swap's
calls in order, the version folder it writes, pruning of old versions, the digest check (a server that
reports other weights fails the push), the model check before the first push, and where a failed push leaves
the server: back on the last good version, or paused under a label that names no good version."""
import os

import pytest
import torch

from vllm_bi.client import ServerUnreachable
from vllm_bi.trainer.sync import SWAP_STEPS, ModelMismatch, PushFailed, WeightSync
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

    def __init__(self, digest_of: dict | None = None, fail_reload: bool = False, layout: dict | None = None):
        self.calls: list[tuple] = []
        self.digest_of, self.fail_reload, self.layout = digest_of, fail_reload, layout
        self.loaded: dict | None = None
        self.fail_at: dict[str, int] = {}  # method -> fail its n-th call from now (1: the next one)

    def _maybe_fail(self, name):
        if name in self.fail_at:
            self.fail_at[name] -= 1
            if self.fail_at[name] <= 0:
                del self.fail_at[name]
                raise ConnectionError(f"{name} failed")

    def collective_rpc(self, method, kwargs=None, timeout=600.0):
        assert method == "vllm_bi_model_layout"
        return [self.layout or {"architectures": None, "tensors": None, "path": "?"}]

    def pause(self, mode="wait"):
        self.calls.append(("pause", mode))
        self._maybe_fail("pause")

    def reload_weights(self, weights_path, timeout=600.0):
        self.calls.append(("reload_weights", weights_path))
        self._maybe_fail("reload_weights")
        if self.fail_reload:
            raise ConnectionError("reload failed")
        self.loaded = torch.load(os.path.join(weights_path, "weights.pt"))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        self._maybe_fail("reset_prefix_cache")

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))
        self._maybe_fail("set_weight_version")

    def resume(self):
        self.calls.append(("resume",))
        self._maybe_fail("resume")

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
    assert client.calls == [("pause", "wait"), ("set_weight_version", "7-loading"), ("reload_weights", path),
                            ("reset_prefix_cache",), ("set_weight_version", "7"), ("resume",), ("weight_digest",)]
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
    assert names(client.calls) == ["pause", "set_weight_version", "reload_weights", "reset_prefix_cache",
                                   "set_weight_version", "resume"]


def test_a_failed_first_push_leaves_the_server_paused_under_a_failed_label(tmp_path):
    client = FakeClient(fail_reload=True)
    with pytest.raises(PushFailed, match=r"version 1 failed at 'reload'.*no earlier good version.*stays paused") as e:
        WeightSync(client, str(tmp_path), "base", keep=3).push(FakeModel(), 1)
    assert e.value.step == "reload"
    assert client.calls[-2:] == [("pause", "wait"), ("set_weight_version", "1-failed")]
    assert ("resume",) not in client.calls


# a good push of version 1, then version 2 fails at each step of the swap: the server is back on version 1
_METHOD = {"pause": "pause", "label": "set_weight_version", "reload": "reload_weights",
           "reset prefix cache": "reset_prefix_cache", "set version": "set_weight_version", "resume": "resume"}


@pytest.mark.parametrize("step", SWAP_STEPS)
def test_a_push_failing_at_any_step_returns_the_server_to_the_last_good_version(tmp_path, step):
    client = FakeClient()
    sync = WeightSync(client, str(tmp_path), "base", keep=3)
    sync.push(FakeModel(), 1)
    if step == "verify":
        client.digest_of = FakeModel(scale=5.0).state  # the server reports other weights once
    else:  # the step's call fails (the second set_weight_version call for "set version")
        client.fail_at[_METHOD[step]] = 2 if step == "set version" else 1
    client.calls.clear()
    with pytest.raises(PushFailed, match=rf"version 2 failed at '{step}'.*back on version 1") as e:
        sync.push(FakeModel(scale=2.0), 2)
    assert e.value.step == step
    good = os.path.abspath(sync.path(1))
    assert client.calls[-5:] == [("set_weight_version", "1-restoring"), ("reload_weights", good),
                                 ("reset_prefix_cache",), ("set_weight_version", "1"), ("resume",)]
    assert torch.equal(client.loaded["model.layers.0.w"], FakeModel().state["model.layers.0.w"])
    assert sync.good == (1, sync.path(1)) and os.path.isdir(sync.path(1))


def test_when_the_restore_fails_too_the_server_stays_paused(tmp_path):
    client = FakeClient()
    sync = WeightSync(client, str(tmp_path), "base", keep=3)
    sync.push(FakeModel(), 1)
    client.fail_at["reload_weights"] = 1  # the push's reload ...
    client.fail_reload = False
    orig = client.reload_weights

    def reload_fails_twice(path, timeout=600.0):
        client.fail_at.setdefault("reload_weights", 1)  # ... and the restore's
        return orig(path, timeout)

    client.reload_weights = reload_fails_twice
    with pytest.raises(PushFailed, match=r"failed at 'reload'.*returning it to version 1 failed too.*stays paused "
                                         r"\(503"):
        sync.push(FakeModel(scale=2.0), 2)
    assert client.calls[-2:] == [("pause", "wait"), ("set_weight_version", "2-failed")]


def test_a_server_gone_mid_push_is_named_once_and_left_in_an_unknown_state(tmp_path):
    client = FakeClient()
    sync = WeightSync(client, str(tmp_path), "base", keep=3)
    sync.push(FakeModel(), 1)

    def gone(*args, **kwargs):
        raise ServerUnreachable("vLLM server at http://127.0.0.1:1 unreachable (/pause): connection refused")

    client.pause = client.reload_weights = client.set_weight_version = gone
    with pytest.raises(PushFailed) as e:
        sync.push(FakeModel(scale=2.0), 2)
    msg = str(e.value)
    assert msg.startswith("weight push of version 2 failed at 'pause' (vLLM server at http://127.0.0.1:1 "), msg
    assert msg.count("unreachable") == 1 and "unknown state" in msg and "returning it to version 1 failed" in msg, msg


def test_another_model_is_refused_before_any_weight_moves(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"architectures": ["Qwen3NextForCausalLM"]}')
    mine = {k: list(v.shape) for k, v in FakeModel().state.items()}
    cases = [({"architectures": ["LlamaForCausalLM"], "tensors": mine}, "serves \\['LlamaForCausalLM'\\]"),
             ({"architectures": ["Qwen3NextForCausalLM"], "tensors": {**mine, "model.layers.9.w": [1]}},
              "1 tensors only the server has"),
             ({"architectures": ["Qwen3NextForCausalLM"], "tensors": {**mine, "model.layers.0.w": [3, 2]}},
              "other shapes.*server \\[3, 2\\], trainer \\[2, 3\\]")]
    for layout, why in cases:
        client = FakeClient(layout=dict(layout, path="/srv/model"))
        with pytest.raises(ModelMismatch, match=why):
            WeightSync(client, str(tmp_path / "run"), str(base), keep=3).push(FakeModel(), 0)
        assert client.calls == []  # nothing paused, nothing loaded
    same = FakeClient(layout={"architectures": ["Qwen3NextForCausalLM"], "tensors": mine, "path": "/srv/model"})
    WeightSync(same, str(tmp_path / "run"), str(base), keep=3).push(FakeModel(), 0)  # the control: accepted
    assert names(same.calls)[-1] == "weight_digest"


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
    with pytest.raises(PushFailed, match=r"(?s)version 5 failed at 'verify'.*differ.*layer000.*Refusing"):
        sync.push(FakeModel(), 5)
    assert names(client.calls)[-4:] == ["resume", "weight_digest", "pause", "set_weight_version"]
    assert client.calls[-1] == ("set_weight_version", "5-failed")  # nothing good to return to: closed
    assert os.path.isdir(sync.path(5))


def test_digest_mismatch_on_a_missing_tensor(tmp_path):
    server_state = FakeModel().state
    del server_state["lm_head.weight"]  # a partial load: the server lacks the "other" group
    client = FakeClient(digest_of=server_state)
    with pytest.raises(PushFailed, match="other"):
        WeightSync(client, str(tmp_path), "base", keep=3).push(FakeModel(), 1)


class FakeEngine:
    """vLLM's trainer-side weight-transfer engine as ``WeightSync`` drives it: ``send_weights`` iterates the source
    (the server "maps" those tensors) or fails."""

    def __init__(self, client, fail=False):
        from vllm_bi.weight_push import _StateSource

        self.source, self.client, self.fail = _StateSource(), client, fail

    def send_weights(self):
        self.client.calls.append(("send_weights",))
        if self.fail:
            raise ConnectionError("update_weights failed")
        self.client.loaded = {k: v.clone() for k, v in self.source}


def test_ipc_push_sends_in_memory_in_the_swap_order_and_writes_nothing(tmp_path, monkeypatch):
    """``--weight-push ipc``: the same swap with vLLM's engine in place of the reload, nothing under RUN_DIR/weights,
    the digest of what the engine sent; a later failed push cannot go back (no copy kept) and leaves the server
    paused; the engine is set up once."""
    from vllm_bi import weight_push as S

    client, model = FakeClient(), FakeModel()
    made = []
    monkeypatch.setattr(S, "ipc_engine", lambda c: made.append(FakeEngine(c)) or made[-1])
    sync = WeightSync(client, str(tmp_path), "/base/model", keep=3, transfer="ipc")
    sync.push(model, 1)
    assert client.calls == [("pause", "wait"), ("set_weight_version", "1-loading"), ("send_weights",),
                            ("reset_prefix_cache",), ("set_weight_version", "1"), ("resume",), ("weight_digest",)]
    assert not model.saved and os.listdir(tmp_path / "weights") == []
    assert torch.equal(client.loaded["model.layers.0.w"], model.state["model.layers.0.w"])
    assert list(made[0].source) == []  # the engine holds no reference to the weights between pushes
    sync.push(FakeModel(scale=2.0), 2)
    assert len(made) == 1 and client.loaded["model.layers.0.w"][0, 1] == 2.0
    made[0].fail = True
    with pytest.raises(PushFailed, match=r"version 3 failed at 'reload'.*pushed in memory.*stays paused"):
        sync.push(FakeModel(scale=3.0), 3)
    assert client.calls[-2:] == [("pause", "wait"), ("set_weight_version", "3-failed")]


def test_ipc_engine_refusal_names_the_server_flags(monkeypatch):
    """A server without the IPC weight-transfer engine: one line naming its two settings and the files path."""
    pytest.importorskip("vllm.distributed.weight_transfer")
    from vllm.distributed import weight_transfer as W

    from vllm_bi.client import ServerError
    from vllm_bi.weight_push import ipc_engine

    def refuse(*a, **k):
        raise ServerError("Weight transfer not configured", 400)

    monkeypatch.setattr(W.WeightTransferTrainerFactory, "trainer_init", refuse)
    with pytest.raises(PushFailed, match=r"weight-transfer-config.*VLLM_ALLOW_INSECURE_SERIALIZATION=1.*files"):
        ipc_engine(type("C", (), {"url": "http://127.0.0.1:1"})())

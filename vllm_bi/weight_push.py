"""A keyed, atomic weight push into a running ``VLLM_BATCH_INVARIANT=1`` server, with versions and a digest check.

Shared by vllm_bi's trainer (:class:`vllm_bi.trainer.sync.WeightSync`) and outside trainers
(:class:`vllm_bi.integrations.weight_sync.HFWeightSync`); a subclass says how its model's weights are gathered
(:meth:`WeightPush.state_dict`, under the served checkpoint's tensor names) and written (:meth:`WeightPush.write`).

``transfer="files"`` (the default; CPU's only way: vLLM's weight-transfer engines move CUDA tensors): the weights
are written as an HF checkpoint to ``RUN_DIR/weights/v<version>`` (into a ``.tmp`` folder, then renamed: a reader
never sees half a checkpoint) and the server loads them in place through ``/collective_rpc reload_weights`` — no
restart, the engine, its KV cache and its compiled state stay. Every request carries the client's API key.

``transfer="ipc"`` (CUDA, the pushing process and the server on one GPU): vLLM's own weight-transfer engine with its
CUDA IPC backend (``vllm.distributed.weight_transfer``): the server maps the pushed bf16 tensors (under the
checkpoint's names) and copies them into its parameters; nothing is written to disk. The server must be started with
``--weight-transfer-config '{"backend": "ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the IPC handles
travel pickled). The swap, the labels and the digest check are the same; a failed push cannot return the server to
an earlier version (no copy of it is kept), so it leaves the server paused, as the files path does when it has no
earlier version.

Before the first push the model is checked against the server's (:meth:`WeightPush.check_layout`: the
architecture, and every tensor's name and shape from the served checkpoint's headers); another model is refused
in one line before any weight moves.

The swap, in order (no request of the caller's in flight meanwhile): ``/pause?mode=wait`` (drain; new
requests get 503 + Retry-After until resume) -> label ``<version>-loading`` -> reload -> ``/reset_prefix_cache`` ->
label ``<version>`` -> ``/resume`` -> digest check. Atomic: a push either completes, or the server returns to the
last good version (reloaded from its checkpoint on disk, which is kept until a newer push is verified: no second copy
of the weights in memory), or, when that fails too, stays paused (503 to every client) under a label that names no
good version, until a good push. Never a hang, never new weights under an old label. :class:`PushFailed` names the
step that failed and where the server was left.

Cache policy across a swap: nothing computed with old weights is ever reused. Every batch must be sampled entirely
under one version (no request spans a swap: the caller pushes between batches), and the prefix cache is reset at each
swap (vllm_bi's trainer also salts every request with ``cache_salt = vllm_bi-v<version>``). Keeping KV across a swap
would make a token's logprob a mix of two weight versions that no trainer forward can reproduce.
"""

from __future__ import annotations

import os
import shutil
import time

from vllm_bi.client import ServerError, ServerUnreachable
from vllm_bi.weights import digest_mismatches, weight_digest

__all__ = ["WeightPush", "WeightMismatch", "PushFailed", "ModelMismatch", "SWAP_STEPS"]

SWAP_STEPS = ("pause", "label", "reload", "reset prefix cache", "set version", "resume", "verify")


class WeightMismatch(RuntimeError):
    """The server does not hold the weights that were pushed."""


class PushFailed(RuntimeError):
    """A weight push failed at ``step``; the message says where the server was left."""

    def __init__(self, message: str, step: str):
        super().__init__(message)
        self.step = step


class ModelMismatch(ValueError):
    """The server serves another model than the pushing side's (architecture, tensor names or shapes)."""


class WeightPush:
    """Push a model's weights as numbered versions into the server behind ``client`` (a
    :class:`vllm_bi.client.VllmClient`). ``run_dir``: the versions' checkpoints go to ``run_dir/weights``, the
    ``keep`` newest kept; ``base_model``: the served checkpoint's directory (its config and tokenizer files are
    copied into every version); ``verify``: the digest check after every push; ``layout``: the served model's tensor
    names and shapes before the first push (both vllm_bi's worker RPCs: off against a stock server); ``transfer``:
    ``files`` or ``ipc`` (the module doc).

    A subclass gives :meth:`state_dict` and :meth:`write`."""

    def __init__(self, client, run_dir: str, base_model: str, keep: int, verify: bool = True, layout: bool = True,
                 transfer: str = "files"):
        if transfer not in ("files", "ipc"):
            raise ValueError(f"weight push {transfer!r}: files or ipc")
        self.client, self.base_model, self.keep, self.verify = client, base_model, keep, verify
        self.transfer, self._engine = transfer, None
        self.good: tuple[int, str | None] | None = None  # the last version the server verifiably held, its files
        self._layout_checked = not layout
        self._step = SWAP_STEPS[0]  # the swap step in progress (what a failed push names)
        self.dir = os.path.join(run_dir, "weights")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, version: int) -> str:
        return os.path.join(self.dir, f"v{version:06d}")

    def state_dict(self, model) -> dict:
        """``model``'s weights, gathered, under the served checkpoint's tensor names."""
        raise NotImplementedError

    def write(self, model, path: str, state: dict) -> None:
        """Write ``state`` (from :meth:`state_dict`) as an HF checkpoint into the new folder ``path``."""
        raise NotImplementedError

    def save(self, model, version: int, state: dict | None = None) -> str:
        """Write ``version``'s checkpoint atomically (a ``.tmp`` folder, then renamed); returns its folder."""
        final = self.path(version)
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.write(model, tmp, self.state_dict(model) if state is None else state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def push(self, model, version: int, state: dict | None = None) -> dict:
        """Write ``model``'s weights (``state``: its :meth:`state_dict`, when already gathered) as ``version``, swap
        them into the server, verify (see the module doc). Returns timings; raises :class:`PushFailed`, or
        :class:`ModelMismatch` before the first push moves anything."""
        t0 = time.perf_counter()
        state = self.state_dict(model) if state is None else state
        if not self._layout_checked:
            self.check_layout(state)
        if self.transfer == "ipc":
            path, load = None, lambda: self._send_ipc(state)
        else:
            path, load = self.save(model, version, state), None
        t1 = time.perf_counter()
        try:
            self._swap(path, version, "loading", load)
            t2 = time.perf_counter()
            self._step = "verify"
            if self.verify:
                self.check(state, version)
        except (ServerError, ServerUnreachable, WeightMismatch, OSError) as e:
            self._recover(version, self._step, e)
        self.good = (version, path)
        self.prune(version)
        return {"time/sync_save_s": t1 - t0, "time/sync_swap_s": t2 - t1, "time/sync_verify_s": time.perf_counter() - t2}

    def _recover(self, version: int, step: str, err: BaseException) -> None:
        """After a failed push: the server back on the last good version, or paused; raises :class:`PushFailed`."""
        what = f"weight push of version {version} failed at '{step}' ({_first_line(err)[:800]})"
        if self.good is None:
            left = self._close(f"{version}-failed")
            raise PushFailed(f"{what}; there is no earlier good version to return to, so the server {left} until a "
                             "good push (rerun the trainer)", step) from None
        good, path = self.good
        if path is None:  # pushed in memory: no copy of that version to return to
            left = self._close(f"{version}-failed")
            raise PushFailed(f"{what}; version {good} was pushed in memory (CUDA IPC) and no copy of it is kept, so "
                             f"the server {left} until a good push (rerun the trainer: it resumes from its last "
                             "checkpoint)", step) from None
        try:
            self._swap(path, good, "restoring")
        except (ServerError, ServerUnreachable, OSError) as e2:
            left = self._close(f"{version}-failed", seen=err)
            why = _new_part(e2, err)
            raise PushFailed(f"{what}; returning it to version {good} failed too ({why}), "
                             f"so the server {left} until a good push (rerun the trainer)", step) from None
        raise PushFailed(f"{what}; the server is back on version {good} (reloaded from {path})", step) from None

    def _swap(self, path: str | None, version: int, doing: str, load=None) -> None:
        """Load the checkpoint at ``path`` (or run ``load``: the in-memory transfer) into the paused server as
        ``version`` (labelled ``<version>-<doing>`` meanwhile, so a stop halfway never leaves new weights under an
        old label), then resume. ``self._step`` names the step in progress (:data:`SWAP_STEPS`)."""
        calls = (lambda: self.client.pause("wait"),
                 lambda: self.client.set_weight_version(f"{version}-{doing}"),
                 load or (lambda: self.client.reload_weights(os.path.abspath(path))),
                 self.client.reset_prefix_cache,
                 lambda: self.client.set_weight_version(str(version)),
                 self.client.resume)
        for self._step, call in zip(SWAP_STEPS, calls):  # SWAP_STEPS' last, "verify", is the caller's
            call()

    def _send_ipc(self, state: dict) -> None:
        """``state`` (checkpoint names -> CUDA tensors) into the server through vLLM's weight-transfer engine, CUDA
        IPC backend; the engine is set up with the server on the first push."""
        if self._engine is None:
            self._engine = ipc_engine(self.client)
        self._engine.source.state = state
        try:
            self._engine.send_weights()
        finally:
            self._engine.source.state = {}

    def _close(self, label: str, seen: BaseException | None = None) -> str:
        """Leave the server paused under ``label``; returns how it was left, for the error message (``seen``: the
        error already named there, not repeated)."""
        try:
            self.client.pause("wait")
            self.client.set_weight_version(label)
            return f"stays paused (503 + Retry-After to every client) under the label {label!r}"
        except (ServerError, ServerUnreachable, OSError) as e:
            if isinstance(e, ServerUnreachable) and isinstance(seen, ServerUnreachable):
                return "did not answer a pause either and is in an unknown state"
            return f"could not be reached to pause it ({_new_part(e, seen)}) and is in an unknown state"

    def check_layout(self, state: dict) -> None:
        """Refuse a server whose model differs from the trainer's: architecture, tensor names, shapes."""
        try:
            infos = self.client.collective_rpc("vllm_bi_model_layout")
        except ServerError as e:
            if e.status in (401, 403):
                raise
            infos = None  # a server whose vllm_bi predates the layout call: the digest check remains
        if not infos or not isinstance(infos[0], dict) or infos[0].get("tensors") is None:
            self._layout_checked = True  # a server without the checkpoint on its disk: the digest check remains
            return
        server = infos[0]
        import json

        with open(os.path.join(self.base_model, "config.json")) as f:
            mine_arch = json.load(f).get("architectures")
        if server["architectures"] != mine_arch:
            raise ModelMismatch(f"the server serves {server['architectures']} ({server['path']}) but the trainer's "
                                f"model {self.base_model} is {mine_arch}: start the server with the trainer's model")

        def skip(name):
            return name.startswith("mtp.") or ".mtp." in name

        theirs = {k: tuple(v) for k, v in server["tensors"].items() if not skip(k)}
        mine = {k: tuple(v.shape) for k, v in state.items() if not skip(k)}
        missing, extra = sorted(theirs.keys() - mine.keys()), sorted(mine.keys() - theirs.keys())
        shapes = sorted(k for k in theirs.keys() & mine.keys() if theirs[k] != mine[k])
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"{len(missing)} tensors only the server has (e.g. {missing[0]})")
            if extra:
                parts.append(f"{len(extra)} only the trainer has (e.g. {extra[0]})")
            if shapes:
                parts.append(f"{len(shapes)} of other shapes (e.g. {shapes[0]}: server {list(theirs[shapes[0]])}, "
                             f"trainer {list(mine[shapes[0]])})")
            raise ModelMismatch(f"the server's model ({server['path']}) is not the trainer's model "
                                f"{self.base_model}: {'; '.join(parts)}. Start the server with the trainer's model")
        self._layout_checked = True

    def check(self, state: dict, version: int) -> None:
        server = self.client.weight_digest()
        mine = weight_digest(state.items())
        bad = digest_mismatches(server, mine)
        if bad:
            raise WeightMismatch(
                f"after pushing weight version {version}, the server's weights differ from the trainer's in "
                f"{', '.join(bad)} (server {server.get(bad[0])} vs trainer {mine.get(bad[0])}). Refusing to train "
                "on samples from weights the trainer does not hold. Is another client loading weights into this "
                "server, or was it started from another checkpoint?"
            )

    def prune(self, newest: int) -> None:
        """Drop weight versions older than the ``keep`` newest (the newest is the last good one)."""
        for name in os.listdir(self.dir):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) <= newest - self.keep:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)


class _StateSource:
    """The weights a push sends, as vLLM's weight-transfer engines iterate them: ``(checkpoint name, tensor)``."""

    def __init__(self):
        self.state: dict = {}

    def __iter__(self):
        return iter(self.state.items())


def ipc_engine(client):
    """vLLM's trainer-side CUDA IPC weight-transfer engine, driving the server through ``client`` (vllm_bi's, which
    carries the API key). Raises :class:`PushFailed` naming the server flags when the server has no such engine."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    class Routes(HTTPVLLMWeightSyncClient):  # vLLM's routes and payloads, sent by vllm_bi's client
        def _post(self, path, json=None):
            client._post("/" + path, json or {})

    try:
        return WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0), client=Routes(client.url),
                                                          source=_StateSource())
    except ServerError as e:
        raise PushFailed(f"the server has no CUDA IPC weight transfer ({str(e).splitlines()[0][:300]}): start it with "
                         "--weight-transfer-config '{\"backend\": \"ipc\"}' and VLLM_ALLOW_INSECURE_SERIALIZATION=1, "
                         "or use --weight-push files", "reload") from None


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def _new_part(err: BaseException, seen: BaseException | None) -> str:
    """``err`` for a message that already names ``seen``: an unreachable server or the same error is not said twice."""
    if seen is not None and (_first_line(err) == _first_line(seen)
                             or isinstance(err, ServerUnreachable) and isinstance(seen, ServerUnreachable)):
        return "the server did not answer" if isinstance(err, ServerUnreachable) else "the same error"
    return _first_line(err)[:200]

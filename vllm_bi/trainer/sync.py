"""Weight sync into the running server, with versions and a digest check.

CPU (vLLM 0.32's CPU build has no weight-transfer engine): the trainer writes
its bf16 weights as an HF checkpoint to ``RUN_DIR/weights/v<version>`` and the
server loads them in place through ``/collective_rpc reload_weights`` — no
restart, the engine, its KV cache and its compiled state stay.

The swap, in order (the rollout thread holds no request in flight meanwhile):
``/pause?mode=wait`` (drain; new requests are refused until resume) -> reload ->
``/reset_prefix_cache`` -> ``/update_weight_version`` -> ``/resume`` -> digest check.

Cache policy across a swap: nothing computed with old weights is ever reused.
Every batch is sampled entirely under one version (no request spans a swap), the
prefix cache is reset at each swap, and every request also carries
``cache_salt = vllm_bi-v<version>`` so even a failed reset could not make a new
request hit an old-weight block. Keeping KV across a swap would make a token's
logprob a mix of two weight versions that no trainer forward can reproduce.
"""

from __future__ import annotations

import os
import shutil
import time

from vllm_bi.weights import digest_mismatches, weight_digest

__all__ = ["WeightSync", "WeightMismatch"]


class WeightMismatch(RuntimeError):
    """The server does not hold the weights the trainer pushed."""


class WeightSync:
    def __init__(self, client, run_dir: str, base_model: str, keep: int, verify: bool = True):
        self.client, self.base_model, self.keep, self.verify = client, base_model, keep, verify
        self.dir = os.path.join(run_dir, "weights")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, version: int) -> str:
        return os.path.join(self.dir, f"v{version:06d}")

    def save(self, model, version: int, state: dict | None = None) -> str:
        final = self.path(version)
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, like=self.base_model, state_dict=state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def push(self, model, version: int, state: dict | None = None) -> dict:
        """Write ``model``'s weights (``state``: its gathered :meth:`hf_state_dict`) as ``version``, swap them
        into the server, verify. Returns timings."""
        t0 = time.perf_counter()
        state = model.hf_state_dict() if state is None else state
        path = self.save(model, version, state)
        t1 = time.perf_counter()
        self.client.pause("wait")
        try:
            self.client.reload_weights(os.path.abspath(path))
            self.client.reset_prefix_cache()
            self.client.set_weight_version(str(version))
        finally:
            self.client.resume()
        t2 = time.perf_counter()
        if self.verify:
            self.check(state, version)
        self.prune(version)
        return {"time/sync_save_s": t1 - t0, "time/sync_swap_s": t2 - t1, "time/sync_verify_s": time.perf_counter() - t2}

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
        for name in os.listdir(self.dir):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) <= newest - self.keep:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

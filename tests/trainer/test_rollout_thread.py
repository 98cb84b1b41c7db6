"""``RolloutThread`` with a fake ``generate(b, v)`` (no server): batch ``b`` waits for weight version
``b - max_staleness``, errors reach the consumer through ``out``, ``stop()`` ends the thread."""
import queue
import threading

import pytest

from vllm_bi.trainer.rollout import RolloutThread

WAIT = 0.3  # how long "nothing happens" is watched for
TIMEOUT = 10.0


class Recorder:
    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[int, int]] = []
        self.fail_at = fail_at

    def __call__(self, b: int, v: int):
        self.calls.append((b, v))
        if b == self.fail_at:
            raise ValueError(f"generate failed on batch {b}")
        return ("batch", b, v)


def run(gen, first, last, staleness, version=None):
    t = RolloutThread(gen, first, last, staleness, first if version is None else version)
    t.start()
    return t


def get(t):
    return t.out.get(timeout=TIMEOUT)


def nothing_more(t):
    with pytest.raises(queue.Empty):
        t.out.get(timeout=WAIT)


def test_on_policy_waits_for_each_version():
    gen = Recorder()
    t = run(gen, 0, 3, 0)
    assert get(t) == ("batch", 0, 0)
    nothing_more(t)  # batch 1 needs version 1
    assert gen.calls == [(0, 0)]
    t.set_version(1)
    assert get(t) == ("batch", 1, 1)
    nothing_more(t)
    t.set_version(2)
    assert get(t) == ("batch", 2, 2)
    t.join(TIMEOUT)
    assert not t.is_alive() and gen.calls == [(0, 0), (1, 1), (2, 2)]


def test_staleness_one_runs_one_ahead():
    gen = Recorder()
    t = run(gen, 0, 4, 1)
    assert [get(t), get(t)] == [("batch", 0, 0), ("batch", 1, 0)]  # batch 1 under version 0
    nothing_more(t)  # batch 2 needs version 1
    t.set_version(1)
    assert get(t) == ("batch", 2, 1)
    nothing_more(t)
    t.set_version(2)
    assert get(t) == ("batch", 3, 2)
    t.join(TIMEOUT)
    assert not t.is_alive()


def test_resumed_run_starts_at_its_first_batch():
    gen = Recorder()
    t = run(gen, 5, 7, 0)
    assert get(t) == ("batch", 5, 5)
    nothing_more(t)
    t.stop()
    t.join(TIMEOUT)
    assert gen.calls == [(5, 5)]


def test_an_error_in_generate_reaches_the_consumer():
    gen = Recorder(fail_at=1)
    t = run(gen, 0, 5, 2)
    assert get(t) == ("batch", 0, 0)
    err = get(t)
    assert isinstance(err, ValueError) and "batch 1" in str(err)
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert gen.calls == [(0, 0), (1, 0)]  # nothing after the failure
    nothing_more(t)


def test_stop_ends_a_waiting_thread():
    gen = Recorder()
    t = run(gen, 0, 10, 0)
    assert get(t) == ("batch", 0, 0)
    assert t.is_alive()  # waiting for version 1
    t.stop()
    t.join(TIMEOUT)
    assert not t.is_alive()
    t.set_version(5)  # too late: nothing more is generated
    nothing_more(t)
    assert gen.calls == [(0, 0)]


def test_sampling_holds_the_swap_lock():
    started, release = threading.Event(), threading.Event()

    def slow(b, v):
        started.set()
        release.wait(TIMEOUT)
        return b

    t = run(slow, 0, 1, 0)
    assert started.wait(TIMEOUT)
    assert not t.swap_lock.acquire(timeout=WAIT)  # a weight push would wait for the batch
    release.set()
    assert get(t) == 0
    assert t.swap_lock.acquire(timeout=TIMEOUT)
    t.swap_lock.release()
    t.join(TIMEOUT)

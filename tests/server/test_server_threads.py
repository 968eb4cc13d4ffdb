"""The served model loads on a thread that ends with it (server/served.py): the OpenMP pool its torch ops start
goes with that thread, so the engine thread's pool is the only one in the server and its workers wait between
parallel regions as they do in process. What is checked is that no thread outlives the load, never a speed."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from conftest import machine_reason
from gates import WAIT_S
from verispec.server import served as runtime

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason=machine_reason("no /proc/self/task (the test counts threads there)"))


def native_threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a thread's first parallel region then starts a pool with a worker
    yield
    torch.set_num_threads(before)


def test_work_on_its_own_thread_leaves_no_thread_behind(two_torch_threads):
    before = native_threads()
    seen = {}

    def work() -> float:
        value = torch.ones(1 << 22).sum().item()  # a parallel reduction: this thread's OpenMP pool starts
        seen["thread"] = threading.get_native_id()
        seen["threads"] = native_threads()
        return value

    assert runtime.on_own_thread(work) == 1 << 22
    assert seen["thread"] != threading.get_native_id()
    if "OpenMP" in torch.__config__.parallel_info():
        assert seen["threads"] - before - {seen["thread"]}, "the parallel region started no OpenMP worker"
    # The loading thread and its pool's workers are gone (the OS thread exits just after the Python thread ends).
    deadline = time.monotonic() + WAIT_S
    while native_threads() - before:
        assert time.monotonic() < deadline, f"threads outlived the load: {native_threads() - before}"
        time.sleep(0.01)


def test_an_error_on_its_own_thread_is_raised_to_the_caller():
    def work():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        runtime.on_own_thread(work)


def test_served_model_loads_off_the_calling_thread(monkeypatch):
    loaded_on = []
    monkeypatch.setattr(runtime.ServedModel, "_load", classmethod(lambda cls, config: loaded_on.append(
        threading.get_ident()) or "served"))
    assert runtime.ServedModel.load(config=None) == "served"
    assert loaded_on and loaded_on[0] != threading.get_ident()

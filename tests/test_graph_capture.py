"""The CUDA graph capture helper (embshard/runtime/graphs.py): the order of its steps and its failure handling,
checked on any machine against a recording stand-in for torch.cuda's streams and graphs (the real capture runs in
the graph tests on GPUs: tests/test_dense_graph.py, tests/test_step_graph.py, tests/test_emb_graph.py)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from embshard.runtime import graphs


class _Cuda:
    """Streams, stream contexts and graphs that record what is done with them in `log`."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[str] = []
        self.current = self.Stream("main")
        self.on = self.current
        self.made = 0
        cuda = self

        class Graph:
            def __init__(self) -> None:
                cuda.log.append("new graph")

        for name, value in {
            "Stream": self.new_stream,
            "current_stream": lambda device=None: self.on,
            "stream": self.stream,
            "CUDAGraph": Graph,
            "graph": self.graph,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def Stream(self, name: str):
        log = self.log

        class S:
            def wait_stream(self, other) -> None:
                log.append(f"{name} waits for {other.name}")

        s = S()
        s.name = name
        return s

    def new_stream(self, device=None):
        self.made += 1
        return self.Stream(f"side{self.made}")

    @contextmanager
    def stream(self, s):
        before, self.on = self.on, s
        self.log.append(f"on {s.name}")
        try:
            yield
        finally:
            self.on = before

    @contextmanager
    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):
        before, self.on = self.on, stream if stream is not None else self.Stream("torch")
        self.log.append(f"capture on {self.on.name} pool {pool} mode {capture_error_mode}")
        try:
            yield
        finally:
            self.on = before
        self.log.append("captured")


class _Out:
    """A stand-in output tensor that records the streams it is recorded on."""

    def __init__(self, log) -> None:
        self.log = log

    def record_stream(self, s) -> None:
        self.log.append(f"recorded on {s.name}")


def test_warm_up_then_capture_on_one_side_stream(monkeypatch):
    cuda = _Cuda(monkeypatch)
    monkeypatch.setattr(graphs, "_tensors", lambda out: [out] if isinstance(out, _Out) else [])
    side = cuda.Stream("mine")

    def body():
        cuda.log.append(f"body on {cuda.on.name}")
        return _Out(cuda.log)

    @contextmanager
    def around():
        cuda.log.append("around in")
        yield
        cuda.log.append("around out")

    warm, _, out = graphs.warm_up_and_capture(
        body, torch.device("cpu"), stream=side, pool="P", iterations=2, record_output=True, around=around
    )
    assert isinstance(warm, _Out) and isinstance(out, _Out)
    assert cuda.log == [
        "mine waits for main",  # the warm-up after the caller's queued work
        "on mine",
        "body on mine",
        "body on mine",  # two warm-up iterations
        "main waits for mine",  # the caller's later work after the warm-up
        "recorded on main",  # the warm-up's output is read on the caller's stream
        "around in",  # `around` holds the capture alone
        "new graph",
        "capture on mine pool P mode thread_local",
        "body on mine",
        "captured",
        "around out",
    ], cuda.log


def test_a_fresh_warm_up_stream_and_torchs_capture_stream_without_one(monkeypatch):
    cuda = _Cuda(monkeypatch)
    warm = graphs.warm_up(lambda: 1, torch.device("cpu"))
    graph, out = graphs.capture(lambda: 2)
    assert (warm, out) == (1, 2) and cuda.made == 1
    assert cuda.log == [
        "side1 waits for main",
        "on side1",
        "main waits for side1",
        "new graph",
        "capture on torch pool None mode thread_local",
        "captured",
    ], cuda.log
    with pytest.raises(ValueError, match="iterations must be at least 1, got 0"):
        graphs.warm_up(lambda: 1, torch.device("cpu"), iterations=0)


def test_a_failed_capture_raises_through_around_and_a_failed_warm_up_does_not_enter_it(monkeypatch):
    cuda = _Cuda(monkeypatch)
    entered = []

    @contextmanager
    def around():
        entered.append(True)
        try:
            yield
        except KeyError as e:
            raise RuntimeError(f"capture failed: {e}") from e

    def fails_when_capturing():
        if "captured" not in cuda.log and any(x.startswith("capture on") for x in cuda.log):
            raise KeyError("boom")
        return 0

    with pytest.raises(RuntimeError, match="capture failed: 'boom'"):
        graphs.warm_up_and_capture(fails_when_capturing, torch.device("cpu"), around=around)
    assert entered == [True]

    def fails() -> int:
        raise KeyError("warm")

    entered.clear()
    with pytest.raises(KeyError, match="warm"):
        graphs.warm_up_and_capture(fails, torch.device("cpu"), around=around)
    assert entered == []  # a failed warm-up is not the capture's failure

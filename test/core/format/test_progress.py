"""Progress output when stderr is a pipe (as under ros2 launch): plain lines, not bar frames."""
from __future__ import annotations

import threading
import time

from selectinfer_ros.core.format import progress as prog


def test_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("SELECTINFER_QUIET", raising=False)
    monkeypatch.setattr(prog, "LINE_EVERY_S", 0.01)

    def slow():
        for i in range(4):
            time.sleep(0.02)
            yield i

    assert list(prog.progress(slow(), "load FFN neurons", total=4)) == [0, 1, 2, 3]
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("[progress] load FFN neurons: 1/4")
    assert lines[-1].startswith("[progress] load FFN neurons: 4 done in")


def test_quiet_passes_the_iterable_through(monkeypatch, capsys):
    monkeypatch.setenv("SELECTINFER_QUIET", "1")
    data = [1, 2]
    assert prog.progress(data, "x") is data
    assert capsys.readouterr().err == ""


def test_heartbeat_logs_while_the_block_runs():
    said: list[str] = []
    two = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        if len(said) >= 2:
            two.set()

    with prog.heartbeat(log, "[default-model] converting", every=0.02):
        assert two.wait(30.0)  # the block runs until the second beat
    n = len(said)
    assert n >= 2 and all(s.startswith("[default-model] converting: still running (") for s in said)
    time.sleep(0.1)  # five periods: a beat thread left running would have logged
    assert len(said) == n  # stopped with the block

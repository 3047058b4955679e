"""The serving queue and worker without ROS: order, capacity, cancel, drain, reloads, prompt checks."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest

from selectinfer_ros.core.serving import server as serving
from selectinfer_ros.core.execution.engine import GenerationConfig
from selectinfer_ros.core.options import NodeSettings
from selectinfer_ros.core.serving.server import GoalJob, Rejected, Server

PROMPT = "w10 w11 w12 w13 w14 w15"



def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _queued_reloads(srv: Server) -> int:
    with srv._lock:
        return sum(isinstance(j, serving._Reload) for j in srv._queue)


class Client:
    """What an adapter does with a job: flags, streamed text, the outcome."""

    def __init__(self, srv: Server, max_new_tokens: int = 8, task: str = "", gate=None,
                 stop=(), cancel_after_polls: int | None = None):
        self.cancel = False
        self.polls = 0
        self.cancel_after_polls = cancel_after_polls
        self.texts: list[tuple[str, int]] = []
        self.done = threading.Event()
        self.started = threading.Event()
        self.gate = gate  # an Event the first token waits on (keeps the goal running)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, stop=list(stop))
        self.job = GoalJob(PROMPT, cfg, task, 0.5, self._cancel, self.started.set,
                           self._text, lambda outcome: self.done.set())
        srv.admit()
        srv.submit(self.job)

    def _cancel(self) -> bool:
        self.polls += 1
        limit = self.cancel_after_polls
        return self.cancel or (limit is not None and self.polls > limit)

    def _text(self, delta: str, tokens: int) -> None:
        self.texts.append((delta, tokens))
        if self.gate is not None:
            self.gate.wait(30.0)

    @property
    def outcome(self):
        assert self.done.wait(60.0), "goal did not end"
        return self.job.outcome


def test_goals_run_in_order_and_stream_token_counts(server):
    a, b = Client(server), Client(server)
    assert a.outcome.status == "succeeded" and b.outcome.status == "succeeded"
    counts = [n for _, n in a.texts]
    assert counts == sorted(counts) and counts[-1] == a.outcome.result.metrics.generated_tokens
    assert "".join(t for t, _ in a.texts) == a.outcome.result.text
    assert server.runtime.stats.succeeded == 2


def test_queue_full_and_a_canceled_waiting_goal_frees_its_slot_at_once(server):
    gate = threading.Event()
    running = Client(server, max_new_tokens=20, gate=gate)
    assert running.started.wait(10.0)
    waiting = Client(server)  # queue_length 1: the one place left
    with pytest.raises(Rejected) as e:
        server.admit()
    assert e.value.code == serving.QUEUE_FULL
    assert server.cancel(waiting.job)  # leaves the queue now, not when it reaches the head
    assert waiting.outcome.status == "canceled" and waiting.outcome.code == serving.CANCELED
    again = Client(server)  # its slot is free while the first goal still runs
    assert not running.done.is_set()
    gate.set()
    assert running.outcome.status == "succeeded" and again.outcome.status == "succeeded"
    assert not waiting.started.is_set()  # never ran


def test_running_goal_cancel_and_drain_end_within_a_step_with_the_reason(server):
    gate = threading.Event()
    a = Client(server, max_new_tokens=40, gate=gate)
    assert a.started.wait(10.0)
    b = Client(server)
    a.cancel = True
    gate.set()
    assert a.outcome.status == "canceled" and a.outcome.message == "canceled by client"
    assert a.outcome.result.metrics.generated_tokens < 40
    assert b.outcome.status == "succeeded"

    gate2 = threading.Event()
    c = Client(server, max_new_tokens=40, gate=gate2)
    assert c.started.wait(10.0)
    d = Client(server)
    t0 = time.monotonic()
    threading.Timer(0.2, gate2.set).start()
    assert server.drain("node deactivating", timeout=10.0)
    assert time.monotonic() - t0 < 5.0
    assert c.outcome.status == "aborted" and c.outcome.code == serving.NO_MODEL
    assert c.outcome.message.startswith("node deactivating")
    assert d.outcome.status == "aborted" and d.outcome.message == "node deactivating"
    assert not d.started.is_set()
    with pytest.raises(Rejected):
        server.admit()  # drained: not accepting


def test_canceled_result_holds_only_the_streamed_text(server):
    """A stop string whose beginning the text ends with is held back; a cancel then must not
    return that held-back text (the client never saw it)."""
    probe = Client(server, max_new_tokens=1)
    first = probe.outcome.result.text
    assert first
    # canceled right after the first token (polls: the worker's before starting, the engine's
    # before prefill, two per layer during prefill, and after the first token), whose text is a
    # prefix of the stop string
    c = Client(server, max_new_tokens=10, stop=[first + "\x00never"],
               cancel_after_polls=3 + server.runtime.engine.cancel_points)
    out = c.outcome
    assert out.status == "canceled"
    held = server.runtime.engine.tokenizer.decode(out.result.token_ids, skip_special_tokens=True)
    assert held.startswith(first)  # the model did produce text, all of it held back
    assert out.result.text == "".join(t for t, _ in c.texts) == ""


def test_reload_waits_in_the_queue_is_abandoned_on_timeout_and_never_runs_late(server):
    gate = threading.Event()
    running = Client(server, max_new_tokens=10, gate=gate)
    assert running.started.wait(10.0)
    with pytest.raises(TimeoutError, match="abandoned"):
        server.reload("beta", timeout=0.3)
    gate.set()
    assert running.outcome.status == "succeeded"
    # a goal queued now runs after anything still queued: the abandoned reload did not run
    assert Client(server, max_new_tokens=1).outcome.status == "succeeded"
    assert server.task == "alpha"
    report = server.reload("beta", timeout=0.001)  # nothing ahead: starts at once, completes
    assert report is not None and report.task == "beta" and server.task == "beta"
    assert server.reload("beta", timeout=1.0) is None  # already active
    with pytest.raises(Rejected) as e:
        server.reload("gamma", timeout=5.0)
    assert e.value.code == serving.UNKNOWN_TASK and server.task == "beta"


def test_reload_of_the_active_task_answers_at_once_while_a_goal_runs(server):
    """A profile manager activating on the task the node already runs must not wait for the
    goal in flight (a bringup did, and a Ctrl-C then waited for the whole generation); a reload
    queued ahead keeps the order."""
    gate = threading.Event()
    running = Client(server, max_new_tokens=10, gate=gate)
    assert running.started.wait(10.0)
    t0 = time.monotonic()
    assert server.reload("alpha", timeout=5.0) is None
    assert server.reload("", timeout=5.0) is None
    assert running.job.outcome is None  # answered while the goal is held (up to 30 s)
    assert time.monotonic() - t0 < 10.0
    box = {}

    def call(key, task):
        try:
            box[key] = server.reload(task, timeout=30.0)
        except Exception as e:  # noqa: BLE001 - the answer under test
            box[key] = e

    ahead = threading.Thread(target=call, args=("r", "beta"))
    ahead.start()
    assert _wait_until(lambda: _queued_reloads(server) == 1, 30.0)
    behind = threading.Thread(target=call, args=("a", "alpha"))
    behind.start()
    # queued (a reload that answered at once would never be queued), in the waiting switch's
    # place: the last requested task wins and the earlier caller is told so at once
    assert _wait_until(lambda: "r" in box, 30.0)
    assert isinstance(box["r"], serving.Superseded) and "'alpha'" in str(box["r"]), box["r"]
    assert _queued_reloads(server) == 1 and "a" not in box
    gate.set()
    ahead.join(30.0)
    behind.join(30.0)
    assert box["a"] is None and server.task == "alpha"  # alpha was active: nothing to switch
    assert running.outcome.status == "succeeded"


def test_a_storm_of_reloads_answers_every_caller_and_the_last_task_wins(server):
    """30 reloads while a goal runs: every caller hears back (superseded at once, or done), at
    most two wait at any time, and the last requested task is the one loaded."""
    gate = threading.Event()
    running = Client(server, max_new_tokens=10, gate=gate)
    assert running.started.wait(10.0)
    box, threads = {}, []

    def call(i, task):
        try:
            box[i] = server.reload(task, timeout=60.0)
        except Exception as e:  # noqa: BLE001 - the answer under test
            box[i] = e

    for i in range(30):
        threads.append(threading.Thread(target=call, args=(i, ("beta", "alpha")[i % 2])))
        threads[-1].start()
        assert _wait_until(lambda: len(box) >= i, 30.0)  # the one before it was superseded
    assert _wait_until(lambda: len(box) == 29, 30.0) and _queued_reloads(server) == 1
    gate.set()
    for t in threads:
        t.join(30.0)
    assert len(box) == 30
    superseded = [i for i, r in box.items() if isinstance(r, serving.Superseded)]
    assert sorted(superseded) == list(range(29))
    assert box[29] is None and server.task == "alpha"  # the last asked for alpha (active)
    assert running.outcome.status == "succeeded"


def test_a_started_reload_completes_before_its_caller_hears_back(server, monkeypatch):
    rt = server.runtime
    real = rt.switch_task
    entered, release = threading.Event(), threading.Event()
    timeout = 2.0  # the idle worker starts the reload well within it, even on a busy machine

    def slow_switch(task, cancel=None):
        entered.set()
        assert release.wait(30.0)
        return real(task, cancel)

    monkeypatch.setattr(rt, "switch_task", slow_switch)
    box = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: box.update(r=server.reload("beta", timeout=timeout)))
    t.start()
    assert entered.wait(timeout)
    time.sleep(max(0.0, t0 + timeout + 0.2 - time.monotonic()))  # the caller's timeout passes
    assert t.is_alive() and "r" not in box  # still waiting: the started reload completes
    release.set()
    t.join(30.0)
    assert box["r"].task == "beta" and server.task == "beta"


def test_prompt_checks_use_their_own_tokenizer_and_never_skip(server, monkeypatch):
    too_long = " ".join(f"w{i}" for i in range(200))
    gate = threading.Event()
    busy = Client(server, max_new_tokens=30, gate=gate)
    assert busy.started.wait(10.0)
    for _ in range(50):  # the worker is generating meanwhile: the answer never changes
        with pytest.raises(Rejected) as e:
            server.check_prompt(too_long, False)
        assert e.value.code == serving.PROMPT_TOO_LONG
    assert server.check_prompt(PROMPT, False) == 7
    assert server._check_tokenizer is not server.runtime.engine.tokenizer
    gate.set()
    busy.outcome

    def broken(*a, **k):
        raise RuntimeError("Already borrowed")

    monkeypatch.setattr(serving, "encode", broken)
    with pytest.raises(Rejected) as e:  # a tokenizer failure rejects, it never skips the check
        server.check_prompt(PROMPT, False)
    assert e.value.code == serving.INVALID_GOAL and "Already borrowed" in e.value.reason


def test_goal_config_refuses_with_reasons(server):
    s = NodeSettings(max_new_tokens=8, max_new_tokens_limit=64, load_ratio=0.7, compute_ratio=0.5)
    base = dict(prompt=PROMPT, task="", max_new_tokens=0, temperature=0.0, top_k=0, top_p=0.0,
                repetition_penalty=0.0, seed=-1, stop=[], use_chat_template=False,
                compute_ratio=0.0, choices=[], length_normalize=False)
    cfg, phi = serving.goal_config(SimpleNamespace(**base), s, server.runtime)
    assert cfg.max_new_tokens == 8 and phi == pytest.approx(0.5)
    for over, code, needle in [(dict(prompt=" "), serving.INVALID_GOAL, "empty prompt"),
                               (dict(task="gamma"), serving.UNKNOWN_TASK, "unknown task"),
                               (dict(max_new_tokens=65), serving.INVALID_GOAL, "exceeds"),
                               (dict(compute_ratio=0.9), serving.INVALID_GOAL, "compute_ratio")]:
        with pytest.raises(Rejected) as e:
            serving.goal_config(SimpleNamespace(**{**base, **over}), s, server.runtime)
        assert e.value.code == code and needle in e.value.reason


def _held_goals(srv, goals: list[tuple[str, GenerationConfig, float,
                                       Callable[[list[str]], bool] | None]]
                ) -> tuple[list[GoalJob], list[tuple[str, int]]]:
    """Submit ``goals`` (prompt, config, compute ratio, cancel: None, or polled with the goal's
    streamed pieces) while the worker is held in the first one's start, then let it go; wait
    until all ended. The jobs (each with ``texts``: its streamed pieces) and the ("start" |
    "end", index) events in order."""
    hold, events, jobs = threading.Event(), [], []
    for i, (prompt, cfg, ratio, cancel) in enumerate(goals):
        def start(i=i) -> None:
            events.append(("start", i))
            hold.wait(30.0)

        def end(outcome, i=i) -> None:
            events.append(("end", i))
            jobs[i].ended.set()

        texts: list[str] = []
        stop = (lambda: False) if cancel is None else (lambda c=cancel, t=texts: c(t))
        job = GoalJob(prompt, cfg, "", ratio, stop, start,
                      lambda d, n, texts=texts: texts.append(d), end)
        job.texts, job.ended = texts, threading.Event()
        srv.admit()
        srv.submit(job)
        jobs.append(job)
    hold.set()
    assert all(j.ended.wait(60.0) for j in jobs)
    return jobs, events


def _started_before_the_first_end(events: list[tuple[str, int]]) -> set[int]:
    first_end = events.index(next(e for e in events if e[0] == "end"))
    return {i for kind, i in events[:first_end] if kind == "start"}


def test_goals_decode_together_each_with_its_own_text_and_cancel(batch_server):
    """Four goals submitted while the worker is held: the first three run together (each starts
    before any ends), the fourth joins when a slot frees; a goal canceled in the batch ends
    CANCELED with the text it streamed, the others' texts equal their runs alone; the queue's
    accounting is back to empty."""
    srv = batch_server
    prompts = ["w10 w11 w12", "w20 w21 w22 w23 w24", "w30", "w40 w41"]
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    def cancel(texts: list[str]) -> bool:  # the second goal: after its third streamed piece
        return len(texts) >= 3

    jobs, events = _held_goals(srv, [(p, cfg, 1.0, cancel if i == 1 else None)
                                     for i, p in enumerate(prompts)])
    assert _started_before_the_first_end(events) == {0, 1, 2}, events
    assert jobs[1].outcome.status == "canceled"
    assert "".join(jobs[1].texts) == jobs[1].outcome.result.text
    engine = srv.runtime.engine
    for i in (0, 2, 3):
        assert jobs[i].outcome.status == "succeeded"
        assert jobs[i].outcome.result.text == engine.generate(prompts[i], cfg).text, i
    assert srv.running is None and srv.waiting == 0 and srv.aggregate_tokens_per_second > 0


def test_goals_with_different_compute_ratios_decode_together(selecting_batch_server):
    """Three goals asking compute ratios 0.3, 0.5 and 0.7 of gamma 0.7 (their prompts choose
    their own neurons) start together (each before any ends), each result reports its own
    ratio and its text equals its run alone."""
    srv = selecting_batch_server
    ratios = (0.3, 0.5, 0.7)
    jobs, events = _held_goals(srv, [
        (f"w{12 + i} w{30 - i} w{5 * i}",
         GenerationConfig(max_new_tokens=10 + 2 * i, ignore_eos=True, compute_ratio=r), r, None)
        for i, r in enumerate(ratios)])
    assert _started_before_the_first_end(events) == {0, 1, 2}, events
    engine = srv.runtime.engine
    for j, r in zip(jobs, ratios):
        assert j.outcome.status == "succeeded" and j.outcome.compute_ratio == r
        assert j.outcome.result.text == engine.generate(j.prompt, j.config).text
    assert srv.running is None and srv.waiting == 0 and srv.aggregate_tokens_per_second > 0


def test_draining_ends_every_goal_of_a_batch_within_a_step(batch_server):
    """Deactivate / Ctrl-C while three goals decode together: each ends ABORTED with the reason
    and the text it streamed; the worker is idle after. (The worker is held in a streaming
    callback once all three have streamed, until the drain has flagged them.)"""
    srv = batch_server
    all_streamed, gate = threading.Event(), threading.Event()
    clients = []
    for i in range(3):
        c = SimpleNamespace(done=threading.Event(), texts=[])

        def text(d, n, c=c) -> None:
            c.texts.append(d)
            if all(x.texts for x in clients) and len(clients) == 3:
                all_streamed.set()
                gate.wait(30.0)

        job = GoalJob(f"w{50 + i} w7", GenerationConfig(max_new_tokens=40, ignore_eos=True), "",
                      1.0, lambda: False, lambda: None, text,
                      lambda outcome, c=c: c.done.set())
        c.job = job
        clients.append(c)
    for c in clients:
        srv.admit()
        srv.submit(c.job)
    assert all_streamed.wait(30.0)
    drained = []
    drainer = threading.Thread(target=lambda: drained.append(srv.drain("node shutting down", 30.0)))
    drainer.start()
    assert _wait_until(lambda: all(c.job.abort_reason for c in clients), 10.0)
    gate.set()
    drainer.join(30.0)
    assert drained == [True]
    for c in clients:
        assert c.done.wait(10.0)
        out = c.job.outcome
        assert out.status == "aborted" and "node shutting down" in out.message, out.message
        assert out.result.text == "".join(c.texts)
        assert out.result.metrics.generated_tokens < 40
    assert srv.running is None and srv.waiting == 0

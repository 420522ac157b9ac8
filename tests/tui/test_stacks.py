"""The stacks view: a py-spy dump of a Ray worker stopped at a breakpoint in debug mode (taken from one,
trimmed) comes out step thread first, devharness's frames highlighted, Ray's and the debugger's threads
folded until f."""
from textual.content import Content

from devharness.tui import stacks
from tests.tui.test_tui import FakeClient, make_app, snapshot, until

RAY_WORKER_AT_BREAKPOINT = '''Process 18350: ray::RayWorker
Python v3.11.7 (/usr/bin/python3.11)

Thread 18350 (idle): "MainThread"
    Worker.main_loop (ray/_private/worker.py:1069)
    <module> (ray/_private/workers/default_worker.py:323)
Thread 18439 (idle): "PythonGCThread"
    Condition.wait (threading.py:327)
    Event.wait (threading.py:629)
    PythonGCThread.run (ray/_private/gc_collect_manager.py:29)
    Thread._bootstrap_inner (threading.py:1045)
Thread 18601 (idle): "Thread-3 (copy_worker)"
    Condition.wait (threading.py:327)
    copy_worker (torch/utils/data/pin.py:88)
Thread 18595 (idle): "Dummy-7"
    Condition.wait (threading.py:331)
    PyDB._do_wait_suspend (pydevd.py:2328)
    PagedAttention.forward (devharness/model/attention.py:58)
    Module._call_impl (torch/nn/modules/module.py:1789)
    DecoderLayer.forward (devharness/model/decoder.py:99)
    Worker.execute_model (devharness/worker/worker.py:139)
    serve (devharness/worker/worker_loop.py:83)
    RayWorker.run_loop (devharness/executor/ray_worker.py:114)
    FunctionActorManager._make_actor_method_executor.<locals>.actor_method_executor (ray/_private/function_manager.py:740)
Thread 18596 (idle): "Dummy-1"
Thread 18667 (idle): "pydevd.Writer"
    Condition.wait (threading.py:331)
    Queue.get (queue.py:180)
    WriterThread._on_run (_pydevd_bundle/pydevd_comm.py:392)
Thread 18674 (idle): "pydevd.CheckAliveThread"
    CheckAliveThread._on_run (pydevd.py:326)
    PyDBDaemonThread.run (_pydevd_bundle/pydevd_daemon_thread.py:53)
Thread 18687 (idle): "devharness-debug-watcher"
    _watch (devharness/debug/debugger.py:104)
    Thread.run (threading.py:982)
'''
FOLDED = ["MainThread", "PythonGCThread", "Dummy-1", "pydevd.Writer", "pydevd.CheckAliveThread",
          "devharness-debug-watcher"]


def styles_of(content: Content, text: str) -> set[str]:
    """The styles laid over the first occurrence of `text`."""
    start = content.plain.index(text)
    return {str(s.style) for s in content.spans if s.start <= start < s.end}


def test_step_thread_first_then_other_threads_and_the_rest_folded():
    parsed = stacks.parse(RAY_WORKER_AT_BREAKPOINT)
    assert [t.name for t in parsed.shown] == ["Dummy-7", "Thread-3 (copy_worker)"]
    assert [t.name for t in parsed.folded] == FOLDED
    assert parsed.preamble[0] == "Process 18350: ray::RayWorker"
    step = parsed.shown[0]
    assert step.is_step and [f.func for f in step.frames if f.ours][0] == "PagedAttention.forward"
    assert step.frames[2].file == "devharness/model/attention.py" and step.frames[2].line == 58


def test_render_highlights_devharness_frames_and_folds_into_one_line():
    text = stacks.render(stacks.parse(RAY_WORKER_AT_BREAKPOINT))
    lines = text.plain.splitlines()
    assert lines[3] == '▶ step thread  Thread 18595 (idle): "Dummy-7"'
    assert lines[-1] == f"+ 6 Ray/debugger threads folded: {', '.join(FOLDED)} (f unfolds)"
    assert "Worker.main_loop" not in text.plain and "pydevd.Writer\"" not in text.plain
    assert styles_of(text, "PagedAttention.forward (devharness/model/attention.py:58)") == {stacks.OURS_STYLE}
    assert styles_of(text, "Module._call_impl") == {"dim"}
    unfolded = stacks.render(stacks.parse(RAY_WORKER_AT_BREAKPOINT), unfold=True).plain
    assert "Worker.main_loop (ray/_private/worker.py:1069)" in unfolded
    assert unfolded.index("Dummy-7") < unfolded.index("copy_worker") < unfolded.index("MainThread")
    assert unfolded.splitlines()[-1] == "− 6 Ray/debugger threads shown last (f folds them)"


def test_text_that_is_not_a_py_spy_dump_is_shown_as_it_is():
    other = 'Thread 0x7f (most recent call last):\n  File "worker.py", line 88, in execute_model\n    x()'
    parsed = stacks.parse(other)
    assert not parsed.folded and stacks.render(parsed).plain == other


async def test_t_shows_the_arranged_stacks_and_f_unfolds():
    class RayClient(FakeClient):
        async def stack(self, rank):
            return RAY_WORKER_AT_BREAKPOINT

    app = make_app(RayClient(snapshot(57)))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        stack_text = lambda: str(app.query_one("#stack-text").render())   # noqa: E731
        await pilot.press("t")
        await until(pilot, lambda: "step thread" in stack_text())
        assert stack_text().startswith("rank 0, engine step 57") and "Worker.main_loop" not in stack_text()
        await pilot.press("f")
        await until(pilot, lambda: "Worker.main_loop" in stack_text())
        await pilot.press("f")
        await until(pilot, lambda: "Worker.main_loop" not in stack_text())

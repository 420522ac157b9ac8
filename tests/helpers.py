"""Shared test inputs."""
import random
import re


def mixed_prompts(n: int, seed: int = 0, lengths=(1, 3, 5, 8, 15, 16, 17, 31, 33, 47, 64, 70, 100)) -> list[list[int]]:
    """`n` token-id prompts of mixed lengths (crossing block boundaries), byte ids only."""
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def free_port_base(n: int = 4) -> int:
    """A base port with n free ports above it (below the ephemeral range: bench.dap.free_port_bases)."""
    from devharness.bench.dap import free_port_bases
    return free_port_bases(1, n)[0]


def wait_until(fn, timeout_s=60.0, what="condition"):
    """fn()'s first true value, asked every 50 ms; AssertionError naming `what` after timeout_s."""
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads has stopped. kill() returns when the signal is
    queued: the kernel wakes one thread to start the group stop, and on a loaded machine the others (the one
    that reads the next step among them) may run on for a while before they stop too."""
    import os
    import signal
    import time
    from pathlib import Path

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass   # a thread that ended meanwhile
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} not stopped after {timeout} s: thread states {states}")
        time.sleep(0.01)


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (a killed worker its parent has not reaped yet) counts as dead, and so does
    a process that ends while this looks at it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def fresh_python(code: str, timeout: float = 120.0) -> str:
    """Run `code` in a new Python process (no state from other tests: a running Ray, a lock tqdm already made)
    and return its stdout's last line; the process must exit 0."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def frozen_at_startup(run_id: str, rank: int) -> int:
    """How many objects that worker's start-up froze out of the collector's reach (gc.freeze), from its log; 0 if
    it says nothing of it."""
    from devharness.debug import worker_log
    found = [int(m.group(1)) for line in worker_log.tail(worker_log.log_path(run_id, rank), 500)
             if (m := re.search(r"froze the (\d+) objects made at start-up", line))]
    return found[-1] if found else 0


def start_serve(*args: str, port: int = 0):
    """`devharness serve --model tiny-llama --port PORT ARGS` in its own session, one torch thread per process and no
    outside Ray cluster, not waited for; (process, its output lines so far and to come, read on in a thread)."""
    import os
    import subprocess
    import sys
    import threading
    cmd = [sys.executable, "-m", "devharness.cli", "serve", "--model", "tiny-llama", "--port", str(port), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    proc.reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    return proc, lines


def served_url(proc, lines: list[str], timeout_s: float = 180.0) -> str:
    """The URL start_serve's process prints once it serves; AssertionError with its output if it ends first."""
    def url():
        ended = proc.poll() is not None
        if ended:
            proc.reader.join(10)   # its last lines, and the banner if it printed one before it ended
        found = [m.group(1) for line in list(lines) if (m := re.search(r"serving tiny-llama at (http://\S+) ", line))]
        assert found or not ended, f"serve ended (exit status {proc.returncode}) before serving"
        return found and found[0]
    try:
        return wait_until(url, timeout_s, "the serving banner")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{''.join(lines)}") from None


def serve_process(*args: str, timeout_s: float = 180.0):
    """start_serve(*args) on a free port, once it serves: (process, its output lines so far and to come, its URL)."""
    proc, lines = start_serve(*args)
    return proc, lines, served_url(proc, lines, timeout_s)

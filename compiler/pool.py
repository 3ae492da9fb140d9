"""Run compile workers in parallel, each in its own process group with a timeout.

A crash, hang or error in one job never stops the others; each ends as a JobResult that says
how it ended, with its log tail and the command that reproduces it.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .zygote import ForkedProcess, Zygote

LOG_TAIL = 4000  # bytes of a worker's log a report keeps


@dataclass
class Job:
    name: str  # what to call it in reports (the region fingerprint)
    region_file: Path
    out_file: Path
    backend: str
    options: dict
    log_file: Path

    @property
    def worker_args(self) -> list[str]:
        return [str(self.region_file), str(self.out_file), "--backend", self.backend,
                "--options", json.dumps(self.options, sort_keys=True)]

    @property
    def command(self) -> list[str]:
        """The worker as a command of its own (what a report says to run to reproduce a job)."""
        return worker_command(self.worker_args)


def worker_command(worker_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "deepinfer.compiler.worker", *worker_args]


@dataclass
class JobResult:
    job: Job
    returncode: int | None  # None when it timed out
    seconds: float
    log_tail: str
    ok: bool = False  # exited 0 and wrote its artifact (checked when it ended; the file may move on)

    @property
    def signature(self) -> str:
        """How it failed, stable across runs: 'timeout', 'signal SIGSEGV', 'exit 3: <error line>'."""
        if self.returncode is None:
            return "timeout"
        if self.returncode < 0:
            return f"signal {signal.Signals(-self.returncode).name}"
        error_lines = [line for line in self.log_tail.splitlines() if "error" in line.lower()]
        return f"exit {self.returncode}" + (f": {error_lines[-1].strip()[:200]}" if error_lines else "")

    def describe(self) -> str:
        how = {None: f"timed out after {self.seconds:.0f} s (killed)"}.get(self.returncode, self.signature)
        tail = "\n".join("    " + line for line in self.log_tail.splitlines()[-15:])
        return (f"region {self.job.name}: {how}\n  log: {self.job.log_file}\n  reproduce: {shlex.join(self.job.command)}\n"
                f"  log tail:\n{tail}")


class Workers:
    """The live worker processes of one run, forked by a zygote (zygote.py: torch imported once,
    not once a job): on Ctrl-C (or any error) every one is killed with its process group, and no
    new one starts. Workers die with the zygote and the zygote with the compiler, however the
    compiler dies, so `kill -9` leaves none behind. `close()` when done."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: set[ForkedProcess] = set()
        self.stopped = False
        self.zygote: Zygote | None = None  # started with the first job

    def start(self, job: Job) -> ForkedProcess | None:
        with self.lock:
            if self.stopped:
                return None
            if self.zygote is None:
                self.zygote = Zygote()
            process = self.zygote.spawn(job.worker_args, str(job.log_file))
            self.live.add(process)
            return process

    def done(self, process: ForkedProcess):
        with self.lock:
            self.live.discard(process)

    def kill_all(self):
        with self.lock:
            self.stopped = True
            for process in self.live:
                _kill_group(process)

    def close(self):
        """Kill what still runs, and the zygote."""
        self.kill_all()
        with self.lock:
            if self.zygote is not None:
                self.zygote.close()
                self.zygote = None


    def run(self, job: Job, timeout: float) -> JobResult:
        """One worker to its end. A job that never started (the run was stopped) ends as a SIGINT."""
        start = time.perf_counter()
        process = self.start(job)
        if process is None:
            return not_started(job)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.wait()
            returncode = None
        finally:
            self.done(process)
        tail = job.log_file.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        return JobResult(job, returncode, time.perf_counter() - start, tail, ok=returncode == 0 and job.out_file.is_file())


def not_started(job: Job) -> JobResult:
    return JobResult(job, -signal.SIGINT, 0.0, "not started: the compile was interrupted")


@dataclass(frozen=True)
class Executor:
    """Where compile workers run: `local` (this machine, forked by a zygote) or `ray` (a Ray
    cluster at `ray_address`; None starts one on this machine)."""

    kind: str = "local"
    ray_address: str | None = None

    def workers(self, toolchain: dict):
        """A Workers-like runner: run(job, timeout), kill_all(), close(). `toolchain` is the plan's
        (a remote node must match it: it is part of every fingerprint)."""
        if self.kind == "ray":
            from .ray_farm import RayWorkers

            return RayWorkers(self.ray_address, toolchain)
        return Workers()


LOCAL = Executor()


def run_jobs(jobs: list[Job], parallel: int, timeout: float, progress: bool = True, label: str = "compiling",
             on_done=None, executor: Executor = LOCAL, toolchain: dict | None = None) -> list[JobResult]:
    """Every job, `parallel` at a time, on the executor's workers; `on_done(result)` runs in this
    thread as each one ends (the build caches a finished region at once, so an interrupted
    compile keeps it). Ctrl-C kills every worker at once and raises KeyboardInterrupt, with
    nothing left running.

    The interrupt is taken by a handler that only sets a flag and kills the workers, and the
    waiting loop checks the flag: a KeyboardInterrupt raised inside concurrent.futures can leave
    its locks held, and the pool's threads would then never finish."""
    if not jobs:
        return []
    workers = executor.workers(toolchain or {})
    interrupted = threading.Event()

    def on_interrupt(signum, frame):
        interrupted.set()
        workers.kill_all()

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_interrupt) if in_main else None
    pool = ThreadPoolExecutor(max_workers=max(1, parallel))
    try:
        with tqdm(total=len(jobs), desc=label, unit="region", disable=not progress, file=sys.stderr) as bar:
            futures = [pool.submit(workers.run, job, timeout) for job in jobs]
            pending = set(futures)
            while pending and not interrupted.is_set():
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    bar.update(1)
                    if on_done is not None:
                        on_done(future.result())
            if interrupted.is_set():
                raise KeyboardInterrupt
            return [future.result() for future in futures]
    finally:
        workers.close()  # (killing nothing after a normal end)
        pool.shutdown(wait=True, cancel_futures=True)
        if in_main:
            signal.signal(signal.SIGINT, previous)


def _kill_group(process: ForkedProcess):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

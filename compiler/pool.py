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
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass
class Job:
    name: str  # what to call it in reports (the region fingerprint)
    region_file: Path
    out_file: Path
    backend: str
    options: dict
    log_file: Path

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "deepinfer.compiler.worker", str(self.region_file), str(self.out_file),
                "--backend", self.backend, "--options", json.dumps(self.options, sort_keys=True)]


@dataclass
class JobResult:
    job: Job
    returncode: int | None  # None when it timed out
    seconds: float
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.job.out_file.is_file()

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


def run_job(job: Job, timeout: float) -> JobResult:
    start = time.perf_counter()
    with open(job.log_file, "wb") as log:
        process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    tail = job.log_file.read_bytes()[-4000:].decode(errors="replace")
    return JobResult(job, returncode, time.perf_counter() - start, tail)


def run_jobs(jobs: list[Job], parallel: int, timeout: float, progress: bool = True, label: str = "compiling") -> list[JobResult]:
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool, \
            tqdm(total=len(jobs), desc=label, unit="region", disable=not progress, file=sys.stderr) as bar:
        futures = [pool.submit(run_job, job, timeout) for job in jobs]
        for future in as_completed(futures):
            bar.update(1)
        return [future.result() for future in futures]

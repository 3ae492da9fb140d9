"""Compile workers as Ray tasks: a compile farm of many machines (`--executor ray`).

Each task gets the exported region's bytes, runs the same worker command a local compile runs
(`python -m deepinfer.compiler.worker`) as its own process on the node, in its own session, under
the same timeout (killed with its process group when it runs out; it also dies with the task's
process), and returns how it ended, its log tail and the artifact's bytes. The driver writes the
artifact under the job's output name, and the build moves it into the content-addressed cache as
for a local compile: the cache lives with the driver, the nodes need no shared filesystem. The
worker compiles in a directory named after the region under the same temporary root as the driver,
with the driver's thread count, so an artifact has the same bytes wherever it compiled.

A node whose toolchain (torch, Python, deepinfer, CPU ISA, backend versions: all part of every
region's fingerprint) differs from the driver's refuses the job, naming the difference: its
artifact would be filed under a fingerprint it does not match.
"""

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from deepinfer.runtime.errors import DeepinferError

from .pool import LOG_TAIL, Job, JobResult, not_started, worker_command

GRACE_SECONDS = 60  # beyond the worker's own timeout, for the task's start and its reply


class RayUnavailable(DeepinferError):
    exit_code = 2


def compile_task(region: bytes, out_name: str, worker_options: list[str], timeout: float, toolchain: dict,
                 temp_root: str, threads: int) -> dict:
    """Runs on a Ray node: one region's worker, like pool.Workers.run runs it locally."""
    from deepinfer.compiler.backends import backend_module
    from deepinfer.runtime.versions import toolchain_versions

    node = socket.gethostname()
    backend = worker_options[worker_options.index("--backend") + 1]
    here = {**toolchain_versions(), **backend_module(backend).versions()}
    differs = {k: (toolchain.get(k), here.get(k)) for k in toolchain.keys() | here.keys() if toolchain.get(k) != here.get(k)}
    if differs:
        return {"returncode": 1, "seconds": 0.0, "artifact": None, "log": (
            f"error: Ray node {node} has another toolchain than the compiler (compiler, node): {differs}. Install the "
            "same torch, deepinfer and backend there (and use nodes of the compiler's CPU ISA), or compile locally.")}
    env = {**os.environ, "DEEPINFER_COMPILER_PID": str(os.getpid()),  # the worker dies with this task's process
           # Ray gives a 1-CPU task OMP_NUM_THREADS=1; inductor writes the thread count into the
           # kernels it generates, so the worker gets the compiler's, as a local worker has.
           "OMP_NUM_THREADS": str(threads)}
    if os.path.isdir(temp_root):
        env["TMPDIR"] = temp_root  # the artifact's bytes follow its work directory's path
    with tempfile.TemporaryDirectory(prefix="deepinfer-ray-") as work:
        region_file, out = Path(work) / "region.ep.pt2", Path(work) / out_name
        region_file.write_bytes(region)
        start = time.perf_counter()
        with open(Path(work) / "compile.log", "wb") as log:
            process = subprocess.Popen(worker_command([str(region_file), str(out), *worker_options]), stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                returncode = None
        tail = (Path(work) / "compile.log").read_bytes()[-LOG_TAIL:].decode(errors="replace")
        artifact = out.read_bytes() if returncode == 0 and out.is_file() else None
        return {"returncode": returncode, "seconds": time.perf_counter() - start, "artifact": artifact,
                "log": f"[Ray node {node}]\n{tail}"}


class RayWorkers:
    """pool.Workers' interface over a Ray cluster: run(job, timeout), kill_all(), close()."""

    def __init__(self, address: str | None, toolchain: dict):
        try:
            import ray
        except ImportError:
            raise RayUnavailable("--executor ray needs Ray on this machine and on the cluster's nodes: "
                                 "pip install 'deepinfer[ray]'.") from None
        self.ray = ray
        self.started_here = not ray.is_initialized()
        if self.started_here:
            try:
                # None starts a cluster of this machine's cores; "auto" or HOST:PORT joins a running one
                ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="error")
            except (ConnectionError, ValueError, RuntimeError) as err:
                raise RayUnavailable(f"--ray-address {address}: cannot reach a Ray cluster there ({err}). Start one "
                                     "with `ray start --head` on the head node, or leave --ray-address out to start one "
                                     "on this machine.") from None
        self.task = ray.remote(num_cpus=1, max_retries=0)(compile_task)
        self.toolchain = toolchain
        self.lock = threading.Lock()
        self.running: set = set()
        self.stopped = False

    def run(self, job: Job, timeout: float) -> JobResult:
        with self.lock:
            if self.stopped:
                return not_started(job)
            ref = self.task.remote(job.region_file.read_bytes(), job.out_file.name, job.worker_args[2:], timeout,
                                   self.toolchain, tempfile.gettempdir(), torch.get_num_threads())
            self.running.add(ref)
        start = time.perf_counter()
        try:
            done = self.ray.get(ref, timeout=timeout + GRACE_SECONDS)
        except self.ray.exceptions.GetTimeoutError:  # the node itself stopped answering
            self.ray.cancel(ref, force=True)
            done = {"returncode": None, "artifact": None, "log": "the Ray task did not answer; cancelled"}
        except self.ray.exceptions.RayError as err:  # the task's process or its node died
            done = {"returncode": 1, "artifact": None, "log": f"error: Ray task failed: {str(err)[-LOG_TAIL:]}"}
        finally:
            with self.lock:
                self.running.discard(ref)
        job.log_file.write_text(done["log"])
        if done["artifact"] is not None:
            partial = job.out_file.with_name(f".partial-{job.out_file.name}")
            partial.write_bytes(done["artifact"])
            partial.replace(job.out_file)
        return JobResult(job, done["returncode"], time.perf_counter() - start, done["log"][-LOG_TAIL:],
                         ok=done["returncode"] == 0 and done["artifact"] is not None)

    def kill_all(self):
        with self.lock:
            self.stopped = True
            for ref in self.running:
                self.ray.cancel(ref, force=True)

    def close(self):
        self.kill_all()
        if self.started_here:
            self.ray.shutdown()

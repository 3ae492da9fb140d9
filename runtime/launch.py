"""Multi-rank replay: rank 0 leads, followers replay the leader's steps from a shared-memory ring.

`deepinfer-run` on a bundle with world_size W > 1 spawns W-1 follower processes itself
(`python -m deepinfer.runtime.follower`), or, under torchrun, finds them already started (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every rank joins the gloo (CPU) process groups, loads
and verifies its shard, and checks that every other rank loaded the same manifest and toolchain.
The leader then writes one record per step into the ring and runs the step itself.

Failure is fatal and fast: a watchdog thread polls the followers every 50 ms; when one dies or
raises, the leader prints its rank and last words, kills the rest and exits 1. Followers die
with the leader (PR_SET_PDEATHSIG) and also check the leader's pid while waiting. The ring's file
is unlinked as soon as every rank has attached, so no /dev/shm segment outlives the job.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import DeepinferError
from .executor import BundleExecutor
from .manifest import peek_world_size, sha256_file
from .shm_ring import ShmRing
from .step import Step, encode, payload_words
from .versions import toolchain_versions

RING_SLOTS = 8


class RankFailed(DeepinferError):
    pass


def max_bucket_of(bundle: Path) -> int:
    """The widest step record, read before verification (ring sizes must agree on every rank)."""
    import json

    return max(max(b) for b in json.loads((bundle / "manifest.json").read_text())["buckets"].values())


def torchrun_ring_name() -> str:
    """The ring's /dev/shm name under torchrun, where followers find it by name (torchrun's ranks
    share MASTER_PORT and the run id, and nothing else the leader could hand them)."""
    return f"deepinfer-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ['MASTER_PORT']}"


def node_size(manifest) -> int | None:
    return manifest.parallel.get("hierarchical_allreduce") or None


def join(bundle: Path, rank: int, world_size: int, master_addr: str, master_port: int) -> BundleExecutor:
    """Join the process groups, load this rank's shard, and check every rank loaded the same bundle."""
    from .distributed import init_groups

    executor = BundleExecutor(bundle, rank)
    m = executor.manifest
    init_groups(rank, world_size, m.parallel["tp"], master_addr, master_port, node_size=node_size(m))
    mine = {"rank": rank, "manifest": sha256_file(Path(bundle) / "manifest.json"), "toolchain": toolchain_versions(),
            "world_size": m.parallel["world_size"]}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)  # also the barrier after which the ring may be unlinked
    for other in everyone:
        for key in ("manifest", "toolchain", "world_size"):
            if other[key] != mine[key]:
                raise RankFailed(f"rank {other['rank']} loaded a different {key} than rank {rank} "
                                 f"({other[key]} vs {mine[key]}): every rank must run the same bundle and toolchain.")
    return executor


class Leader:
    """The executor the engine drives on rank 0: feeds each step to the followers, then runs it."""

    def __init__(self, bundle: Path, torchrun: bool = False):
        self.bundle = Path(bundle)
        self.world_size = peek_world_size(self.bundle)
        self.max_bucket = max_bucket_of(self.bundle)
        self.followers: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.stopping = False
        self.step_id = 0
        ring_name = torchrun_ring_name() if torchrun else None
        self.ring = ShmRing.create(self.world_size - 1, payload_words(self.max_bucket), RING_SLOTS, name=ring_name)
        try:
            if torchrun:
                addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            else:
                addr, port = "127.0.0.1", _free_port()
                # Ranks share this host's cores: W ranks each spinning up all cores' worth of
                # OpenMP threads thrash (torchrun sets 1 for the same reason).
                self.threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // self.world_size))
                torch.set_num_threads(int(self.threads))
                self._spawn(addr, port)
                threading.Thread(target=self._watch, daemon=True).start()
            self.executor = join(self.bundle, 0, self.world_size, addr, port)
        except BaseException:
            self.shutdown(kill=True)
            raise
        finally:
            self.ring.unlink()  # every rank attached before join's all_gather returned
        self.manifest = self.executor.manifest

    def __getattr__(self, name):  # host_seconds, trace_events, write_trace: the local executor's
        return getattr(self.executor, name)

    def _spawn(self, addr: str, port: int):
        self.log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-ranks-"))
        for rank in range(1, self.world_size):
            env = {**os.environ, "OMP_NUM_THREADS": self.threads, "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": addr,
                   "MASTER_PORT": str(port), "DEEPINFER_RING": str(self.ring.path), "DEEPINFER_LEADER_PID": str(os.getpid())}
            log = self.log_dir / f"rank-{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.followers.append(subprocess.Popen(
                    [sys.executable, "-m", "deepinfer.runtime.follower", "--bundle", str(self.bundle)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))

    def _watch(self):
        while not self.stopping:
            for rank, process in enumerate(self.followers, start=1):
                code = process.poll()
                if code is not None and not self.stopping:
                    self._fail(rank, code)
            time.sleep(0.05)

    def _fail(self, rank: int, code: int):
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        words = self.logs[rank - 1].read_bytes()[-2000:].decode(errors="replace").strip() or "(nothing)"
        sys.stderr.write(f"deepinfer-run: rank {rank} (pid {self.followers[rank - 1].pid}) {how}; the job stops.\n"
                         f"rank {rank}'s last words:\n{words}\n")
        sys.stderr.flush()
        self.shutdown(kill=True)
        os._exit(1)

    def run(self, step: Step):
        self.ring.write(self.step_id, encode(step, self.max_bucket))
        self.step_id += 1
        return self.executor.run(step)

    def shutdown(self, kill: bool = False):
        """Stop the followers: a stop record and a wait, or (kill) SIGKILL at once. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if not kill:  # spawned followers, or torchrun's
            try:
                self.ring.write(self.step_id, encode(None, self.max_bucket), timeout=10)
                for process in self.followers:
                    process.wait(timeout=10)
            except Exception:
                kill = True
        for process in self.followers:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.ring.unlink()
        if dist.is_initialized() and not kill:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """Runs in the child before exec: SIGKILL it when the leader dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

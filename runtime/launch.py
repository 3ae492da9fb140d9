"""Multi-rank replay: rank 0 leads, followers replay the leader's steps from a shared-memory ring.

`deepinfer-run` on a bundle with world_size W > 1 spawns W-1 follower processes itself
(`python -m deepinfer.runtime.follower`), or, under torchrun, finds them already started (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every rank joins the gloo (CPU) process groups, loads
and verifies its shard, and checks that every other rank loaded the same manifest and toolchain.
The leader then writes one record per step into the ring and runs the step itself.

Under torchrun on several hosts (`--nnodes N`) each host has its own ring: rank 0 sends every
step record over torch.distributed to the first rank of each other host (a broadcast over the
group of those ranks), which writes it into its host's ring and runs the step itself; the other
ranks read their host's ring as on one host. One host keeps the path above (no extra hop).

Failure is fatal and fast: a watchdog thread polls the followers every 50 ms; when one dies or
raises, the leader prints its rank and last words, kills the rest and exits 1. Followers die
with the leader (PR_SET_PDEATHSIG) and also check the leader's pid while waiting. Spawned
followers inherit the ring's descriptor after its file is unlinked, and log to unnamed files, so
no /dev/shm segment or temp directory outlives the job; under torchrun the ring is unlinked as
soon as every rank has attached.
"""

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

from .errors import BundleError, DeepinferError
from .executor import BundleExecutor, admit
from .lifetime import die_with_parent
from .manifest import peek_world_size, sha256_file, weights_missing
from .shm_ring import SHM_DIR, ShmRing
from .step import Step, encode, payload_words
from .trust import Trust
from .versions import toolchain_versions

RING_SLOTS = 8
IDLE_TIMEOUT_S = 3600  # a leader with no step for this long is stuck (a server may idle long)


class RankFailed(DeepinferError):
    pass


def torchrun_ring_name() -> str:
    """This host's ring's /dev/shm name under torchrun, where its ranks find it by name (torchrun's
    ranks share MASTER_PORT and the run id, and nothing else the writer could hand them; the host
    index keeps two hosts' rings apart where they share /dev/shm, as on one test machine)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"deepinfer-{run}-{os.environ['MASTER_PORT']}-host{os.environ.get('GROUP_RANK', '0')}"


def host_position(rank: int, world_size: int) -> tuple[int, int, int]:
    """(host index, rank on the host, ranks on the host): torchrun's GROUP_RANK, LOCAL_RANK and
    LOCAL_WORLD_SIZE; one host for the ranks deepinfer-run spawns itself."""
    env = os.environ
    if "LOCAL_RANK" in env and "DEEPINFER_RING_FD" not in env:
        return int(env.get("GROUP_RANK", 0)), int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", world_size))
    return 0, rank, world_size


def create_host_ring(n_readers: int, width: int) -> ShmRing:
    """This host's ring under torchrun, by name (a file of that name is stale: torchrun holds
    MASTER_PORT for this run)."""
    name = torchrun_ring_name()
    (SHM_DIR / name).unlink(missing_ok=True)
    return ShmRing.create(n_readers, payload_words(width), RING_SLOTS, name=name)


def node_size(manifest) -> int | None:
    return manifest.parallel.get("hierarchical_allreduce") or None


def max_bucket(manifest) -> int:
    """The widest step record (ring sizes must agree on every rank)."""
    return max(max(b) for b in manifest.buckets.values())


def join(executor: BundleExecutor, rank: int, world_size: int, master_addr: str, master_port: int):
    """Join the process groups with this rank's loaded bundle, and check every rank loaded the same
    one. Returns the group that carries step records to the other hosts (None on one host)."""
    from .collectives import set_hosts, share_memory_on_hosts
    from .distributed import init_groups

    m = executor.manifest
    init_groups(rank, world_size, m.parallel["tp"], master_addr, master_port, node_size=node_size(m), cp=m.parallel.get("cp", 1))
    host, local_rank, _ = host_position(rank, world_size)
    mine = {"rank": rank, "manifest": sha256_file(executor.bundle / "manifest.json"), "toolchain": toolchain_versions(),
            "world_size": m.parallel["world_size"], "host": host, "local_rank": local_rank, "pid": os.getpid()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)  # also the barrier after which the rings may be unlinked
    for other in everyone:
        for key in ("manifest", "toolchain", "world_size"):
            if other[key] != mine[key]:
                raise RankFailed(f"rank {other['rank']} (host {other['host']}) loaded a different {key} than rank {rank} "
                                 f"({other[key]} vs {mine[key]}): every rank must run the same bundle and toolchain.")
    set_hosts({other["rank"]: other["host"] for other in everyone})
    share_memory_on_hosts({other["rank"]: other["pid"] for other in everyone}, {other["rank"]: other["host"] for other in everyone})
    return relay_group(everyone)


def relay_group(everyone: list[dict]):
    """Rank 0 and the first rank of every other host: the group step records travel in. Every rank
    creates it (torch.distributed requires it); it has no collective timeout shorter than the
    ring's idle bound, since it waits for the next step."""
    from datetime import timedelta

    firsts = sorted(other["rank"] for other in everyone if other["local_rank"] == 0)
    if len(firsts) == 1:
        return None
    group = dist.new_group(firsts, timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return group if dist.get_rank() in firsts else None


class Leader:
    """The executor the engine drives on rank 0: feeds each step to the followers, then runs it.

    Rank 0 admits the bundle (manifest signature, toolchain, native-code policy, host check)
    before any follower starts, so a bundle this deployment refuses is refused before anything
    else runs; then every rank loads its shard at once (each hashes the files it reads, and a rank
    that finds a bad one stops the job), so start-up takes one rank's load, not W. Spawned
    followers get the ring as an inherited descriptor of an already unlinked file and write their
    output to unnamed temporary files: nothing of the job is left in /dev/shm or the temp dir,
    however it ends."""

    def __init__(self, bundle: Path, torchrun: bool = False, trust: Trust = Trust(), on_failure=None, progress: bool = False):
        """`on_failure(message)`, called on the watchdog thread once the followers are killed, replaces
        the default exit(1) when a follower dies (the server fails its requests first); `progress`:
        rank 0's load shows a progress bar."""
        self.bundle = Path(bundle)
        self.on_failure = on_failure
        self.followers: list[subprocess.Popen] = []
        self.logs: list = []  # each follower's unnamed output file
        self.stopping = False
        self.failing = threading.Lock()  # taken once, by whoever reports a dead follower first
        self.reported = threading.Event()  # set once that report is made (on_failure called)
        self.watchdog: threading.Thread | None = None
        self.relays = None  # the group to the other hosts' first ranks (torchrun --nnodes > 1)
        self.step_id = 0
        if not torchrun:
            # Ranks share this host's cores: W ranks each spinning up all cores' worth of OpenMP
            # threads thrash (torchrun sets 1 for the same reason).
            world_size = peek_world_size(self.bundle)
            self.threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world_size))
            torch.set_num_threads(int(self.threads))
        self.manifest, _ = admit(self.bundle, 0, trust)
        self.world_size = self.manifest.parallel["world_size"]
        if not torchrun:  # every rank runs from this host's bundle: all its weights must be there
            for rank in range(1, self.world_size):
                if self.manifest.weight_files[rank] not in self.manifest.files:
                    raise BundleError(weights_missing(self.bundle, self.manifest, rank))
        self.max_bucket = max_bucket(self.manifest)
        if torchrun:
            self.ring = create_host_ring(host_position(0, self.world_size)[2] - 1, self.max_bucket)
        else:
            self.ring = ShmRing.create(self.world_size - 1, payload_words(self.max_bucket), RING_SLOTS)
            self.ring.unlink()  # followers inherit the descriptor
        try:
            if torchrun:
                addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            else:
                addr, port = "127.0.0.1", free_port()
                self._spawn(addr, port, trust)
                self.watchdog = threading.Thread(target=self._watch, daemon=True)
                self.watchdog.start()
            self.executor = BundleExecutor(self.bundle, 0, trust, progress)
            self.relays = join(self.executor, 0, self.world_size, addr, port)
        except BaseException:
            self.shutdown(kill=True)
            raise
        finally:
            self.ring.unlink()  # (torchrun) every rank attached before join's all_gather returned

    def __getattr__(self, name):  # host_seconds, trace_events, write_trace: the local executor's
        if name == "executor":  # not loaded (yet)
            raise AttributeError(name)
        return getattr(self.executor, name)

    def _spawn(self, addr: str, port: int, trust: Trust):
        for rank in range(1, self.world_size):
            env = {**os.environ, "OMP_NUM_THREADS": self.threads, "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                   "MASTER_ADDR": addr, "MASTER_PORT": str(port), "DEEPINFER_RING_FD": str(self.ring.fd),
                   "DEEPINFER_LEADER_PID": str(os.getpid())}
            log = tempfile.TemporaryFile(prefix="deepinfer-rank-")  # no name on disk
            self.logs.append(log)
            self.followers.append(subprocess.Popen(
                [sys.executable, "-m", "deepinfer.runtime.follower", "--bundle", str(self.bundle), *trust.args()],
                env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(self.ring.fd,), preexec_fn=die_with_parent))

    def _watch(self):
        while not self.stopping:
            for rank, process in enumerate(self.followers, start=1):
                code = process.poll()
                if code is not None and not self.stopping:
                    self._fail(rank, code)
            time.sleep(0.05)

    def last_words(self, rank: int) -> str:
        """The end of a spawned follower's output (read without moving its write position)."""
        fd = self.logs[rank - 1].fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, 2000, max(0, size - 2000)).decode(errors="replace").strip() or "(nothing)"

    def check_followers(self, grace_s: float = 2.0):
        """Report a follower that has ended, as the watchdog would: called when a collective failed,
        which a dead peer causes before the watchdog's next look. A killed process closes its
        sockets before it can be reaped, so the peers' collective can fail first: wait up to
        `grace_s` for the follower that is ending."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.followers, start=1):
                code = process.poll()
                if code is not None:
                    self._fail(rank, code)
                    self.reported.wait(max(0.0, deadline - time.monotonic()))  # (the watchdog may be the one reporting)
                    return
            if not self.followers or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _fail(self, rank: int, code: int):
        if not self.failing.acquire(blocking=False):
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        what = f"rank {rank} (pid {self.followers[rank - 1].pid}) {how}"
        sys.stderr.write(f"deepinfer: {what}; the job stops.\nrank {rank}'s last words:\n{self.last_words(rank)}\n")
        sys.stderr.flush()
        self.shutdown(kill=True)
        if self.on_failure is None:
            os._exit(1)
        self.on_failure(what)
        self.reported.set()

    def run(self, step: Step):
        record = encode(step, self.max_bucket)
        self._send_to_other_hosts(record)
        self.ring.write(self.step_id, record)
        self.step_id += 1
        return self.executor.run(step)

    def _send_to_other_hosts(self, record):
        if self.relays is None:
            return
        try:
            dist.broadcast(torch.from_numpy(record), src=0, group=self.relays)
        except (RuntimeError, dist.DistError) as err:
            firsts = dist.get_process_group_ranks(self.relays)[1:]
            raise RankFailed(f"rank 0: sending step {self.step_id} to the other hosts' first ranks {firsts} failed "
                             f"({str(err).strip().splitlines()[0]}): a rank on another host died or stopped responding "
                             "(torchrun's output on that host names it), so the job stops.") from None

    def shutdown(self, kill: bool = False):
        """Stop the followers: a stop record and a wait, or (kill) SIGKILL at once. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            # A daemon thread still running while the interpreter exits can abort it (SIGABRT,
            # "terminate called without an active exception") on a busy host.
            self.watchdog.join()
        if not kill:  # spawned followers, or torchrun's
            try:
                stop = encode(None, self.max_bucket)
                self._send_to_other_hosts(stop)
                self.ring.write(self.step_id, stop, timeout=10)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

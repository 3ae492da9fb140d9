"""A fork server for compile workers: one process imports torch and the backends once, then forks
a worker per job. A fresh `python -m deepinfer.compiler.worker` spends ~2.7 s importing torch
before it looks at its region; bisect runs dozens of small trials, so that was most of its time.

    zygote = Zygote()                                   # started by the compiler, dies with it
    process = zygote.spawn(["region.ep.pt2", "out", "--backend", "export", ...], log_path)
    process.wait(timeout=60)                            # like subprocess.Popen: TimeoutExpired, returncode

Each forked worker runs `worker.main` in a session of its own (the compiler kills a hung one with
its process group, as it would a spawned one), writes its output to the job's log, and dies with
the zygote (PR_SET_PDEATHSIG), which ends when the compiler does (its stdin closes). Forking before any torch thread exists and from the
same pristine state every time keeps the workers independent of each other and of job order.

The protocol is JSON lines: the compiler writes {"id", "argv", "log"}; the zygote answers
{"id", "pid"} once it forked and {"pid", "returncode"} once that worker ended.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import threading


class ForkedProcess:
    """A worker forked by the zygote, with the part of Popen's interface the pool uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


class Zygote:
    def __init__(self):
        # The zygote ends when its stdin closes, which the kernel does however the compiler ends
        # (not PR_SET_PDEATHSIG: that would tie it to the thread that happened to start it).
        env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_COMPILER_PID"}
        self.process = subprocess.Popen([sys.executable, "-m", "deepinfer.compiler.zygote"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()
        self.next_id = 0
        self.forked: dict[int, ForkedProcess | None] = {}  # job id -> its worker, once forked
        self.forked_event = threading.Condition(self.lock)
        self.workers: dict[int, ForkedProcess] = {}  # pid -> worker (its pid always comes before its end)
        threading.Thread(target=self._read, daemon=True).start()

    def spawn(self, argv: list[str], log: str) -> ForkedProcess:
        with self.lock:
            job_id = self.next_id
            self.next_id += 1
            self.process.stdin.write((json.dumps({"id": job_id, "argv": argv, "log": log}) + "\n").encode())
            self.process.stdin.flush()
            while job_id not in self.forked:
                self.forked_event.wait(timeout=1)
                if job_id not in self.forked and self.process.poll() is not None:
                    raise RuntimeError(f"the compile workers' fork server exited ({self.process.returncode})")
            return self.forked.pop(job_id)

    def close(self):
        self.process.kill()
        self.process.wait()

    def _read(self):
        for line in self.process.stdout:
            message = json.loads(line)
            with self.lock:
                if "id" in message:
                    worker = ForkedProcess(message["pid"])
                    self.workers[worker.pid] = worker
                    self.forked[message["id"]] = worker
                    self.forked_event.notify_all()
                else:
                    worker = self.workers.pop(message["pid"])
                    worker.returncode = message["returncode"]
                    worker.ended.set()
        with self.lock:  # the zygote is gone (killed with its workers): nothing else will end
            for worker in self.workers.values():
                worker.returncode = -signal.SIGKILL
                worker.ended.set()
            self.forked_event.notify_all()


def _serve():
    """The zygote's loop: fork a worker per request, report each one's end."""
    from . import worker

    answers = os.dup(1)  # the protocol's own descriptor: anything printed goes to stderr
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the compiler's to handle
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (only to wake the selector)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wakeup_r:
                os.read(wakeup_r, 4096)
                _reap(answers)
                continue
            data = os.read(0, 65536)
            if not data:  # the compiler closed the pipe: it is gone
                os._exit(0)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                _preload(request["argv"])
                pid = _fork(worker.main, request["argv"], request["log"], closing=(answers, wakeup_r, wakeup_w))
                _say(answers, {"id": request["id"], "pid": pid})


def _preload(argv: list[str]):
    """Import the job's backend and the modules it names in PRELOAD (heavy, thread-free imports:
    torch-mlir and jax for pjrt, ~1.6 s) once here, so every worker forks with them loaded."""
    import importlib

    backend = argv[argv.index("--backend") + 1] if "--backend" in argv else None
    if backend is None or backend in _preloaded:
        return
    _preloaded.add(backend)
    try:
        module = importlib.import_module(f"deepinfer.compiler.backends.{backend}")
        for name in getattr(module, "PRELOAD", ()):
            importlib.import_module(name)
    except ImportError:
        pass  # (the worker reports it)


_preloaded: set[str] = set()


def _fork(main, argv: list[str], log: str, closing: tuple[int, ...]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for fd in closing:  # the zygote's own pipes
            os.close(fd)
        from deepinfer.runtime.lifetime import die_with_parent

        die_with_parent()
        if os.getppid() != zygote:
            os._exit(1)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        main.main(args=argv, prog_name="deepinfer.compiler.worker", standalone_mode=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(answers: int):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(answers, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _say(answers: int, message: dict):
    os.write(answers, (json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    _serve()

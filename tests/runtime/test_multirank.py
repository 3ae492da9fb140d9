"""World sizes 2 and 4 on CPU (gloo, real follower processes) give the tokens of world size 1 and
of transformers on the same weights; a dead follower stops the job fast and leaves no shm behind."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import RecipeError, load_recipe
from tests.conftest import write_recipe
from tests.models.hf_tiny import hf_greedy, tiny_hf_checkpoint
from tests.runtime.conftest import left_since, leftovers

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 40)), [3] * 12 + [250, 251], [77, 78]]
MAX_TOKENS = 12
# World size 1 is the compiled == eager == transformers chain of test_executor and test_hf_parity.
LAYOUTS = {
    "ws2_tp2_ep2": {"world_size": 2, "tp": 2, "ep": 2},
    "ws4_tp1_ep4": {"world_size": 4, "tp": 1, "ep": 4},
    "ws4_tp2_ep2_hier": {"world_size": 4, "tp": 2, "ep": 2, "hierarchical_allreduce": 2},
    "ws4_cp2_tp2": {"world_size": 4, "tp": 2, "ep": 2, "cp": 2},  # context parallel: models/context_parallel.py
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny"), seed=3)


@pytest.fixture(scope="module")
def bundles(checkpoint, tmp_path_factory, cache_dir):
    _, directory = checkpoint
    work = tmp_path_factory.mktemp("multirank")
    out = {}
    for name, parallel in LAYOUTS.items():
        # ws2_tp2_ep2's prompt experts: the grouped form, 2 places per expert in a 32-token chunk (extra
        # passes run); the others' the exact form.
        grouped = {"expert_overflow": "branch", "expert_capacity": 0.25} if name == "ws2_tp2_ep2" else {}
        recipe = write_recipe(work, name, model={"checkpoint": str(directory), "config": None, **grouped},
                              parallel=parallel, backend={"name": "export"},
                              methods={"decode": {"buckets": [1, 2, 4]}, "prefill": {"buckets": [8, 32]}})
        out[name] = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle
    return out


RUN_SECONDS: dict[Path, float] = {}  # bundle -> how long its last plain run took, start-up included


def run_bundle(bundle: Path, *extra, timeout=300, env=None, prompts=PROMPTS) -> subprocess.CompletedProcess:
    args = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), *args,
                             "--max-tokens", str(MAX_TOKENS), "--json", *extra], capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode == 0 and not extra and env is None and prompts is PROMPTS:
        RUN_SECONDS[bundle] = time.monotonic() - start
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_tokens_of_world_size_1_and_of_transformers(bundles, checkpoint, layout):
    hf, _ = checkpoint
    shm_before = leftovers()
    result = run_bundle(bundles[layout])
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = [r["token_ids"] for r in json.loads(result.stdout)["results"]]
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    eos = hf.config.eos_token_id
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    assert tokens == expected
    assert not left_since(shm_before)  # nothing left behind


def test_one_region_set_serves_every_rank(bundles):
    manifest = json.loads((bundles["ws4_tp1_ep4"] / "manifest.json").read_text())
    assert manifest["weight_files"] == [f"weights/rank-{r}.safetensors" for r in range(4)]
    assert sorted(p.name for p in (bundles["ws4_tp1_ep4"] / "regions").iterdir()) == sorted(
        Path(r["file"]).name for r in manifest["regions"].values())
    # Routed experts: each rank holds 8 / ep = 2 of them; the collectives are in the schedule.
    from safetensors import safe_open

    with safe_open(bundles["ws4_tp1_ep4"] / "weights" / "rank-3.safetensors", "pt") as f:
        assert f.get_slice("layers.1.mlp.experts_gate_up").get_shape()[0] == 2
        assert int(f.get_tensor("layers.1.mlp.owned_begin")) == 6
    steps = manifest["programs"]["decode/1"]["steps"]
    assert [s["collective"]["op"] for s in steps if s["collective"]] == ["all_reduce", "all_reduce"]  # one per MoE layer
    hier = json.loads((bundles["ws4_tp2_ep2_hier"] / "manifest.json").read_text())["programs"]["decode/1"]["steps"]
    assert any(s["collective"] and s["collective"].get("hierarchical") for s in hier)


@pytest.mark.parametrize("parallel, message", [
    ({"world_size": 2, "tp": 2, "ep": 3}, "ep=3 must divide world_size=2"),
    ({"world_size": 3, "tp": 3, "ep": 1}, "tp=3 does not divide num_attention_heads=4"),
    ({"world_size": 4, "tp": 3, "ep": 1}, "world_size=4 must be tp=3 x replicas"),
    ({"world_size": 2, "tp": 2, "ep": 1, "hierarchical_allreduce": 2}, "parallel.hierarchical_allreduce"),
])
def test_bad_layouts_fail_at_compile_time_naming_the_numbers(tmp_path, parallel, message):
    from deepinfer.compiler.plan import plan

    with pytest.raises(RecipeError, match=message):
        plan(load_recipe(write_recipe(tmp_path, "bad", parallel=parallel)))


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def followers(pid: int) -> list[int]:
    """The follower ranks a leader spawned: not a short-lived child such as the `g++ --version` its
    kernels' cache key asks for (taken for a follower on a busy machine, it was gone when signalled)."""
    out = []
    for child in children(pid):
        try:
            if b"deepinfer.runtime.follower" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            continue
    return out


def generating_after(bundle: Path) -> float:
    """Seconds after which a run of this bundle started now is generating: past a whole short run
    (start-up, generation, exit) as measured on this machine, busy or not, by this module's
    earlier tests (or now, when a test runs alone): a rank stopped while loading would hold its
    leader for DEEPINFER_STARTUP_TIMEOUT instead of the collective timeout."""
    if bundle not in RUN_SECONDS:
        assert run_bundle(bundle).returncode == 0
    return 1.2 * RUN_SECONDS[bundle] + 1


def start_long_generation(bundle: Path, n_followers: int, env=None, prefill=False) -> tuple[subprocess.Popen, list[int]]:
    """The leader on 400 prompts x 200 tokens (minutes: far longer than any test waits, however idle
    the machine), once its followers run;
    `prefill`: on 400 prompts of 160 tokens x 1 token, so that every step is a prefill chunk."""
    if prefill:
        many = [a for i in range(400) for a in ("--prompt-ids", ",".join(str(3 + (i + j) % 300) for j in range(160)))]
    else:
        many = [a for i in range(400) for a in ("--prompt-ids", f"{i % 300 + 3},{i % 300 + 4},{i % 300 + 5}")]
    leader = subprocess.Popen([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), *many,
                               "--max-tokens", "1" if prefill else "200"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while len(followers(leader.pid)) < n_followers:
        assert time.monotonic() < deadline and leader.poll() is None
        time.sleep(0.1)
    return leader, sorted(followers(leader.pid))


def alive(pids: list[int]) -> bool:
    return any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2] for pid in pids)


@pytest.mark.parametrize("layout, prefill", [("ws4_tp1_ep4", False), ("ws4_cp2_tp2", True)], ids=["decoding", "cp-prefilling"])
def test_killed_follower_stops_the_job_within_10_seconds(bundles, layout, prefill):
    shm_before = leftovers()
    wait = generating_after(bundles[layout])
    leader, followers = start_long_generation(bundles[layout], 3, prefill=prefill)
    try:
        time.sleep(wait)
        assert leader.poll() is None, leader.stderr.read()
        os.kill(followers[1], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = leader.communicate(timeout=30)
        print(f"leader exited {time.monotonic() - killed:.2f} s after its follower was killed")
        assert time.monotonic() - killed < 10
    finally:
        if leader.poll() is None:
            leader.kill()
    assert leader.returncode != 0
    assert "was killed by SIGKILL; the job stops" in stderr and "rank " in stderr
    time.sleep(0.5)
    assert not alive(followers)  # the other followers are gone too
    assert not left_since(shm_before)


def test_a_follower_that_stops_responding_stops_the_job_after_the_collective_timeout(bundles):
    shm_before = leftovers()
    env = {**os.environ, "DEEPINFER_COLLECTIVE_TIMEOUT": "3"}
    wait = generating_after(bundles["ws2_tp2_ep2"])
    leader, followers = start_long_generation(bundles["ws2_tp2_ep2"], 1, env)
    try:
        time.sleep(wait)
        assert leader.poll() is None, leader.stderr.read()
        os.kill(followers[0], signal.SIGSTOP)  # alive, but never answers again
        stopped = time.monotonic()
        _, stderr = leader.communicate(timeout=30)
        print(f"leader exited {time.monotonic() - stopped:.2f} s after its follower stopped")
        assert time.monotonic() - stopped < 3 + 7
    finally:
        if leader.poll() is None:
            leader.kill()  # and so its followers (PR_SET_PDEATHSIG), stopped or not
    assert leader.returncode == 1
    # (all_reduce or the head's all_gather: whichever the leader waits in when its peer stops)
    assert re.search(r"rank 0: all_(reduce|gather) over group '(tp|world)' \(ranks \[0, 1\]\)", stderr), stderr
    assert "stopped responding" in stderr and "DEEPINFER_COLLECTIVE_TIMEOUT" in stderr
    time.sleep(0.5)
    assert not alive(followers)  # killed, though stopped
    assert not left_since(shm_before)


@pytest.mark.parametrize("knob", ["DEEPINFER_COLLECTIVE_TIMEOUT", "DEEPINFER_STARTUP_TIMEOUT"])
def test_a_bad_timeout_is_a_clear_error(bundles, knob):
    shm_before = leftovers()
    result = run_bundle(bundles["ws2_tp2_ep2"], env={**os.environ, knob: "soon"}, timeout=60)
    assert result.returncode == 1
    assert f"{knob}='soon': give the seconds" in result.stderr
    assert "Traceback" not in result.stderr
    assert not left_since(shm_before)


def test_a_follower_that_finds_its_shard_altered_stops_the_job(bundles, tmp_path):
    """Followers load beside rank 0: a weight file only rank 1 reads, altered, stops the job with
    rank 1's message naming the file, while rank 0 may still be loading."""
    bundle = tmp_path / "altered"
    shutil.copytree(bundles["ws2_tp2_ep2"], bundle)
    shard = bundle / "weights" / "rank-1.safetensors"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # (a byte of the last tensor: the header still parses)
    shard.write_bytes(bytes(data))
    shm_before = leftovers()
    result = run_bundle(bundle, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rank 1" in result.stderr and "rank-1.safetensors: checksum mismatch" in result.stderr, result.stderr[-2000:]
    assert not left_since(shm_before)


def test_a_short_collective_timeout_does_not_bound_start_up(bundles):
    # A follower starts once rank 0 has admitted the bundle and imports torch before it loads, so
    # the ranks meet seconds apart: about this collective timeout, which must not apply to the rendezvous.
    result = run_bundle(bundles["ws2_tp2_ep2"], env={**os.environ, "DEEPINFER_COLLECTIVE_TIMEOUT": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    failed = run_bundle(bundles["ws2_tp2_ep2"], env={**os.environ, "DEEPINFER_STARTUP_TIMEOUT": "0.5"})
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "did not all meet" in failed.stderr and "DEEPINFER_STARTUP_TIMEOUT" in failed.stderr


@pytest.mark.parametrize("signum, after", [(signal.SIGINT, 0.5), (signal.SIGKILL, 3), (signal.SIGINT, 6)],
                         ids=["ctrl-c-while-starting", "killed-while-followers-start", "ctrl-c-while-generating"])
def test_followers_end_with_the_leader(bundles, signum, after):
    shm_before = leftovers()
    leader, followers = start_long_generation(bundles["ws2_tp2_ep2"], 1)
    time.sleep(after)
    leader.send_signal(signum)
    leader.communicate(timeout=30)
    assert leader.returncode != 0
    deadline = time.monotonic() + 10
    while alive(followers):
        assert time.monotonic() < deadline, "a follower outlived its leader"
        time.sleep(0.1)
    assert not left_since(shm_before)  # nothing in /dev/shm or the temp dir, however the leader ended


def two_hosts(bundle: Path, *args: str) -> list[subprocess.Popen]:
    """torchrun on two "hosts" of 2 ranks each, on loopback: each its own torchrun (node 0 and 1),
    its own ring (they share this /dev/shm, as two hosts would not)."""
    from deepinfer.runtime.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                              "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "-m", "deepinfer.runtime.cli",
                              "--bundle", str(bundle), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in (0, 1)]


def test_two_torchrun_hosts_give_the_tokens_of_one(bundles):
    # (torchrun's launch: the README's `torchrun --nproc-per-node 2 -m deepinfer.runtime.cli` on one
    # host runs the same code, rank 0 leading the ranks torchrun started)
    shm_before = leftovers()
    args = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    hosts = two_hosts(bundles["ws4_tp1_ep4"], *args, "--max-tokens", str(MAX_TOKENS), "--json")
    (out, err), (_, err1) = (h.communicate(timeout=300) for h in hosts)
    assert hosts[0].returncode == 0 and hosts[1].returncode == 0, err[-2000:] + err1[-2000:]
    body = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    direct = json.loads(run_bundle(bundles["ws4_tp1_ep4"]).stdout)["results"]  # one host (== world size 1, transformers)
    assert [r["token_ids"] for r in body["results"]] == [r["token_ids"] for r in direct]
    assert not left_since(shm_before)


def test_a_killed_rank_on_the_second_host_stops_both(bundles):
    shm_before = leftovers()
    many = [a for i in range(400) for a in ("--prompt-ids", f"{i % 300 + 3},{i % 300 + 4},{i % 300 + 5}")]
    hosts = two_hosts(bundles["ws4_tp1_ep4"], *many, "--max-tokens", "200")
    try:
        # Host 1's ring appears once its first rank has loaded, and goes once every rank has joined.
        for ring_there in (True, False):
            deadline = time.monotonic() + 180
            while any(p.endswith("-host1") for p in leftovers() - shm_before) != ring_there:
                assert time.monotonic() < deadline and all(h.poll() is None for h in hosts)
                time.sleep(0.02)
        time.sleep(2)  # generating
        assert all(h.poll() is None for h in hosts)
        os.kill(max(children(hosts[1].pid)), signal.SIGKILL)  # a rank of host 1 (2 or 3)
        killed = time.monotonic()
        (_, err0), (_, err1) = (h.communicate(timeout=60) for h in hosts)
        print(f"both hosts ended {time.monotonic() - killed:.2f} s after the kill")
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
    assert hosts[0].returncode != 0 and hosts[1].returncode != 0
    assert "host 1 has [2, 3]" in err0 and "failed" in err0, err0[-4000:]  # the leader names the group's hosts
    assert re.search(r"rank\s*: [23] \(local_rank: [01]\)\s*\n\s*exitcode\s*: -9", err1)  # host 1's torchrun names the rank
    assert not left_since(shm_before)

"""`kvservice.core.thread_placement`: a worker on shared cores pins its compute threads a CPU
each and serves from idle CPU time. Run in a child process: the test runner's own threads must
keep their class and CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling calls")

_CHILD = textwrap.dedent("""
    import json, os, threading
    from kvservice.core.native_thread import name_native_thread
    from kvservice.core.thread_placement import SharedCorePlacement, serve_from_idle_time

    def parked(name, started, stop, idle=False):
        def run():
            name_native_thread(name)
            if idle:
                serve_from_idle_time()
            started.append(threading.get_native_id())
            stop.wait()
        return run

    def start(name, stop, idle=False):
        started = []
        thread = threading.Thread(target=parked(name, started, stop, idle))
        thread.start()
        while not started:
            pass
        return started[0]

    def state(tid):
        return {"cpus": sorted(os.sched_getaffinity(tid)), "idle": os.sched_getscheduler(tid) == os.SCHED_IDLE}

    cpus = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    loop = start("event-loop", stop)  # a serving thread, there before the placement
    placement = SharedCorePlacement()
    placement.update()  # from the step thread (this one), before its pool has a worker
    pool = start("kvs-pool", stop)  # the pool's first worker: started by the step thread, on its CPU
    placement.update()  # after the next step
    stage = start("kv-stage", stop, idle=True)  # started by the step thread, serving
    me = threading.get_native_id()
    print(json.dumps({"cpus": cpus, "step": state(me), "pool": state(pool), "loop": state(loop), "stage": state(stage)}))
    stop.set()
""")


def test_compute_threads_get_a_cpu_each_and_serving_threads_idle_time() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    cpus = report["cpus"]
    assert report["step"] == {"cpus": [cpus[0]], "idle": False}
    assert report["pool"] == {"cpus": [cpus[1 % len(cpus)]], "idle": False}  # moved off the step thread's CPU
    assert report["loop"] == {"cpus": cpus, "idle": True}
    assert report["stage"]["idle"] is True


def test_threads_keep_their_placement_without_a_core_lease() -> None:
    """AsyncLLMEngine places threads only for a worker on a core lease: a plain one leaves them."""
    child = textwrap.dedent("""
        import asyncio, json, os, threading
        from kvservice.config import EngineConfig
        from kvservice.core.sampling_params import SamplingParams
        from kvservice.engine.async_engine import AsyncLLMEngine
        from kvservice.engine.engine import LLMEngine

        async def main():
            engine = AsyncLLMEngine(LLMEngine("tiny", EngineConfig(block_size=8, num_blocks=32, max_model_len=128)))
            engine.start()
            async for _ in engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
                pass
            await engine.stop()

        asyncio.run(main())
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print(json.dumps([os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids]))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    assert not any(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_cluster_on_shared_cores_serves_from_idle_time_and_computes_at_normal_class() -> None:
    """1P1D on one core lease: after a request, each worker's event loop (its main thread) and
    the proxy are at SCHED_IDLE, each worker's step thread is not."""
    from conftest import local_cluster

    from kvservice.client.client import KVServiceClient

    async with local_cluster("tiny", worker_args=["--num-threads", "1"]) as cluster:
        async with KVServiceClient(cluster.address) as client:
            completion = await client.complete([5, 6, 7, 8], timeout=60, max_tokens=4, temperature=0, ignore_eos=True)
        assert len(completion.token_ids) == 4
        pids = {child.name: child.process.pid for child in cluster.children}
        assert os.sched_getscheduler(pids["proxy"]) == os.SCHED_IDLE
        for name in ("prefill-0", "decode-0"):
            pid = pids[name]
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE, name  # its main thread: the event loop
            steps = [int(t) for t in os.listdir(f"/proc/{pid}/task") if _comm(pid, t) == "engine-step"]
            assert steps and all(os.sched_getscheduler(t) != os.SCHED_IDLE for t in steps), name


def _comm(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as comm:
        return comm.read().strip()

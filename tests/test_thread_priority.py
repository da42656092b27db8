"""Serving threads a step below compute threads: lower_serving_threads raises every thread's nice
value but the compute threads', and threads started afterwards inherit it. Run in a child
process: nice values only go up without privilege, and this one's threads must stay as they are."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, os, threading
    from kvservice.runtime.native_thread import name_native_thread
    from kvservice.runtime.thread_priority import SERVING_NICE, lower_serving_threads

    def nice(tid):
        return os.getpriority(os.PRIO_PROCESS, tid)

    base = nice(threading.get_native_id())  # what this process started with (0, unless run under nice)
    ids, release = {}, threading.Event()
    def park(role, name):
        if name:
            name_native_thread(name)
        ids[role] = threading.get_native_id()
        release.wait()

    threads = [threading.Thread(target=park, args=args) for args in
               (("step", None), ("pool", "kvs-pool"), ("named_step", "engine-step"), ("serving", "kv-transfer"))]
    for t in threads:
        t.start()
    while len(ids) < len(threads):
        threading.Event().wait(0.001)
    changed = lower_serving_threads([ids["step"]])
    later = threading.Thread(target=park, args=("later", None))
    later.start()
    while "later" not in ids:
        threading.Event().wait(0.001)
    result = {role: nice(tid) for role, tid in ids.items()}
    result["main"] = nice(threading.get_native_id())
    result["changed"], result["serving_nice"], result["base"] = changed, SERVING_NICE, base
    release.set()
    print(json.dumps(result))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")
def test_serving_threads_go_below_compute_threads_and_new_threads_inherit_it() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True).stdout
    nice = json.loads(out)
    base, serving = nice["base"], max(nice["base"], nice["serving_nice"])
    assert nice["serving_nice"] > 0
    assert nice["step"] == nice["pool"] == nice["named_step"] == base  # compute threads, by id and by name
    assert nice["serving"] == nice["main"] == nice["later"] == serving
    if base < serving:
        assert nice["changed"] >= 2  # the main thread and kv-transfer at least

"""The GPU tier's engine groups end with the session, also when a signal ends it."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.gpu.process_groups import ProcessGroups

ROOT = Path(__file__).resolve().parents[2]
# A leader and a grandchild in one new session, as a scenario and its engine are.
GROUP = ["bash", "-c", "sleep 60 & echo $!; wait"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of this process stays a zombie until reaped: that is not alive.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _gone(pids, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_kill_all_ends_every_process_of_every_registered_group():
    groups = ProcessGroups()
    procs = [subprocess.Popen(GROUP, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    grandchildren = [int(p.stdout.readline()) for p in procs]
    for p in procs:
        groups.add(p.pid)
    groups.discard(procs[1].pid)
    assert groups.kill_all() == [procs[0].pid]
    procs[0].wait(timeout=5)
    assert _gone([grandchildren[0]])
    assert _alive(grandchildren[1])  # not registered any more: left alone
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait(timeout=5)
    assert groups.kill_all() == []


def test_sigterm_ends_the_groups_then_the_process():
    script = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.gpu.process_groups import ProcessGroups
        groups = ProcessGroups()
        p = subprocess.Popen({GROUP!r}, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        grandchild = int(p.stdout.readline())
        groups.add(p.pid)
        groups.end_on(signal.SIGTERM)
        print(p.pid, grandchild, flush=True)
        time.sleep(60)
    """)
    session = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in session.stdout.readline().split()]
    assert all(_alive(p) for p in pids)
    session.send_signal(signal.SIGTERM)
    assert session.wait(timeout=10) == -signal.SIGTERM
    assert _gone(pids)

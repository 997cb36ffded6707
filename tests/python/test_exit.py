"""A Python program that ends while its daemon threads wait in kvlink exits cleanly."""

import subprocess
import sys

EXIT_WHILE_WAITING = """
import atexit
# Runs after kvlink's own exit hook (registered later, so run first): the exiting thread
# still calls into kvlink.
atexit.register(lambda: engine.close())
import threading, time, kvlink, kvlink.events
engine = kvlink.Engine(transport="tcp")
publisher = kvlink.events.Publisher("tcp://*:0")
subscriber = kvlink.events.Subscriber(publisher.endpoint.replace("*", "127.0.0.1"))
def wait_for_requests():
    while True:
        engine.wait_finished(0.05)
def wait_for_events():
    while True:
        subscriber.next(0.05)
for target in [wait_for_requests] * 3 + [wait_for_events]:
    threading.Thread(target=target, daemon=True).start()
time.sleep(0.2)
print("main done", flush=True)
"""


def test_a_program_exits_cleanly_while_daemon_threads_wait_in_kvlink():
    # CPython (before 3.14) ends a daemon thread that takes the GIL back during finalization
    # with pthread_exit; unwound through the binding's frames that aborted the process ("FATAL:
    # exception not rethrown") or, in the wheel linked by zig, crashed it, every time here,
    # before kvlink's threads stopped coming back to the GIL once the interpreter exits.
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", EXIT_WHILE_WAITING], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0 and "main done" in p.stdout, (p.returncode, p.stderr[-2000:])
        assert "FATAL" not in p.stderr, p.stderr[-2000:]

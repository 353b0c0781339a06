"""A SystemExit that a SIGTERM handler raises inside a finaliser: no traceback, and the process exits."""

import subprocess
import sys
import textwrap

import pytest

# As a Ray worker is set up: a SIGTERM handler that raises SystemExit; then the exit request
# lands inside a weakref callback, where it cannot propagate.
PROGRAM = textwrap.dedent("""
    import signal, sys, time, weakref
    {install}
    def ray_like_handler(signum, frame):
        sys.exit(1)
    signal.signal(signal.SIGTERM, ray_like_handler)

    class Thing:
        pass
    def finaliser(_):
        raise SystemExit(1)   # what the handler raises when the signal comes during the callback
    thing = Thing()
    ref = weakref.ref(thing, finaliser)
    del thing
    time.sleep(5)
    print("still running")
""")


def run(install: bool) -> subprocess.CompletedProcess:
    code = PROGRAM.format(install="from orchestrator.trial.worker_exit import exit_requests_survive_finalisers; "
                                  "exit_requests_survive_finalisers()" if install else "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_without_the_hook_python_prints_a_traceback_and_carries_on():
    proc = run(install=False)
    assert "Exception ignored in" in proc.stderr and "Traceback" in proc.stderr
    assert "still running" in proc.stdout and proc.returncode == 0


def test_with_the_hook_the_exit_happens_without_a_traceback():
    proc = run(install=True)
    assert proc.stderr == "" and proc.stdout == ""
    assert proc.returncode == 1


def test_other_unraisable_errors_still_reach_the_hook_before_it():
    code = textwrap.dedent("""
        import sys, weakref
        seen = []
        sys.unraisablehook = lambda u: seen.append(type(u.exc_value).__name__)
        from orchestrator.trial.worker_exit import exit_requests_survive_finalisers
        exit_requests_survive_finalisers()
        exit_requests_survive_finalisers()  # a reused worker's next trial: installed once
        class Thing: pass
        def finaliser(_): raise ValueError("boom")
        thing = Thing(); ref = weakref.ref(thing, finaliser); del thing
        print(seen)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "['ValueError']", proc.stderr


pytestmark = pytest.mark.filterwarnings("ignore")

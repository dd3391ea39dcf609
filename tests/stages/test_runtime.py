"""stages/shared/runtime.py: the progress line."""

from __future__ import annotations


def test_progress_says_a_value_was_not_measured_instead_of_nan(capsys, monkeypatch):
    """dapo, gspo and cispo skip the reference pass: their KL is NaN, shown as not measured, not as 'nan'."""
    from stages.shared.runtime import Progress

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    progress = Progress("ppo", total=2, every=0.0)
    progress.update(1, reward=0.5, kl=float("nan"))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ppo: step 1/2, ") and line.endswith("reward 0.5, kl not measured")


def test_a_sigterm_that_lands_where_python_swallows_exceptions_still_interrupts(capsys):
    """A signal's handler can run inside a `__del__` or a weakref callback (CI saw it in the import system's module-lock
    callback), where CPython prints "Exception ignored" and goes on: the stage then ran to the end and exited 0. The
    swallowed interrupt is raised again at the next point that can take it, and nothing is printed for it."""
    import os
    import signal
    import time

    import pytest

    from stages.shared.runtime import terminate_as_interrupt

    class SignalledWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:  # the handler runs here, between two bytecodes of __del__
                pass

    after, before = [], (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with terminate_as_interrupt():
            SignalledWhileCollected()  # collected at once: __del__ runs, its KeyboardInterrupt is swallowed
            after.append("the block went on")
            time.sleep(5)  # the interrupt comes back within 10 ms
    assert after == ["the block went on"]
    assert "Exception ignored" not in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # the handlers as they were

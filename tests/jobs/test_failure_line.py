"""What a failed rank's sentence names as the cause (``agents.failure_line``)."""

from __future__ import annotations

from jobs.actions.agents import failure_line

TRACEBACK = """step 1
Traceback (most recent call last):
  File "train.py", line 9, in <module>
    raise RuntimeError("deliberate failure at step 2 on rank 1")
RuntimeError: deliberate failure at step 2 on rank 1
"""


def test_the_exception_of_the_last_traceback_not_what_an_abort_printed_after_it():
    # SIGABRT in the interpreter's teardown (gloo's threads) prints after the traceback.
    tail = TRACEBACK + "terminate called without an active exception\n"
    assert failure_line(tail) == "RuntimeError: deliberate failure at step 2 on rank 1"
    assert failure_line("old\n" + TRACEBACK.replace("deliberate", "earlier") + TRACEBACK) == \
        "RuntimeError: deliberate failure at step 2 on rank 1"


def test_without_a_traceback_the_last_line_said():
    assert failure_line("loading\nSegmentation fault (core dumped)\n\n") == "Segmentation fault (core dumped)"
    assert failure_line("") == ""


def test_an_abort_printed_in_the_middle_of_the_traceback_is_not_the_cause():
    # Should gloo's threads abort while Python still prints the frames, the abort's line lands
    # between the header and the exception.
    lines = TRACEBACK.splitlines()
    tail = "\n".join([*lines[:2], "terminate called without an active exception", *lines[2:]]) + "\n"
    assert failure_line(tail) == "RuntimeError: deliberate failure at step 2 on rank 1"
    dotted = tail.replace("RuntimeError:", "torch.distributed.DistBackendError:")
    assert failure_line(dotted) == ("torch.distributed.DistBackendError: deliberate failure at step 2 "
                                    "on rank 1")
    bare = "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\nKeyboardInterrupt\n"
    assert failure_line(bare) == "KeyboardInterrupt"


def test_a_traceback_without_an_exception_line_names_its_first_unindented_line():
    tail = "Traceback (most recent call last):\n  File \"t.py\", line 1\nkilled by the OOM killer\n"
    assert failure_line(tail) == "killed by the OOM killer"


def test_torchruns_rank_prefix_is_read_past():
    # torchrun prefixes every line a rank prints; the C++ abort's own line comes unprefixed after.
    prefixed = "".join(f"[rank1]: {line}\n" for line in TRACEBACK.splitlines())
    tail = prefixed + "terminate called without an active exception\n"
    assert failure_line(tail) == "RuntimeError: deliberate failure at step 2 on rank 1"
    assert failure_line("[default0]:loading\n[default0]:Segmentation fault\n") == "Segmentation fault"

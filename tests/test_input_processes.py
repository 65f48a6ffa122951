"""Input over several processes: uneven sources never hang, positions resume per process.

One run of tests/multiprocess/uneven_input.py as 2 processes x 4 host devices, process 1's
source shorter than process 0's (or failing). These tests start processes, so they run once,
in the 8-device pass of the suite; the run is bounded by a timeout, which a process left
waiting alone in a collective would exceed.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "multiprocess"
TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    """What each of the 2 processes saw, and the run's seconds under "seconds"."""
    out = tmp_path_factory.mktemp("uneven_input")
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "jmirror.launch", "--processes", "2", "--devices-per-process"]
        + ["4", str(HERE / "uneven_input.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seconds = time.monotonic() - start
    return [
        dict(json.loads((out / f"process{i}.json").read_text()), seconds=seconds) for i in (0, 1)
    ]


# Global batch b holds 100 * b + row for its 2N = 16 rows: a step's all-reduced sum.
SUMS = [1600 * b + 120 for b in range(5)]
SHORT = "the input of process 1 ended after {} batches, while process 0 still had more"


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize("again", ["", "/again"])
def test_uneven_dataset_ends_at_the_same_step_on_every_process(seen, remainder, prefetch, again):
    for process in seen:
        got = process[f"dataset/{remainder}/prefetch{prefetch}{again}"]
        assert (got["steps"], got["error"]) == (3, None)
        assert got["sums"] == SUMS[:3]  # each step summed every process's rows
        assert len(got["warnings"]) == 1 and SHORT.format(3) in got["warnings"][0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_uneven_pipelines_of_a_function_end_at_the_same_step(seen, prefetch):
    for index, process in enumerate(seen):
        got = process[f"function/prefetch{prefetch}"]
        assert (got["steps"], got["error"]) == (2, None)
        # Step s: process p's replica r got 10 p + 4 s + r, in 2 rows.
        assert got["sums"] == [
            2 * sum(10 * p + 4 * s + r for p in (0, 1) for r in range(4)) for s in range(2)
        ]
        assert SHORT.format(2) in got["warnings"][-1]
        if index == 1:  # its two leftover elements are dropped with the usual warning
            assert "ran out after 2 of the 4" in got["warnings"][0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failing_source_stops_every_process_at_that_step(seen, prefetch):
    first, second = (process[f"error/prefetch{prefetch}"] for process in seen)
    assert first["steps"] == second["steps"] == 2
    assert second["error"] == "ValueError: process 1's loader broke"  # its own error
    assert first["error"].startswith("RuntimeError: jmirror: the input of process 1 raised")
    assert "at step 2" in first["error"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_positions_resume_per_process(seen, prefetch):
    for process in seen:
        got = process[f"position/prefetch{prefetch}"]
        assert got["first"] == SUMS[:2]
        assert got["position"]["batches"] == 2
        # Resumed at batch 2; process 1 has 4 batches, process 0 has 5: both stop after 4.
        assert (got["steps"], got["sums"]) == (2, SUMS[2:4])
        assert SHORT.format(2) in got["warnings"][0]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    "kind, step, differs",
    [
        ("trailing", 1, "batch['x']: float32[rows, 3] on process 0, float32[rows, 4] on process 1"),
        ("dtype", 0, "batch['x']: float32[rows, 3] on process 0, int32[rows, 3] on process 1"),
        ("structure", 2, "batch['y']: int32[rows] on process 0, nothing on process 1"),
    ],
)
def test_batches_that_differ_between_processes_stop_every_process(
    seen, kind, step, differs, prefetch
):
    # Every process names the leaf that differs and what each process has there.
    for process in seen:
        got = process[f"layout/{kind}/prefetch{prefetch}"]
        assert got["steps"] == step  # the steps before it ran, on every process
        assert got["error"].startswith("ValueError: strategy.distribute_dataset: at step")
        assert f"at step {step} the processes' batches differ" in got["error"]
        assert re.search(rf"over .*: {re.escape(differs)}\. One global batch", got["error"]), got[
            "error"
        ]


def test_elements_that_differ_between_pipelines_stop_every_process(seen):
    for process in seen:
        got = process["layout/function"]
        assert got["steps"] == 0
        assert "at step 0 the processes' elements differ" in got["error"]
        assert "element: float32[2, 3] on process 0, float32[2, 5] on process 1" in got["error"]


def test_the_run_is_short(seen):
    assert seen[0]["seconds"] < 60, seen[0]["seconds"]

"""Process-local input and positions across process counts: 2 processes x 4 against 1 x 8.

tests/multiprocess/local_input.py runs twice: as 2 processes x 4 host devices, each reading
only its share of every global batch (`process_local=True`) and taking positions, then as
1 process x 8 host devices, which reads the global batches (the oracle) and resumes from
the positions the first run saved. These tests start processes, so they run once, in the
8-device pass of the suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grain")

HERE = Path(__file__).parent / "multiprocess"
TIMEOUT_S = 180
G, K = 16, 3  # the global batch, and the batches received before each position

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)


def _launch(out: Path, processes: int, mode: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "jmirror.launch", "--processes", str(processes)]
        + ["--devices-per-process", str(8 // processes), str(HERE / "local_input.py")]
        + [str(out), mode],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> tuple[list[dict], dict]:
    """What each of the 2 processes saw, and what the one process saw."""
    out = tmp_path_factory.mktemp("local_input")
    _launch(out, 2, "two")
    _launch(out, 1, "one")
    two = [json.loads((out / f"process{i}.json").read_text()) for i in (0, 1)]
    return two, json.loads((out / "one.json").read_text())


def _share_rows(process: int, rows: int) -> list[int]:
    """The grain rows of process `process`: G/2-row blocks dealt to the 2 processes in turn."""
    return [r for r in range(rows) if (r // (G // 2)) % 2 == process]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_numpy_shares_equal_one_process_over_the_global_batches(seen, remainder, prefetch):
    two, one = seen
    key = f"numpy/{remainder}/{prefetch}"
    want = one[key]
    assert want["error"] is None and len(want["batches"]) == (6 if remainder == "pad" else 5)
    for process in two:
        assert process[key]["error"] is None and process[key]["warnings"] == []
        assert process[key]["batches"] == want["batches"]
    if remainder == "pad":  # the short last batch: process 1's share padded at its end
        assert want["batches"][-1]["mask"] == [True] * 12 + [False] * 4
    # Rows read: process 0 its 8 of every batch, process 1 its 8 and the short share's 4.
    assert [process[key]["rows"] for process in two] == [6 * 8, 5 * 8 + 4]
    assert want["rows"] == 5 * G + 12


def test_uneven_shares_end_at_the_same_step_on_every_process(seen):
    two, one = seen
    for process in two:
        got = process["uneven"]
        assert got["error"] is None and got["batches"] == one["numpy/drop/0"]["batches"][:3]
        assert "the input of process 1 ended after 3 batches" in got["warnings"][0]


def test_grain_shares_equal_one_process_and_each_reads_only_its_rows(seen):
    two, one = seen
    rows = 7 * G
    assert one["grain"]["rows"] == list(range(rows))
    for index, process in enumerate(two):
        assert process["grain"]["batches"] == one["grain"]["batches"]
        assert process["grain"]["rows"] == _share_rows(index, rows)


def test_grain_shares_resume_from_their_state_reading_nothing_again(seen):
    two, one = seen
    for index, process in enumerate(two):
        got = process["grain_resume"]
        assert got["position"]["source_state"] == {"json": {"next_index": K}}
        assert got["first"] + got["batches"] == one["grain"]["batches"]
        assert sorted(got["rows"]) == [r for r in _share_rows(index, 7 * G) if r >= K * G]


def test_a_count_position_of_two_processes_restores_on_one(seen):
    two, one = seen
    assert one["count_resume"]["error"] is None
    assert one["count_resume"]["batches"] == one["numpy/drop/0"]["batches"][K:]


def test_a_global_grain_state_of_two_processes_resumes_in_a_new_process(seen):
    two, one = seen
    got = one["global_grain_resume"]
    assert got["batches"] == one["grain"]["batches"][K:]
    assert sorted(got["rows"]) == list(range(K * G, 7 * G))  # nothing received read again


def test_a_process_local_state_that_cannot_move_is_refused_before_the_first_batch(seen):
    _, one = seen
    got = one["refused"]
    assert got["batches"] == [] and got["rows"] == []
    assert got["error"].startswith("ValueError: strategy.distribute_dataset(start=...)")
    for words in ("P=2 processes", "P'=1", "Resume on 2 processes", "ElasticIterator"):
        assert words in got["error"]


def test_an_elastic_iterator_state_moves_from_two_processes_to_one(seen):
    two, one = seen
    assert two[0]["elastic_position"]["source_state"] == {"json": {"global_next_index": K * G}}
    assert one["elastic_resume"]["batches"] == one["grain"]["batches"][K:]


def test_datasets_from_function_positions_resume_per_process(seen):
    two, _ = seen
    for process in two:
        got = process["function"]
        assert got["error"] is None and got["first"] + got["batches"] == got["whole"]
        assert len(got["whole"]) == 4


def test_positions_travel_through_a_checkpoint_manager_per_process(seen):
    two, _ = seen
    for process in two:
        assert process["manager_data"] == process["manager_position"]


def test_shares_of_different_sizes_are_refused_on_every_process(seen):
    two, _ = seen
    for process in two:
        got = process["mismatch"]
        assert got["batches"] == [] and got["error"].startswith("ValueError")
        assert "process 0: 8, process 1: 4 rows" in got["error"]

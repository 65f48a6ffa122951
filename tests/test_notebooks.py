"""Executes every notebook in `notebooks/` in a fresh kernel and checks it is stored clean.

Each notebook sets its own host device count (8) in its first cell, so the notebooks are executed
in the suite's 8-device pass (`JMIRROR_TEST_DEVICES` unset or 8). Those written for any device
count (`ANY_DEVICE_COUNT`) also run in the other passes, with that first call changed to the
pass's count; the others are skipped there. The checks on the stored files run in every pass.
"""

import os
import pathlib
import sys

import pytest

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))
EXPECTED = {
    "01_quickstart.ipynb",
    "02_sync_on_read_and_merge_call.ipynb",
    "03_migrating_from_tf_distribute.ipynb",
    "04_from_pmap_and_flax.ipynb",
    "05_checkpoints.ipynb",
    "06_nnx.ipynb",
    "07_spanning_devices.ipynb",
    "08_equinox.ipynb",
}
# Notebooks that must work on however many devices the kernel sees, 1 included.
ANY_DEVICE_COUNT = {"04_from_pmap_and_flax.ipynb"}
DEVICE_COUNT_CALL = "set_host_device_count({})"
# Appended to the in-memory copy of each notebook: the kernel must be this Python.
PREFIX_CELL = "import sys; print(sys.prefix)"

SKIP_REASON = (
    "the notebooks ask for 8 host devices in their first cell; they run in the suite's "
    "8-device pass only (JMIRROR_TEST_DEVICES unset or 8)"
)


def _read(name: str):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    nbformat.validate(nb)
    return nb


def _ask_for_devices(nb, count: str) -> None:
    """Changes the first code cell's `set_host_device_count(8)` to ask for `count` devices."""
    first = next(cell for cell in nb.cells if cell.cell_type == "code")
    assert DEVICE_COUNT_CALL.format(8) in first.source, first.source
    first.source = first.source.replace(
        DEVICE_COUNT_CALL.format(8), DEVICE_COUNT_CALL.format(count)
    )


def test_every_notebook_is_listed():
    assert set(NOTEBOOKS) == EXPECTED


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    nb = _read(name)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: code cell {index} has stored outputs"
            assert cell.execution_count is None, f"{name}: code cell {index} has a count"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    devices = os.environ.get("JMIRROR_TEST_DEVICES", "8")
    if devices != "8" and name not in ANY_DEVICE_COUNT:
        pytest.skip(SKIP_REASON)
    nb = _read(name)
    if devices != "8":
        _ask_for_devices(nb, devices)
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    nb.cells.append(nbformat.v4.new_code_cell(PREFIX_CELL))
    client = nbclient.NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{name} failed:\n{error}", pytrace=False)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"{name}: cell {index} raised {errors[0].ename}"
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    assert printed == sys.prefix, f"{name} ran in {printed!r}, not in {sys.prefix!r}"

"""The notebooks run as committed (their code cells in order, on this machine's device:
the CPU reference ops without a GPU) and are committed without outputs."""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_is_a_quickstart():
    assert [p.name for p in NOTEBOOKS if p.name == "quickstart.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_has_no_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        "commit notebooks without outputs (the GPU call carries the working tree)"
    namespace = {"__name__": "__main__"}
    for number, cell in enumerate(code):
        exec(compile("".join(cell["source"]), f"{path.name} cell {number}", "exec"), namespace)

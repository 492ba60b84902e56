"""benchmarks/compare_trees.py without a GPU: the table cells and the tree check."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare_trees.py"


@pytest.fixture(scope="module")
def compare_trees():
    spec = importlib.util.spec_from_file_location("compare_trees", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cell_is_the_mean_of_a_trees_runs_and_marks_their_spread(compare_trees):
    steady = compare_trees.cell([dict(us=100.0, pct=80.0), dict(us=102.0, pct=78.0)])
    assert steady.split() == ["101.0us", "79.0%"]
    moved = compare_trees.cell([dict(us=30.0, pct=50.0), dict(us=38.0, pct=40.0)])
    assert moved.split() == ["34.0us", "45.0%", "~"]
    assert compare_trees.cell([dict(error="ValueError: too long")]).strip() == \
        "ValueError: too long"
    assert compare_trees.cell([]).strip() == "missing"


def test_a_tree_without_the_package_is_refused(tmp_path):
    """A tree path that holds no quack_kernels/ would silently time the installed
    package: the child process refuses it instead."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--trees", str(tmp_path),
                          "--child", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode != 0
    assert "holds no quack_kernels package" in run.stderr

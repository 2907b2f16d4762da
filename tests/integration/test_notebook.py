"""The quickstart notebook runs top to bottom against a freshly trained export, from its own folder.

It is executed as a user runs it after the main job: the kernel's working directory is the
clone's ``notebooks/`` and no ``DSPARK_DRAFTER`` is set, so it must find the export at
``runs/stories260k/export`` under the clone's root (the folder holding ``pyproject.toml``). The
clone is a copy of the notebook and ``pyproject.toml`` in a temporary folder whose ``runs/`` links
to the test's training run, so the repository's own ``runs/`` is never touched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes_from_its_folder(stories260k_export, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    _, summary = stories260k_export
    clone = tmp_path / "clone"
    (clone / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", clone / "pyproject.toml")
    (clone / "runs" / "stories260k").mkdir(parents=True)
    (clone / "runs" / "stories260k" / "export").symlink_to(Path(summary["export_dir"]).resolve())
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_backup = dict(os.environ)
    os.environ.pop("DSPARK_DRAFTER", None)
    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(clone / "notebooks")}}
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"| from {clone.resolve() / 'runs/stories260k/export'}" in outputs
    assert "identical to plain decoding" in outputs
    assert "tau =" in outputs

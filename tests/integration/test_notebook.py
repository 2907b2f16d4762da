"""The quickstart notebook runs top to bottom against a freshly trained export."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import MODELS_DIR

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(stories260k_export):
    import nbformat
    from nbclient import NotebookClient

    _, summary = stories260k_export
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_backup = dict(os.environ)
    os.environ["DSPARK_DRAFTER"] = summary["export_dir"]
    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "identical to plain decoding" in outputs
    assert "tau =" in outputs

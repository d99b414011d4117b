"""``notebooks/quickstart.ipynb`` runs top to bottom on the CPU (nbclient, a fresh kernel)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs_and_shows_its_results(monkeypatch, tmp_path):
    # The real-model section's tiny fallback, even on a machine with an accelerator and the hub in reach;
    # its mp4 goes to a tempfile.mkdtemp folder, here under tmp_path.
    monkeypatch.setenv("ARKV_REAL_MODEL", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    text = "".join(out.get("text", "") for out in outputs)
    assert "h100-80gb" in text and "tpu-v5e" in text
    assert "max_abs_diff" in text
    traced = re.search(r"once per batch bucket: (\{[^}]*\})", text)
    assert traced and set(ast.literal_eval(traced.group(1)).values()) == {1}
    sharded = [line for line in text.splitlines() if "sharded vs one-device latents" in line]
    assert len(sharded) == 1 and float(sharded[0].split()[-1]) < 1e-5
    pictures = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(pictures) == 3  # page map, memory, latency
    # Section 6, prompt to pixels: REAL_MODEL off, so run_generate's random_tiny path wrote the mp4
    # (6 latent frames -> 21 video frames of 64x96), read back by imageio and shown inline.
    assert "-> REAL_MODEL False" in text and "nothing downloaded" in text
    assert "arkv-jax memory plan" in text and "steady state:" in text and "returned per-chunk ms" in text
    assert "prompt switches (KV recache, sink keep): chunk 2: 'the red fox stops and looks back'" in text
    assert "read back fox.mp4: 21 frames of 64x96" in text
    videos = [out for out in outputs if "data:video/mp4;base64," in out.get("data", {}).get("text/html", "")]
    assert len(videos) == 1
    assert [p.name for p in tmp_path.glob("arkv_generate_*/*.mp4")] == ["fox.mp4"]

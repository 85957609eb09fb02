"""Packaging: the wheel carries the frontend and data; serve() finds our server package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_frontend_and_data_found_from_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("gradient_inspector-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "frontend/index.html" in names
    assert "inspector/data/tiny_corpus.txt" in names
    assert any(n.startswith("gradient_inspector-") and n.endswith("entry_points.txt") for n in names)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # --no-deps: the check is about our files, and a fresh venv must not pull a CUDA torch
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    code = textwrap.dedent("""
        import importlib.resources as r, importlib.util, pathlib
        index = r.files("frontend") / "index.html"  # how the server finds the page
        # the corpus, located without importing inspector (torch is not in this venv)
        corpus = pathlib.Path(importlib.util.find_spec("inspector").origin).parent / "data" / "tiny_corpus.txt"
        print(index.is_file(), corpus.is_file(), "site-packages" in str(index))
    """)
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.split() == ["True", "True", "True"]


def test_serve_loads_our_server_even_beside_a_user_server_py(tmp_path):
    (tmp_path / "server.py").write_text("WHO = 'the user'\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import json, urllib.request
        import torch
        import server                      # the user's own module, first on sys.path
        import inspector
        model = torch.nn.Linear(2, 1)
        with inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1)) as insp:
            url = insp.serve(port=0)
            with urllib.request.urlopen(url.split("?")[0].rstrip("/") + "/api/health", timeout=10) as r:
                health = json.load(r)
        print(server.WHO, health["status"])
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:3] == ["the", "user", "ok"]

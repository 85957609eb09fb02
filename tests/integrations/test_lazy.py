"""The integrations are optional: importing the core imports no framework, nor this package."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_inspector_and_its_integrations_package_imports_no_framework():
    code = textwrap.dedent("""
        import sys
        frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate")
        import inspector
        print([m for m in (*frameworks, "inspector.integrations") if m in sys.modules])
        import inspector.integrations
        print([m for m in frameworks if m in sys.modules])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["[]", "[]"]

"""schedules is pure data: importing and using it never imports torch (or the layers above)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import importlib, pkgutil, sys
import schedules
for module in pkgutil.iter_modules(schedules.__path__):
    importlib.import_module("schedules." + module.name)
timeline = schedules.simulate(schedules.one_f_one_b(3, 4))
schedules.validate(schedules.gpipe(2, 2))
import matplotlib
matplotlib.use("Agg")
schedules.plot_timeline(timeline)
loaded = sorted(name for name in sys.modules
                if name.split(".")[0] in ("torch", "partitioners", "pipeline"))
print("loaded:", loaded)
print("modules:", sorted(name for name in sys.modules if name.startswith("schedules.")))
"""


def test_schedules_never_imports_torch():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True,
        cwd=ROOT,  # the checkout's schedules, not tests/schedules
    )
    assert "loaded: []" in result.stdout, result.stdout
    # The check really walked the package.
    assert "'schedules.simulate'" in result.stdout and "'schedules.plot'" in result.stdout

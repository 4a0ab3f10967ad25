"""Hide the optional extras from Python, as if ``scripts/setup.sh`` had run with ``MPKERN_EXTRAS=0``.

With this folder on ``PYTHONPATH`` every Python started (pytest, and the subprocesses the tests start,
which inherit ``PYTHONPATH``) finds none of the optional packages: ``import transformers`` raises
``ModuleNotFoundError``, ``importlib.util.find_spec("transformers")`` is ``None`` and
``pytest.importorskip`` skips -- what a venv without them does, without building one (a second venv
with torch and the extension is minutes; this is nothing)::

    PYTHONPATH=scripts/hide_extras .venv/bin/python -m pytest -q            # the suite without extras
    PYTHONPATH=scripts/hide_extras .venv/bin/python -m pytest --co -q       # just its collection

``MPKERN_HIDE_EXTRAS`` (names separated by commas) replaces the list below. What it cannot hide: the
packages' files and their ``importlib.metadata`` entries (``metadata.version("tqdm")`` still answers).
"""

import os
import sys

#: the packages of the extras (pyproject.toml's ``extras``, and torchao, which scripts/setup.sh adds)
EXTRAS = ("transformers", "accelerate", "lightning", "peft", "matplotlib", "tqdm", "torchao")

for _name in os.environ.get("MPKERN_HIDE_EXTRAS", ",".join(EXTRAS)).split(","):
    if _name.strip():
        # None in sys.modules: CPython's own "this module cannot be imported" (the import system raises
        # ModuleNotFoundError; find_spec answers None), for the package and everything below it
        sys.modules[_name.strip()] = None  # type: ignore[assignment]

"""nbmake's code that the notebook support re-types or bypasses is the code it was written
against.

``notebooks/run.py`` is nbmake 1.5's ``NotebookRun.execute`` with the kernel started the
plugin's way, and ``notebooks/items.py`` builds nbmake's item without its constructor.
``pyproject.toml`` allows nbmake 1.5 only; this check fails when the installed nbmake's two
functions differ from the ones read, so that an upgrade inside the range (or a widened range)
is read against those modules before it is trusted (docs/development.md).
"""

from __future__ import annotations

import hashlib
import inspect

import pytest
from nbmake.nb_run import NotebookRun
from nbmake.pytest_items import NotebookItem

#: sha256 of the source of each function as nbmake 1.5.5 has it.
READ = {
    "NotebookRun.execute": (
        NotebookRun.execute,
        "0c715d5e7d8f01d488888c4f5ee4f17a1c4f4ed4a50f72dbaeda833eaca7ba90",
        "pytest_ctresources/notebooks/run.py",
    ),
    "NotebookItem.__init__": (
        NotebookItem.__init__,
        "0dff42dcb2546c771cd535ca6821eacdd72bd9b6f91813a8c50250fd2b023124",
        "pytest_ctresources/notebooks/items.py",
    ),
}


@pytest.mark.parametrize("name", sorted(READ))
def test_nbmake_code_is_what_the_notebook_support_was_written_against(name: str) -> None:
    function, digest, ours = READ[name]
    found = hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    assert found == digest, (
        f"nbmake's {name} changed: read it against {ours}, run nbmake's suite beside the "
        f"plugin (docs/development.md), then record its digest here ({found})"
    )

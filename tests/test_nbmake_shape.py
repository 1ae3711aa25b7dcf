"""nbmake's code that the notebook support re-types, calls or bypasses is the code it was
written against.

``notebooks/run.py`` is nbmake 1.5's ``NotebookRun.execute`` with the kernel started the
plugin's way: it subclasses ``NotebookRun``, calls its constructor, ``_get_error`` and
``_get_timeout_cell``, and builds nbmake's ``NotebookError`` and ``NotebookResult``.
``notebooks/items.py`` builds nbmake's item without its constructor, falls back on its
``repr_failure`` and raises its ``NotebookFailedException``. ``pyproject.toml`` allows nbmake
1.5 only; this check fails when the nbmake it imports differs from what was read, so that an
upgrade inside the range (or a widened range) is read against those modules before it is
trusted (docs/development.md). ``.ci/run`` runs it a second time against the newest nbmake
the range allows, which the pinned test environment does not have.
"""

from __future__ import annotations

import hashlib
import inspect

import pytest
from nbmake.nb_result import NotebookError, NotebookResult
from nbmake.nb_run import NotebookRun
from nbmake.pytest_items import NotebookFailedException, NotebookItem

RUN = "pytest_ctresources/notebooks/run.py"
ITEMS = "pytest_ctresources/notebooks/items.py"

#: sha256 of the source of each piece as nbmake 1.5.5 has it, and the module that relies on it.
READ = {
    "NotebookRun.execute": (
        NotebookRun.execute,
        "0c715d5e7d8f01d488888c4f5ee4f17a1c4f4ed4a50f72dbaeda833eaca7ba90",
        RUN,
    ),
    "NotebookRun.__init__": (
        NotebookRun.__init__,
        "4b5697d3e0c7ea01acece2a0d179aa36c1db45eb1e3bc4d3508ae0a66f9454cf",
        RUN,
    ),
    "NotebookRun._get_error": (
        NotebookRun._get_error,
        "bea5cb5d327c5a38378494b5d127c026abd25b7a3eda445e2d82f9c3b022ad09",
        RUN,
    ),
    "NotebookRun._get_timeout_cell": (
        NotebookRun._get_timeout_cell,
        "2faf960f715fbafe7812d39b3e5d63049cde387f975ff9f2051f0877df39d625",
        RUN,
    ),
    "NotebookError": (
        NotebookError,
        "4bbafffdfb4cd352c26cc18b67c445e1dfa6411b1f70737ff33be6a00f7f48c2",
        RUN,
    ),
    "NotebookResult": (
        NotebookResult,
        "2f9a57e9fd275f52f8dd3a0210c07e489a1a4410553d6afd48e78555904a3320",
        RUN,
    ),
    "NotebookItem.__init__": (
        NotebookItem.__init__,
        "0dff42dcb2546c771cd535ca6821eacdd72bd9b6f91813a8c50250fd2b023124",
        ITEMS,
    ),
    "NotebookItem.repr_failure": (
        NotebookItem.repr_failure,
        "b213e20053b69501ab2ee6f3e9dd538400f0c17c41cc710a658f3592b95ba745",
        ITEMS,
    ),
    "NotebookFailedException": (
        NotebookFailedException,
        "2c39354c26e40f575ee72464f0daa09f27d2c48cafc247b0f04f2bc238df19a5",
        ITEMS,
    ),
}


@pytest.mark.parametrize("name", sorted(READ))
def test_nbmake_code_is_what_the_notebook_support_was_written_against(name: str) -> None:
    piece, digest, ours = READ[name]
    found = hashlib.sha256(inspect.getsource(piece).encode()).hexdigest()
    assert found == digest, (
        f"nbmake's {name} changed: read it against {ours}, run nbmake's suite beside the "
        f"plugin (docs/development.md), then record its digest here ({found})"
    )

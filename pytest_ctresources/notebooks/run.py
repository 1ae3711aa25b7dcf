"""Running one notebook as nbmake's runner does, in a kernel started by :mod:`kernels`.

nbmake's ``NotebookRun`` builds its ``nbclient.NotebookClient`` itself, from a file on disk,
and gives no way to pass a kernel manager, kernel start-up arguments or an environment.
:class:`KernelRun` is that runner with those three given to nbclient through its own
arguments (``kernel_manager_class``, ``config``, ``execute(env=...)``) and the notebook
given in memory, so an injected copy never touches the disk. Everything else is nbmake
1.5.5's ``NotebookRun.execute``: outputs cleared first, the ``execution.timeout`` and
``execution.allow_errors`` metadata, ``--nbmake-kernel``, ``--nbmake-find-import-errors``,
the ``nbmake.mock`` and ``nbmake.post_cell_execute`` cell metadata, and nbmake's own
:class:`~nbmake.nb_result.NotebookResult`, so nbmake's item reports a failure exactly as
it does without the plugin. nbmake's own test suite is run beside the plugin to keep it so
(docs/development.md).

Imported only under ``--nbmake``.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from nbclient.client import CellExecutionError, CellTimeoutError, NotebookClient
from nbmake.nb_result import NotebookError, NotebookResult
from nbmake.nb_run import CellImportError, NotebookRun

from pytest_ctresources.notebooks.kernels import KernelLaunch

#: nbclient's own wait for a kernel to start, in seconds.
STARTUP_TIMEOUT = 60


def startup_timeout(cell_timeout: int | None) -> int:
    """How long to wait for the kernel to start: nbclient's 60 s, or the cell timeout where
    that is shorter (``None`` or ``-1``: no cell timeout)."""
    if cell_timeout is None or cell_timeout <= 0:
        return STARTUP_TIMEOUT
    return min(STARTUP_TIMEOUT, cell_timeout)


class KernelRun(NotebookRun):  # type: ignore[misc]  # (Any base: nbmake is untyped here)
    """nbmake's runner over the notebook ``nb`` (read from ``filename``, maybe injected),
    with its kernel started as ``launch`` says. ``filename``'s folder is the kernel's cwd."""

    def __init__(
        self,
        filename: Path,
        nb: Any,
        launch: KernelLaunch,
        default_timeout: int,
        *,
        verbose: bool = False,
        kernel: str | None = None,
        find_import_errors: bool = False,
    ) -> None:
        super().__init__(
            filename,
            default_timeout,
            verbose=verbose,
            kernel=kernel,
            find_import_errors=find_import_errors,
        )
        self.nb = nb
        self.launch = launch

    def execute(self) -> NotebookResult:
        nb = self.nb
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = []
        timeout = self.default_timeout
        allow_errors = False
        if "execution" in nb.metadata:
            if "timeout" in nb.metadata.execution:
                timeout = nb.metadata.execution.timeout
            if "allow_errors" in nb.metadata.execution:
                allow_errors = nb.metadata.execution.allow_errors

        error: NotebookError | None = None
        extra_kwargs: dict[str, Any] = {}
        if self.kernel:
            extra_kwargs["kernel_name"] = self.kernel

        try:
            client = NotebookClient(
                nb,
                timeout=timeout,
                allow_errors=allow_errors or self.find_import_errors,
                interrupt_on_timeout=self.find_import_errors,
                record_timing=True,
                # nbclient waits 60 s for a kernel that never answers; a notebook whose
                # cells may take only N s should not wait longer for its kernel to start.
                startup_timeout=startup_timeout(timeout),
                kernel_manager_class=self.launch.manager_class,
                config=self.launch.config,
                **extra_kwargs,
            )
            client.on_cell_executed = self._cell_hook(client)
            try:
                client.execute(cwd=str(self.filename.parent), env=self.launch.env)
            finally:
                # nbclient 0.10 registers its kernel cleanup with atexit before starting the
                # kernel and unregisters it only once the kernel has started: a kernel that
                # fails to start would leave it to fail again ("Exception ignored in atexit
                # callback", a traceback) when the pytest process exits.
                atexit.unregister(client._cleanup_kernel)
        except CellImportError:
            error = self._get_error(nb)
        except CellExecutionError:
            error = self._get_error(nb)
        except CellTimeoutError as err:
            trace = err.args[0]
            error = NotebookError(
                summary=trace.split("\n")[0],
                trace=trace,
                failing_cell_index=self._get_timeout_cell(nb),
            )
        except Exception as err:
            # nbmake compares the type's text: importing jupyter_client.kernelspec at the top
            # breaks nbclient (jupyter/nbclient#128).
            if str(type(err)) != "<class 'jupyter_client.kernelspec.NoSuchKernel'>":
                raise
            summary = f"Error - No such kernel: '{err.name}'"  # type: ignore[attr-defined]
            error = NotebookError(summary=summary, trace=summary, failing_cell_index=0)
        return NotebookResult(nb=nb, error=error)

    def _cell_hook(self, client: Any) -> Any:
        """nbmake's ``on_cell_executed``: its error status fix (nbmake#77), the import-error
        mode, and the ``nbmake.mock`` / ``nbmake.post_cell_execute`` cell metadata."""

        async def after_cell(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
            if any(output["output_type"] == "error" for output in cell["outputs"]):
                execute_reply["content"]["status"] = "error"
                if execute_reply["content"].get("ename") == "ModuleNotFoundError":
                    if self.find_import_errors:
                        raise CellImportError()
                return
            if client.kc is None:
                raise Exception("there is no kernelclient")
            nbmake_metadata = cell.get("metadata", {}).get("nbmake", {})
            mocks: dict[str, Any] = nbmake_metadata.get("mock", {})
            for name, value in mocks.items():
                # As nbmake does: a string is quoted, anything else is written as it is.
                code = f"{name} = '{value}'" if isinstance(value, str) else f"{name} = {value}"
                out = await client.kc.execute_interactive(code)
                if out["content"]["status"] != "ok":
                    raise Exception(f"Failed to apply mock {name}\n\n{out!s}")
            post_cell_execute: list[str] = nbmake_metadata.get("post_cell_execute", [])
            if post_cell_execute:
                code = "\n".join(post_cell_execute)
                out = await client.kc.execute_interactive(code)
                if out["content"]["status"] != "ok":
                    raise Exception(f"Post cell execution failed:\n{code}\n\n{out!s}")

        return after_cell

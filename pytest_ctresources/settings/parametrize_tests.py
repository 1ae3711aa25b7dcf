"""``@pytest.mark.ct_parametrize``: the pytest side (``pytest_generate_tests``).

For each ``ct_parametrize`` marker of a test function, reads the list its key names from the
``PARAMS`` of the marker's ``path=`` YAML (relative to the test's file, as the ``ct_config``
marker's) or of the session's experiment config, and parametrizes the function with it
(:mod:`pytest_ctresources.settings.parametrize` makes the values and ids). A bad reference
fails the collection of the test's module with one line naming the config and the key, as
pytest's own parametrize does for an argument the function lacks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_ctresources.settings.config import ConfigError
from pytest_ctresources.settings.experiment_yaml import ExperimentFile, load_experiment_yaml
from pytest_ctresources.settings.markers import MarkerError, params_references, shown_yaml_path
from pytest_ctresources.settings.parametrize import (
    ParametrizeError,
    ParamsReference,
    parameter_sets,
)


def parametrize_from_params(metafunc: pytest.Metafunc, session: ExperimentFile | None) -> None:
    """Parametrize ``metafunc``'s function from its ``ct_parametrize`` markers; ``session``
    is the session's experiment config (None: none given)."""
    definition = metafunc.definition
    if definition.get_closest_marker("ct_parametrize") is None:  # nearly every test: cheap
        return
    message = None
    try:
        for reference in params_references(definition):
            experiment = _experiment(definition, reference, session)
            sets = parameter_sets(reference, experiment.path, experiment.params)
            # As a string: pytest unpacks the values of a one-name tuple, a prompt included.
            metafunc.parametrize(",".join(sets.argnames), sets.argvalues, ids=sets.ids)
    except (MarkerError, ConfigError, ParametrizeError) as exc:
        message = str(exc)
    if message is not None:
        if not message.startswith("invalid @pytest.mark"):  # a marker's own names the test
            message = f"{message} (@pytest.mark.ct_parametrize on {definition.nodeid})"
        # Outside the except block: no "During handling of the above exception" either.
        pytest.fail(message, pytrace=False)


def _experiment(
    definition: pytest.Item, reference: ParamsReference, session: ExperimentFile | None
) -> ExperimentFile:
    if reference.path is not None:
        base_dir = Path(str(definition.path)).parent
        return load_experiment_yaml(shown_yaml_path(definition, base_dir, reference.path))
    if session is None:
        raise ParametrizeError(
            f"no experiment config to read PARAMS {reference.key} from: give the marker "
            "path='...yaml', or the session one (--ct-config, ini ct_config, CT_CONFIG)"
        )
    return session

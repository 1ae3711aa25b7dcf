"""Where the options are declared and the settings resolved: the ``--ct-*`` options, ``ct_*``
ini keys and ``CT_*`` variables, their sources, the experiment config, experiment YAML files
and the markers."""

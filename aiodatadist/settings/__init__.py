"""How an instance is configured, parsed once per source:

* :mod:`.keys`: the option keys of ``LLMDataDist.init`` and the bounds their values share with the environment;
* :mod:`.options`: the option dict -> :class:`~.options.Settings` (what ``LLMDataDist.settings`` returns);
* :mod:`.environment`: the ``AIODATADIST_*`` variables -> :class:`~.environment.EnvKnobs` (read nowhere else);
* :mod:`.curve_keys`: the CURVE keys (``llm.CurveSecretKey``, ``llm.CurvePeerKeys``).
"""

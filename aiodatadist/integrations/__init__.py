"""Adapters for serving engines.  Each imports its engine only when the engine asks for its classes;
``import aiodatadist`` imports none of them.

* :mod:`.vllm`: ``AiodatadistConnector``, a vLLM KV connector (``kv_connector_module_path``);
* :mod:`.sglang`: the SGLang transfer backend ``--disaggregation-transfer-backend aiodatadist``;
* :mod:`._config`: what both share, the ``LLMConfig`` of an engine worker's instance from its options.
"""

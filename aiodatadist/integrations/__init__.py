"""Adapters for serving engines.  Each module imports its engine; ``import aiodatadist`` imports none of them.

* :mod:`.vllm`: ``AiodatadistConnector``, a vLLM KV connector (``kv_connector_module_path``).
"""

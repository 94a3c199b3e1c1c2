"""Drop-in modules for programs written for other libraries: :mod:`.llm_datadist` (Huawei LLM-DataDist's
``llm_datadist`` Python module, blocking, on :mod:`aiodatadist.sync`)."""

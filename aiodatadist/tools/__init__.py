"""The command line (``python -m aiodatadist demo|bench|soak|info``): built on the public API; nothing in the
library imports it."""

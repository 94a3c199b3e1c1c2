"""End-to-end runs of the CLI, the examples, soak and bench peers (marked ``slow`` and ``integration``)."""

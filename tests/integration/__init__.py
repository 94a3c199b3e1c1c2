"""Tests with real links, sockets or peer processes (marked ``integration``)."""

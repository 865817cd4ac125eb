"""Tests of the wsync torchrun rendezvous backend (a package, so its conftest and
helpers do not shadow the top-level ``tests/conftest.py``)."""

"""``WSYNC_LOG_LEVEL``: a ``vllm serve`` process shows this package's log at the level asked for."""

from __future__ import annotations

import logging

import pytest

from lightning_wsync.engines._vllm_plugin import LOG_ENV, log_from_env


@pytest.fixture
def wsync_logger():
    logger = logging.getLogger("lightning_wsync")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_the_level_from_the_environment_adds_one_handler_however_often_the_plugin_loads(
    monkeypatch, wsync_logger, capsys
) -> None:
    monkeypatch.setenv(LOG_ENV, "info")
    before = len(wsync_logger.handlers)
    log_from_env()
    log_from_env()  # vLLM may load its plugins more than once in a process
    assert wsync_logger.level == logging.INFO and len(wsync_logger.handlers) == before + 1
    logging.getLogger("lightning_wsync._control.store").info("a line from the store")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("INFO lightning_wsync._control.store: a line from the store") and " wsync[" in line


def test_unset_leaves_the_logger_alone(monkeypatch, wsync_logger) -> None:
    monkeypatch.delenv(LOG_ENV, raising=False)
    level, handlers = wsync_logger.level, list(wsync_logger.handlers)
    log_from_env()
    assert (wsync_logger.level, wsync_logger.handlers) == (level, handlers)


def test_a_value_that_is_no_level_is_refused_by_name(monkeypatch, wsync_logger) -> None:
    monkeypatch.setenv(LOG_ENV, "loud")
    with pytest.raises(ValueError, match=r"WSYNC_LOG_LEVEL='loud' is not a log level: set it to one of DEBUG, INFO"):
        log_from_env()

"""``--rdzv-conf`` parsing: one typed config, one-line errors that say the fix."""

from __future__ import annotations

import re

import pytest

from lightning_wsync.rendezvous import WsyncRendezvousConfig, parse_rdzv_conf

from ._rdzv_helpers import Jobs


def test_valid_conf_becomes_typed_config() -> None:
    conf = {
        "role": "Rollout",
        "is_host": "false",
        "join_timeout": "30",
        "last_call_timeout": "3",
        "close_timeout": "7",
        "heartbeat_timeout": "4",
        "keep_alive_interval": "2",
        "keep_alive_max_attempt": "6",
        "read_timeout": "20",
        "linger_timeout": "0",
        "timeout": 900,  # torchrun's legacy key, always present
    }
    assert parse_rdzv_conf(conf) == WsyncRendezvousConfig(
        role="rollout",
        is_host=False,
        join_timeout_s=30,
        last_call_timeout_s=3,
        close_timeout_s=7,
        heartbeat_timeout_s=4,
        keep_alive_interval_s=2,
        keep_alive_max_attempt=6,
        read_timeout_s=20,
        linger_timeout_s=0,
    )


def test_defaults_form_a_group_fast() -> None:
    config = parse_rdzv_conf({"role": "trainer", "timeout": 900})
    assert config == WsyncRendezvousConfig(role="trainer")
    assert config.is_host is None and config.hosts_by_default
    assert config.last_call_timeout_s == 1
    assert not parse_rdzv_conf({"role": "rollout"}).hosts_by_default


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (
            {"role": "trainer", "last_call": "2"},
            (
                "wsync rendezvous: unknown --rdzv-conf key 'last_call' (value '2'); valid keys: role, "
                "is_host, join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, "
                "keep_alive_interval, keep_alive_max_attempt, read_timeout, linger_timeout. Fix: "
                "remove it or correct the spelling."
            ),
        ),
        (
            {"timeout": 900},
            (
                "wsync rendezvous: --rdzv-conf has no 'role' key (got {'timeout': 900}); valid roles: "
                "trainer, rollout. Fix: add --rdzv-conf role=trainer or role=rollout."
            ),
        ),
        (
            {"role": "learner"},
            (
                "wsync rendezvous: --rdzv-conf key 'role' has invalid value 'learner'; valid roles: "
                "trainer, rollout. Fix: --rdzv-conf role=trainer or role=rollout."
            ),
        ),
        (
            {"role": "rollout", "join_timeout": "10m"},
            (
                "wsync rendezvous: --rdzv-conf key 'join_timeout' has invalid value '10m'; expected a "
                "positive integer (whole seconds). Fix: e.g. --rdzv-conf join_timeout=5."
            ),
        ),
        (
            {"role": "rollout", "last_call_timeout": "0"},
            (
                "wsync rendezvous: --rdzv-conf key 'last_call_timeout' has invalid value '0'; expected "
                "a positive integer (whole seconds). Fix: e.g. --rdzv-conf last_call_timeout=5."
            ),
        ),
        (
            {"role": "rollout", "keep_alive_max_attempt": "many"},
            (
                "wsync rendezvous: --rdzv-conf key 'keep_alive_max_attempt' has invalid value 'many'; "
                "expected a positive integer (a count). Fix: e.g. --rdzv-conf keep_alive_max_attempt=5."
            ),
        ),
        (
            {"role": "trainer", "linger_timeout": "-1"},
            (
                "wsync rendezvous: --rdzv-conf key 'linger_timeout' has invalid value '-1'; "
                "expected a non-negative integer (whole seconds; 0 disables). Fix: e.g. "
                "--rdzv-conf linger_timeout=5."
            ),
        ),
        (
            {"role": "trainer", "is_host": "maybe"},
            (
                "wsync rendezvous: --rdzv-conf key 'is_host' has invalid value 'maybe'; expected true "
                "or false. Fix: --rdzv-conf is_host=true or is_host=false."
            ),
        ),
    ],
    ids=[
        "unknown-key",
        "missing-role",
        "bad-role",
        "non-numeric",
        "zero",
        "bad-count",
        "negative-linger",
        "bad-bool",
    ],
)
def test_bad_conf_is_one_line_value_error(
    conf: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_rdzv_conf(conf)


def test_config_validates_direct_construction() -> None:
    with pytest.raises(
        ValueError,
        match=r"role='learner' is not a valid role; valid roles: trainer, rollout",
    ):
        WsyncRendezvousConfig(role="learner")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"read_timeout_s=-1 must be a whole number >= 1.*read_timeout=<int>",
    ):
        WsyncRendezvousConfig(role="trainer", read_timeout_s=-1)


def test_legacy_timeout_other_than_torchruns_default_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parse_rdzv_conf({"role": "trainer", "timeout": 900})
    assert caplog.records == []
    parse_rdzv_conf({"role": "trainer", "timeout": 60})
    assert [r.getMessage() for r in caplog.records] == [
        (
            "wsync rendezvous ignores timeout=60 (torchrun's legacy --rdzv-timeout); "
            "set --rdzv-conf join_timeout=<seconds> instead"
        )
    ]


@pytest.mark.timeout(90)
def test_torchrun_with_bad_conf_fails_with_the_one_line_error(jobs: Jobs) -> None:
    # No store is contacted: the conf is parsed before anything else.
    job = jobs.torchrun(
        "bad",
        port=1,
        conf="role=learner",
        script="probe_worker.py",
        script_args=["--out", "."],
    )
    assert job.wait(timeout_s=60) == 1
    last_line = job.log().strip().splitlines()[-1]
    assert last_line == (
        "ValueError: wsync rendezvous: --rdzv-conf key 'role' has invalid value 'learner'; "
        "valid roles: trainer, rollout. Fix: --rdzv-conf role=trainer or role=rollout."
    )

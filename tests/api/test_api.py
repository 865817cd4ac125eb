"""The public API is exactly lightning_wsync.__all__."""

import lightning_wsync


def test_all_is_pinned():
    assert sorted(lightning_wsync.__all__) == [
        "ApplyTarget",
        "CallbackConfig",
        "ExperienceReader",
        "ExperienceWriter",
        "PushHandle",
        "PushReport",
        "ReceiverConfig",
        "SenderConfig",
        "WeightReceiver",
        "WeightSender",
        "WeightSyncAuthError",
        "WeightSyncCallback",
        "WeightSyncClosedError",
        "WeightSyncConfigError",
        "WeightSyncError",
        "WeightSyncIntegrityError",
        "WeightSyncRecordError",
        "WeightSyncSchemaError",
        "WeightSyncStoreError",
        "WeightSyncTimeoutError",
        "register_configs",
    ]
    for name in lightning_wsync.__all__:
        assert getattr(lightning_wsync, name).__module__.startswith("lightning_wsync")

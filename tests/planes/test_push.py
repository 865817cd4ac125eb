"""The core push through real processes, a real TCPStore and real gloo groups."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate, receiver_main

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncClosedError, WeightSyncSchemaError

pytestmark = pytest.mark.timeout(240)


def start(children, store, job, name, spec, results, **options):
    p = CTX.Process(target=receiver_main, args=(store, job, name, spec, results.queue(name), options), daemon=True)
    p.start()
    children.track(p.pid)
    return p


@pytest.mark.parametrize("transport,apply", [("auto", "copy"), ("gloo", "copy"), ("gloo", "swap")])
@pytest.mark.slow
def test_five_pushes_reach_three_receivers_bit_exact(children, port, transport, apply):
    spec = ("mixed", 0)
    model = build(spec)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1", "r2"}
    with WeightSender(model, store=store, job="five", transport=transport, timeout_s=20) as sender:
        procs = [start(children, store, "five", n, spec, results, apply=apply) for n in sorted(names)]
        collect(results, "ready", names, timeout_s=120)
        for version in range(1, 6):
            mutate(model, version)
            want = digest(model)
            report = sender.push(version).wait(timeout_s=60)
            assert sorted(report.delivered) == sorted(names), report
            assert report.failed == {}
            got = collect(results, "version", names, timeout_s=60)
            assert {n: (m[2], m[3]) for n, m in got.items()} == {n: (version, want) for n in names}
    for p in procs:  # the sender's close reaches every receiver
        p.join(timeout=60)
        assert p.exitcode == 0


@pytest.mark.parametrize("transport,apply", [("auto", "copy"), ("gloo", "copy"), ("gloo", "swap")])
@pytest.mark.slow
def test_sigkill_mid_push_isolated(children, port, transport, apply):
    spec = ("big", 256)
    model = build(spec)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1", "r2"}
    timeout_s = 8.0
    with WeightSender(model, store=store, job="kill", transport=transport, timeout_s=timeout_s) as sender:
        procs = {n: start(children, store, "kill", n, spec, results, apply=apply) for n in sorted(names)}
        collect(results, "ready", names, timeout_s=120)
        assert sorted(sender.push(1).wait(timeout_s=60).delivered) == sorted(names)
        collect(results, "version", names, timeout_s=60)

        mutate(model, 2)
        handle = sender.push(2)
        os.kill(procs["r0"].pid, signal.SIGKILL)
        started = time.monotonic()
        report = handle.wait(timeout_s=timeout_s)
        assert time.monotonic() - started <= timeout_s + 2
        assert set(report.failed) == {"r0"}, report
        assert sorted(report.delivered) == ["r1", "r2"]
        got = collect(results, "version", {"r1", "r2"}, timeout_s=60)
        assert {m[2] for m in got.values()} == {2} and {m[3] for m in got.values()} == {digest(model)}

        mutate(model, 3)
        report = sender.push(3).wait(timeout_s=60)
        assert sorted(report.delivered) == ["r1", "r2"] and report.failed == {}, report
        collect(results, "version", {"r1", "r2"}, timeout_s=60)

        start(children, store, "kill", "late", spec, results, apply=apply)  # no push follows: it must get 3 at once
        late = collect(results, "version", {"late"}, timeout_s=120)["late"]
        assert late[2:4] == (3, digest(model))


def test_mismatched_module_gets_schema_error(port):
    store = f"127.0.0.1:{port}"
    model = build(("mixed", 0))
    wrong = build(("mixed", 0))
    wrong[1] = torch.nn.Linear(48, 17).to(torch.bfloat16)
    # timeout_s also bounds the store's own connect, which took over 5 s once at load (2026-11-29)
    with WeightSender(model, store=store, job="schema", timeout_s=30) as sender:
        with WeightReceiver(wrong, store=store, job="schema", name="odd") as receiver:
            report = sender.push(1).wait(timeout_s=10)
            with pytest.raises(WeightSyncSchemaError, match=r"receiver 'odd': tensor '1.weight' has shape \(17, 48\)"):
                receiver.wait_for_version(1, timeout_s=10)
            assert report.delivered == ()
            assert "'1.weight' has shape (17, 48)" in report.failed["odd"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bucket_mb": 0}, r"bucket_mb=0 must be a number > 0"),
        ({"transport": "carrier-pigeon"}, r"transport='carrier-pigeon' is unknown; choose one of \('auto', 'shm', 'gloo', 'nccl', 'nixl'\)"),  # noqa: E501  (a table: one case per line)
        ({"dtype": "int8"}, r"dtype='int8' is not supported"),
        ({"timeout_s": -1}, r"timeout_s=-1 must be a number > 0"),
        ({"include": "*.weight"}, r"include='\*.weight' must be a list of glob patterns"),
        ({"include": ["nothing*"]}, r"select no tensor of the module"),
    ],
)
def test_bad_sender_arguments(port, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        WeightSender(build(("mixed", 0)), store=f"127.0.0.1:{port}", job="bad", **options)


def test_bad_versions(port):
    with WeightSender(build(("mixed", 0)), store=f"127.0.0.1:{port}", job="ver") as sender:
        with pytest.raises(ValueError, match=r"version=-1 must be an int >= 0"):
            sender.push(-1)
        sender.push(3)
        with pytest.raises(ValueError, match=r"version=3 is not above the last published version 3"):
            sender.push(3)
        with pytest.raises(ValueError, match=r"version='4' must be an int"):
            sender.push("4")  # type: ignore[arg-type]


def test_missing_store_and_job_say_how_to_pass_them(monkeypatch):
    monkeypatch.delenv("WSYNC_STORE", raising=False)
    monkeypatch.delenv("WSYNC_JOB", raising=False)
    with pytest.raises(ValueError, match=r"job=None; pass job='<run name>' or set WSYNC_JOB"):
        WeightReceiver(build(("mixed", 0)), store="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"store=None and WSYNC_STORE is not set"):
        WeightReceiver(build(("mixed", 0)), job="x")


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_stalled_receiver_fails_alone_and_catches_up(children, port, transport):
    spec = ("big", 64)
    model = build(spec)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1"}
    timeout_s = 3.0
    with WeightSender(model, store=store, job="stall", transport=transport, timeout_s=timeout_s) as sender:
        procs = {n: start(children, store, "stall", n, spec, results) for n in sorted(names)}
        collect(results, "ready", names, timeout_s=120)
        assert sorted(sender.push(1).wait(timeout_s=60).delivered) == sorted(names)
        collect(results, "version", names, timeout_s=60)

        os.kill(procs["r0"].pid, signal.SIGSTOP)
        try:
            for version in (2, 3):
                mutate(model, version)
                handle = sender.push(version)
                assert handle.stall_s < timeout_s
                started = time.monotonic()
                report = handle.wait(timeout_s=timeout_s)
                assert time.monotonic() - started <= timeout_s + 2
                assert report.delivered == ("r1",), report
                if version == 2:
                    assert "r0" in report.failed and "timeout_s=3.0" in report.failed["r0"]
                got = collect(results, "version", {"r1"}, timeout_s=60)["r1"]
                assert got[2:4] == (version, digest(model))
        finally:
            os.kill(procs["r0"].pid, signal.SIGCONT)
        # Resumed, r0 catches up with the newest version on its own (its group is rebuilt).
        while True:
            got = collect(results, "version", {"r0"}, timeout_s=60)["r0"]
            if got[2] == 3:
                break
        assert got[3] == digest(model)


def test_bfloat16_on_the_wire_and_name_filters(port):
    torch.manual_seed(3)
    src = torch.nn.ModuleDict({"base": torch.nn.Linear(8, 8), "lora_a": torch.nn.Linear(8, 2, bias=False)})
    dst = torch.nn.ModuleDict({"base": torch.nn.Linear(8, 8), "lora_a": torch.nn.Linear(8, 2, bias=False)})
    base_before = dst["base"].weight.detach().clone()
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="bf16", dtype="bfloat16", include=["lora_*"], timeout_s=5) as sender:
        with WeightReceiver(dst, store=store, job="bf16", include=["lora_*"]) as receiver:
            weight_ref = dst["lora_a"].weight
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
    assert dst["lora_a"].weight is weight_ref and dst["lora_a"].weight.dtype == torch.float32
    assert torch.equal(dst["lora_a"].weight, src["lora_a"].weight.to(torch.bfloat16).float())
    assert torch.equal(dst["base"].weight, base_before)  # excluded: untouched


def test_receiver_started_after_close_is_told_so(port):
    store = f"127.0.0.1:{port}"
    import torch.distributed as dist

    keep = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # outlives the sender
    with WeightSender(build(("mixed", 0)), store=store, job="late-close", timeout_s=5) as sender:
        sender.push(1)
    with WeightReceiver(build(("mixed", 1)), store=store, job="late-close") as receiver:
        with pytest.raises(WeightSyncClosedError, match="the sender of job 'late-close' closed"):
            receiver.wait_for_version(1, timeout_s=20)
    del keep


def test_bf16_rollout_module_takes_a_bf16_push_as_is(port):
    src = build(("mixed", 0))
    dst = build(("mixed", 1)).to(torch.bfloat16)
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="bf16-dst", dtype="bfloat16", timeout_s=5) as sender:
        with WeightReceiver(dst, store=store, job="bf16-dst") as receiver:
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(b, a.to(torch.bfloat16) if a.is_floating_point() else a), name


def test_swap_apply_repoints_the_same_tensors_between_two_buffers(port):
    src = build(("mixed", 0))
    dst = build(("mixed", 1))
    params = dict(dst.named_parameters())
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="swap", transport="gloo", timeout_s=10) as sender:
        with WeightReceiver(dst, store=store, job="swap", apply="swap", timeout_s=10) as receiver:
            storages = []
            for version in range(1, 5):
                mutate(src, version)
                sender.push(version)
                assert receiver.wait_for_version(version, timeout_s=30) == version
                assert digest(dst) == digest(src)
                storages.append(next(iter(params.values())).untyped_storage().data_ptr())
    # Same Parameter objects (optimizers, hooks and references stay valid), new storage:
    # the two staging buffers alternate, so no version is received into the one in use.
    assert dict(dst.named_parameters()) == params
    assert storages[0] == storages[2] and storages[1] == storages[3] and storages[0] != storages[1]


def test_swap_apply_refuses_a_module_not_in_the_wire_dtype(port):
    src = build(("mixed", 0))
    dst = build(("mixed", 1))  # float32, while the sender casts to bfloat16
    store = f"127.0.0.1:{port}"
    # timeout_s bounds the receiver's store connect too: 5 s timed out once in the fast tier at load ~20.
    with WeightSender(src, store=store, job="swap-dtype", transport="gloo", dtype="bfloat16", timeout_s=30):
        with WeightReceiver(dst, store=store, job="swap-dtype", apply="swap", timeout_s=30) as receiver:
            with pytest.raises(
                WeightSyncSchemaError,
                match=r"apply='swap' needs every tensor as the gloo link stages it, but '[\w.]+' is float32 on cpu "
                r"and arrives as bfloat16 on cpu; hold the module in the wire dtype on that device, "
                r"or use apply='copy'",
            ):
                receiver.wait_for_version(1, timeout_s=10)

"""Scenario: relay chaos. Host leaders and host-mates SIGKILLed and SIGSTOPped at random
while the trainer keeps pushing, with deltas on.

The trainer (this process, host 0) changes a small GPT-shaped model sparsely (so
``delta="auto"`` sends most versions as deltas) and pushes ``pushes`` versions, one every
``interval_s``, to ``per_host`` receivers on each of ``hosts`` hosts, relayed host to
host. Every ``every`` pushes it picks, with a seeded RNG, one of: SIGKILL a host's leader
or a random receiver (a replacement starts on that host), or SIGSTOP one (resumed with
SIGCONT 0.5 to 2.5 heartbeat timeouts later). With ``garbage`` (issue 32), half-way between
those actions it also writes garbage: into an unsigned or signed store key a host reads (a
leader's heartbeat, its leader record, the ``moved`` and ``news`` counters) or into a host
leader's pin directory (odd notes: "²", deep JSON, a FIFO, a symlink to /dev/zero; a garbled
board). Before the last push every stopped receiver is resumed and every replacement has
registered. The scenario records every version each
receiver applied with its digest, the store's key count after every push, and how long
the live receivers took to hold the last version; the test judges them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from _scenario import Procs, main, wait_until

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control, tcp_store
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.shm.files import SHM_DIR, pin_dir
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import ModelSpec, build_model, digest

HERE = Path(__file__).resolve().parent
SPEC = ModelSpec(d_model=128, vocab=2048, n_layers=2)  # ~0.66M parameters: 2.6 MB of float32
INTERVAL_S, EVERY = 0.2, 8  # a push every INTERVAL_S; a chaos action every EVERY pushes
TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 10.0, 2.0


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def step(model: torch.nn.Module, version: int) -> None:
    """Change one element in 61 of every float tensor: a sparse update, as a small optimiser step."""
    with torch.no_grad():
        for i, t in enumerate(model.state_dict().values()):
            if t.is_floating_point():
                t.view(-1)[(version + i) % 61 :: 61] += 1e-3 * version


def stale_relay_keys(ctl: Control, epoch: int, n_hosts: int) -> tuple[list[str], int]:
    """Relay keys on the store that name no current leader or chain generation, and how many relay keys there are."""
    rids = range(int(ctl.add(keys.MEMBERS_NEXT, 0)))
    chain = ctl.get_json(keys.relay_chain(epoch))
    gen, current = (int(chain["number"]), set(chain["rids"])) if chain else (0, set())
    stale, count = [], 0
    for h in range(1, n_hosts + 1):
        record = leader_record(ctl, epoch, f"simh{h}")
        count += record is not None
        if record is not None and record.rid not in current:  # a host with no leader in the chain
            stale.append(f"{keys.relay_leader(epoch, f'simh{h}')} (rid {record.rid})")
    for rid in rids:
        names = [keys.relay_broken(epoch, rid), keys.relay_received(epoch, rid)]
        for g in range(1, gen + 1):
            for tree in (None, 0, 1):  # the chain's hop into rid, or its hop in either tree
                prefix = keys.relay_hop_prefix(epoch, g, rid, tree)
                names += [keys.joined(prefix, 0), keys.joined(prefix, 1), *keys.group_keys(prefix),
                          *(keys.ready(prefix, n) for n in range(4))]  # fmt: skip
        for name in names:
            if ctl.has(name):
                count += 1
                if rid not in current or (f"/pg/{gen}/" not in name and "/pg/" in name):
                    stale.append(name)
    return stale, count


def key_shapes(ctl: Control) -> dict[str, int]:
    """The job's keys by shape (numbers as ``#``): what the store holds, for a report."""
    return dict(Counter(re.sub(r"[0-9]+", "#", n) for n in ctl.list_keys("") or []))


def dead_epoch_relay_keys(ctl: Control, epoch: int) -> list[str]:
    """Relay keys of sender epochs before ``epoch`` (their streams' included), by the store's list:
    what killed trainers left, deleted by their successors once no leader can still use them."""
    names = ctl.list_keys("relay/") or []
    return sorted(n for n in names if (p := n.split("/")[1]).isdigit() and keys.relay_owner(int(p)) < epoch)


class Fleet:
    """The receivers on hosts 1..H: started, killed, stopped, resumed, each known by name."""

    def __init__(self, procs: Procs, sender: WeightSender | Trainer, events: Path) -> None:
        self.procs, self.sender, self.events = procs, sender, events
        self.hosts: dict[str, int] = {}  # name -> host
        self.killed: set[str] = set()
        self.stopped: dict[str, float] = {}  # name -> when to resume (time.monotonic())
        self._n = 0

    def start(self, host: int) -> str:
        name = f"h{host}n{self._n}"
        self._n += 1
        argv = [sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(self.sender.store_address),
                "--job", "chaos", "--name", name, "--size-mb", "1", "--events", str(self.events),
                "--spec", f"{SPEC.d_model},{SPEC.vocab},{SPEC.n_layers}", "--timeout-s", "120"]  # fmt: skip
        self.procs.start(name, host, argv)
        self.hosts[name] = host
        return name

    def live(self) -> list[str]:
        return sorted(n for n in self.hosts if n not in self.killed)

    def registered(self) -> bool:
        return set(self.live()) <= set(self.sender.receivers())

    def pick(self, rng: random.Random, ctl: Control) -> str | None:
        """A host's leader (half the time) or any running receiver; None when none is running."""
        running = [n for n in self.live() if n not in self.stopped]
        if not running:
            return None
        if rng.random() < 0.5:
            host = rng.choice(sorted({self.hosts[n] for n in running}))
            record = leader_record(ctl, self.sender.epoch, f"simh{host}")
            pid = None if record is None else record.pid
            leader = [n for n in running if self.procs.started[n].pid == pid]
            if leader:
                return leader[0]
        return rng.choice(running)

    def kill(self, name: str) -> str:
        os.kill(self.procs.started[name].pid, signal.SIGKILL)
        self.procs.started[name].wait(timeout=30)
        self.killed.add(name)
        return self.start(self.hosts[name])

    def stop(self, name: str, for_s: float) -> None:
        os.kill(self.procs.started[name].pid, signal.SIGSTOP)
        self.stopped[name] = time.monotonic() + for_s

    def resume(self, everyone: bool = False) -> None:
        now = time.monotonic()
        for name, at in list(self.stopped.items()):
            if everyone or at <= now:
                os.kill(self.procs.started[name].pid, signal.SIGCONT)
                del self.stopped[name]


def act(fleet: Fleet, rng: random.Random, ctl: Control, heartbeat_timeout_s: float) -> dict[str, Any] | None:
    """One chaos action on a random target: SIGKILL (and start a replacement) or SIGSTOP."""
    target = fleet.pick(rng, ctl)
    if target is None:
        return None
    if rng.random() < 0.5:
        return {"kill": target, "replacement": fleet.kill(target)}
    for_s = rng.uniform(0.5, 2.5) * heartbeat_timeout_s
    fleet.stop(target, for_s)
    return {"stop": target, "for_s": round(for_s, 2)}


def garble(fleet: Fleet, rng: random.Random, ctl: Control, n_hosts: int) -> dict[str, Any] | None:
    """Garbage into a store key a host reads, or into a host leader's pin directory."""
    epoch = fleet.sender.epoch
    host = f"simh{rng.randint(1, n_hosts)}"
    record = leader_record(ctl, epoch, host)
    where = rng.choice(["hb", "leader", "moved", "news", "mates", "board"])
    if where in ("mates", "board") and record is not None:
        directory = pin_dir(os.path.join(SHM_DIR, record.shm))
        try:
            if where == "board":
                Path(directory, "board").write_text("\x00 not a board")
            else:
                mates = Path(directory, "mates")
                tag = rng.randrange(1 << 30)
                Path(mates, "\u00b2").write_text('{"rid": 1}')
                Path(mates, str(900_000 + tag % 1000)).write_text("[" * 100_000)
                fifo = Path(mates, str(800_000 + tag % 1000))
                if not fifo.exists():
                    os.mkfifo(fifo)
                zero = Path(mates, str(700_000 + tag % 1000))
                if not zero.exists():
                    zero.symlink_to("/dev/zero")
        except OSError as exc:  # the leader stepped down meanwhile
            return {"garbage": where, "host": host, "missed": str(exc)}
        return {"garbage": where, "host": host}
    key = {"hb": None if record is None else keys.member_heartbeat(record.rid),
           "leader": keys.relay_leader(epoch, host), "moved": keys.relay_moved(epoch), "news": keys.NEWS,
           "mates": None, "board": None}[where]  # fmt: skip
    if key is None:
        return None
    ctl.set_text(key, rng.choice(["\u00b2", "not json {", "[" * 50_000, "-", "1e9"]))
    return {"garbage": where, "key": key}


def segments(job: str) -> list[str]:
    """This job's shared-memory segments in /dev/shm (pin directories not counted)."""
    return sorted(n for n in os.listdir(SHM_DIR) if re.fullmatch(rf"wsync-.*-{job}", n))


def push_through_chaos(
    sender: WeightSender, model: torch.nn.Module, fleet: Fleet, ctl: Control, rng: random.Random, pushes: int,
    *, garbage: bool = False, n_hosts: int = 0,
) -> dict[str, Any]:
    """Push 1..pushes, one every INTERVAL_S, with a chaos action every EVERY pushes; the last to everyone."""
    expected: dict[int, str] = {}
    key_counts: list[int] = []
    actions: list[dict[str, Any]] = []
    started = time.monotonic()
    for version in range(1, pushes + 1):
        last = version == pushes
        if last:  # the last version goes to everyone: resumed, and replacements registered
            fleet.resume(everyone=True)
            wait_until("every replacement to register", fleet.registered, 180, fleet.procs)
        step(model, version)
        expected[version] = digest(model, None)
        handle = sender.push(version)
        pushed_at = time.monotonic()
        fleet.resume()
        if version % EVERY == 0 and version < pushes - EVERY:
            if (action := act(fleet, rng, ctl, HEARTBEAT_TIMEOUT_S)) is not None:
                actions.append({"version": version, "t": round(pushed_at - started, 2), **action})
        if garbage and version % EVERY == EVERY // 2 and version < pushes - EVERY:
            if (action := garble(fleet, rng, ctl, n_hosts)) is not None:
                actions.append({"version": version, "t": round(time.monotonic() - started, 2), **action})
        key_counts.append(sender.store.num_keys())
        if not last:
            time.sleep(INTERVAL_S)  # the push rate (no wait on the receivers: they may be stopped)
    return {"expected": expected, "key_counts": key_counts, "actions": actions, "handle": handle,
            "pushed_at": pushed_at, "started": started}  # fmt: skip


def settle(ctl: Control, epoch: int, n_hosts: int) -> tuple[list[str], int]:
    """What dead leaders and replaced chains left is deleted once nobody can use it
    (timeout_s + heartbeat_timeout_s): wait (bounded) until only the live chain's keys remain."""
    until = time.monotonic() + 3 * (TIMEOUT_S + HEARTBEAT_TIMEOUT_S)
    stale, relay_keys = stale_relay_keys(ctl, epoch, n_hosts)
    while stale and time.monotonic() < until:
        time.sleep(0.5)
        stale, relay_keys = stale_relay_keys(ctl, epoch, n_hosts)
    return stale, relay_keys


def scenario(argv: list[str]) -> dict[str, Any]:
    out, n_hosts, per_host, pushes, seed = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    cross_host = argv[5] if len(argv) > 5 else "relay"  # "tree": the two trees, deltas on their edges
    garbage = "garbage" in argv[6:]
    events = out / "events.jsonl"
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("lightning_wsync._planes.relay").setLevel(logging.INFO)
    if "trainer" in argv[6:]:  # the trainer a process of its own, SIGKILLed and relaunched, SIGSTOPped
        return trainer_scenario(out, n_hosts, per_host, pushes, seed, cross_host, garbage)
    with SimHosts(n_hosts + 1) as hosts:
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        model = build_model(SPEC, seed=0)
        with WeightSender(model, store=f"{hosts.address(0)}:0", job="chaos", timeout_s=TIMEOUT_S,
                          heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, delta="auto",
                          cross_host=cross_host) as sender:  # fmt: skip
            ctl = Control(sender.store, "chaos")
            fleet = Fleet(Procs(hosts, out), sender, events)
            for host in range(1, n_hosts + 1):
                for _ in range(per_host):
                    fleet.start(host)
            wait_until("every receiver to register", fleet.registered, 180, fleet.procs)
            run = push_through_chaos(sender, model, fleet, ctl, random.Random(seed), pushes, garbage=garbage,
                                     n_hosts=n_hosts)  # fmt: skip
            live = fleet.live()

            def all_hold_last() -> bool:
                got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == pushes}
                return got >= set(live)

            wait_until("every live receiver to apply the last version", all_hold_last, 120, fleet.procs)
            catch_up_s = time.monotonic() - run["pushed_at"]
            report = run["handle"].wait(TIMEOUT_S)
            run_s = time.monotonic() - run["started"]
            stale, relay_keys = settle(ctl, sender.epoch, n_hosts)
            settled = sender.store.num_keys()
            shm = segments("chaos")
        applied = [r for r in read(events) if r["event"] == "applied"]
        torn = [r for r in applied if r["digest"] != run["expected"].get(r["version"])]
        return {
            "pushes": pushes, "hosts": n_hosts, "per_host": per_host, "seed": seed, "timeout_s": TIMEOUT_S,
            "actions": run["actions"], "live": live, "applied": len(applied), "torn": torn,
            "key_counts": run["key_counts"], "keys_settled": settled, "relay_keys": relay_keys,
            "stale_relay_keys": stale, "catch_up_s": catch_up_s, "run_s": run_s, "segments": shm,
            "thread_deaths": [f"{log.name}: {line.strip()}" for log in sorted(out.glob("*.log"))
                              for line in log.read_text(errors="replace").splitlines()
                              if "Exception in thread" in line],
            "last_report": {"delivered": sorted(report.delivered), "failed": report.failed,
                            "delta_receivers": sorted(report.delta_receivers)},
        }  # fmt: skip


class Trainer:
    """The trainer as a process of its own on host 0 (``trainer`` mode): SIGKILLed and relaunched
    from the version after the last it pushed, or SIGSTOPped; the receivers follow each new one.
    Stands in for the sender in :class:`Fleet` (the store's address, the current epoch, who is live)."""

    def __init__(self, procs: Procs, ctl: Control, address: str, out: Path, pushes: int, cross_host: str) -> None:
        self.procs, self.ctl, self.store_address, self.out = procs, ctl, address, out
        self.pushes, self.cross_host = pushes, cross_host
        self.pushed, self.go, self.go_last, self.report, self.close = (
            out / n for n in ("pushed.jsonl", "go", "go_last.json", "report.json", "close"))  # fmt: skip
        self.launches = 0
        self.stopped_until: float | None = None
        self.name = ""

    @property
    def epoch(self) -> int:
        return int(self.ctl.add(keys.SENDER_EPOCH, 0))

    def receivers(self) -> list[str]:
        """Those that said they are ready (registered), whatever the sender saw."""
        return [r["name"] for r in read(self.out / "events.jsonl") if r["event"] == "ready"]

    def last_pushed(self) -> int:
        return max((r["version"] for r in read(self.pushed) if r["event"] == "pushed"), default=0)

    def launch(self) -> str:
        first = self.last_pushed() + 1
        self.name = f"trainer{self.launches}"
        self.launches += 1
        argv = [sys.executable, str(HERE / "_chaos_trainer.py"), "--store", self.store_address,
                "--pushed", str(self.pushed), "--go", str(self.go), "--go-last", str(self.go_last),
                "--report", str(self.report), "--close", str(self.close), "--cross-host", self.cross_host,
                "--first", str(first), "--last", str(self.pushes)]  # fmt: skip
        self.procs.start(self.name, 0, argv)
        return self.name

    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs.started[self.name]

    def kill(self) -> dict[str, Any]:
        self.resume()
        old = self.name
        os.kill(self.proc().pid, signal.SIGKILL)
        self.proc().wait(timeout=30)
        return {"kill": old, "after_version": self.last_pushed(), "replacement": self.launch()}

    def stop(self, for_s: float) -> dict[str, Any]:
        os.kill(self.proc().pid, signal.SIGSTOP)
        self.stopped_until = time.monotonic() + for_s
        return {"stop": self.name, "for_s": round(for_s, 2)}

    def resume(self, everyone: bool = False) -> None:
        if self.stopped_until is not None and (everyone or time.monotonic() >= self.stopped_until):
            os.kill(self.proc().pid, signal.SIGCONT)
            self.stopped_until = None


def trainer_scenario(out: Path, n_hosts: int, per_host: int, pushes: int, seed: int, cross_host: str,
                     garbage: bool) -> dict[str, Any]:  # fmt: skip
    """The chaos with the trainer a process of its own (SIGKILLed and relaunched, SIGSTOPped) and
    the store hosted by this process (as torchrun's agent or ``lightning-wsync store`` would)."""
    events = out / "events.jsonl"
    rng = random.Random(seed)
    expected: dict[int, str] = {}
    ref = build_model(SPEC, seed=0)
    for version in range(1, pushes + 1):  # what the trainer holds at each version, bit for bit
        step(ref, version)
        expected[version] = digest(ref, None)
    with SimHosts(n_hosts + 1) as hosts:
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        server = tcp_store(hosts.address(0), 0, serve=True, timeout_s=30)
        ctl = Control(server, "chaos")
        procs = Procs(hosts, out)
        trainer = Trainer(procs, ctl, f"{hosts.address(0)}:{server.port}", out, pushes, cross_host)
        trainer.launch()
        wait_until("the trainer to start", lambda: trainer.epoch >= 1, 180, procs)
        fleet = Fleet(procs, trainer, events)
        for host in range(1, n_hosts + 1):
            for _ in range(per_host):
                fleet.start(host)
        wait_until("every receiver to register", fleet.registered, 180, procs)
        trainer.go.write_text("")
        actions: list[dict[str, Any]] = []
        key_counts: list[int] = []
        shapes_early: dict[str, int] = {}
        started, done = time.monotonic(), 0
        while done < pushes - 1:
            if trainer.proc().poll() is not None:
                raise AssertionError(f"the trainer exited by itself (rc={trainer.proc().poll()})\n{procs.describe()}")
            fleet.resume()
            trainer.resume()
            for version in range(done + 1, trainer.last_pushed() + 1):
                done = version
                key_counts.append(server.num_keys())
                if version == EVERY:
                    shapes_early = key_shapes(ctl)
                if version >= pushes - EVERY:
                    continue
                t = round(time.monotonic() - started, 2)
                if version % EVERY == 0 and (action := act(fleet, rng, ctl, HEARTBEAT_TIMEOUT_S)) is not None:
                    actions.append({"version": version, "t": t, **action})
                if garbage and version % EVERY == EVERY // 2:
                    if (action := garble(fleet, rng, ctl, n_hosts)) is not None:
                        actions.append({"version": version, "t": t, **action})
                if version % EVERY == EVERY - 2 and trainer.stopped_until is None and rng.random() < 0.5:
                    action = (trainer.kill() if rng.random() < 0.6
                              else trainer.stop(rng.uniform(0.5, 2.5) * HEARTBEAT_TIMEOUT_S))  # fmt: skip
                    actions.append({"version": version, "t": t, "trainer": True, **action})
                    break  # a relaunched trainer goes on from the last version pushed
            time.sleep(0.05)
        fleet.resume(everyone=True)
        trainer.resume(everyone=True)
        wait_until("every replacement to register", fleet.registered, 180, procs)
        live = fleet.live()
        trainer.go_last.write_text(json.dumps(live))
        wait_until("the last push", lambda: trainer.last_pushed() >= pushes, 300, procs)
        pushed_at = next(r["t"] for r in read(trainer.pushed) if r.get("version") == pushes)

        def all_hold_last() -> bool:
            got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == pushes}
            return got >= set(live)

        wait_until("every live receiver to apply the last version", all_hold_last, 120, procs)
        catch_up_s = time.time() - pushed_at
        wait_until("the last push's report", trainer.report.exists, 2 * TIMEOUT_S + 30, procs)
        report = json.loads(trainer.report.read_text())
        run_s = time.monotonic() - started
        stale, relay_keys = settle(ctl, trainer.epoch, n_hosts)
        until = time.monotonic() + 2 * (TIMEOUT_S + HEARTBEAT_TIMEOUT_S)  # the last one's predecessor's linger
        while (dead := dead_epoch_relay_keys(ctl, trainer.epoch)) and time.monotonic() < until:
            time.sleep(0.5)
        settled = server.num_keys()
        shapes_settled = key_shapes(ctl)
        shm = segments("chaos")
        trainer.close.write_text("")
        procs.wait(trainer.name, 2 * TIMEOUT_S + 30)
    applied = [r for r in read(events) if r["event"] == "applied"]
    torn = [r for r in applied if r["digest"] != expected.get(r["version"])]
    return {
        "pushes": pushes, "hosts": n_hosts, "per_host": per_host, "seed": seed, "timeout_s": TIMEOUT_S,
        "actions": actions, "live": live, "applied": len(applied), "torn": torn, "launches": trainer.launches,
        "epochs": sorted({r["epoch"] for r in read(trainer.pushed) if r["event"] == "started"}),
        "key_counts": key_counts, "keys_settled": settled, "relay_keys": relay_keys,
        "stale_relay_keys": stale, "dead_epoch_relay_keys": dead, "key_shapes": [shapes_early, shapes_settled],
        "catch_up_s": catch_up_s, "run_s": run_s,
        "segments": shm,
        "thread_deaths": [f"{log.name}: {line.strip()}" for log in sorted(out.glob("*.log"))
                          for line in log.read_text(errors="replace").splitlines()
                          if "Exception in thread" in line],
        "last_report": report,
    }  # fmt: skip


if __name__ == "__main__":
    main(scenario)

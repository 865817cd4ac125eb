"""house6 probe: with H6_DUMP=<dir>, log every store request the bench's CountingProxy sees
(time, client address, command, raw key) and dump them with the idle window's bounds."""
import os, sys

_DIR = os.environ.get("H6_DUMP")


def _patch_proxy(mod):
    import threading, time
    from collections import Counter
    cls = mod.CountingProxy
    orig_init = cls.__init__

    def __init__(self, *a, **k):
        self.h6_events = []
        self.h6_peers = {}
        orig_init(self, *a, **k)

    def _count(self, pair, data):
        if not pair.parsing:
            return
        now = time.monotonic()
        peer = self.h6_peers.get(id(pair))
        if peer is None:
            try:
                peer = "%s:%d" % pair.client.getpeername()[:2]
            except OSError:
                peer = "?"
            self.h6_peers[id(pair)] = peer
        buf = pair.pending
        buf += data
        at, seen, by_key = 0, Counter(), Counter()
        try:
            while (got := mod.parse_request_key(buf, at)) is not None:
                name, at, key = got
                seen[name] += 1
                by_key[f"{name} {mod.key_pattern(key)}"] += 1
                self.h6_events.append((now, peer, name, key.decode("utf-8", "replace")))
        except mod.ProtocolError:
            pair.parsing = False
            self.unparsed += 1
        del buf[:at]
        with self._lock:
            self._counts.update(seen)
            self._keys.update(by_key)

    cls.__init__ = __init__
    cls._count = _count


def _patch_bench(mod):
    import json, time
    orig = mod._idle_store_rate

    def _idle_store_rate(proxy):
        t0 = time.monotonic()
        rate = orig(proxy)
        t1 = time.monotonic()
        events = list(getattr(proxy, "h6_events", []))
        path = os.path.join(_DIR, "idle-%d-%d.json" % (os.getpid(), int(time.time() * 1000)))
        with open(path, "w") as f:
            json.dump({"t0": t0, "t1": t1, "rate": rate, "events": events}, f)
        return rate

    mod._idle_store_rate = _idle_store_rate


def _log(line):
    with open(os.path.join(_DIR, "times-%d.txt" % os.getpid()), "a") as f:
        f.write(line + "\n")


def _patch_watcher(mod):
    import time
    orig = mod.Watcher._on_staged

    def _on_staged(self, version):
        _log("staged %.6f %s %d" % (time.monotonic(), self.name, version))
        return orig(self, version)

    mod.Watcher._on_staged = _on_staged


def _patch_sender(mod):
    import time
    orig = mod.WeightSender.push

    def push(self, version, *a, **k):
        _log("push %.6f trainer %d" % (time.monotonic(), version))
        return orig(self, version, *a, **k)

    mod.WeightSender.push = push


def _patch_receivers(mod):
    import time
    orig = mod.receiver_main

    def receiver_main(conn, args):
        class Conn:
            def __getattr__(self, name):
                return getattr(conn, name)

            def send(self, obj):
                if isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[2], float):
                    _log("applied %.6f %s %s" % (obj[2], args.name, obj[1]))
                return conn.send(obj)

        return orig(Conn(), args)

    mod.receiver_main = receiver_main


_HOOKS = {"lightning_wsync._pull.watcher": _patch_watcher, "lightning_wsync._push.sender": _patch_sender,
          "lightning_wsync.bench._receivers": _patch_receivers, "lightning_wsync.testing.storeproxy": _patch_proxy, "lightning_wsync.bench._hostbench": _patch_bench}

if _DIR:
    import importlib.abc, importlib.machinery

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _HOOKS:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader, hook = spec.loader, _HOOKS[name]
            orig_exec = loader.exec_module

            def exec_module(module):
                orig_exec(module)
                hook(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())

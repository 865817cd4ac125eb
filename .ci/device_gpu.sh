#!/usr/bin/env bash
# The GPU checks, on a lent device machine (an H200; /work/.library/device/README.md). Nothing can be
# fetched there: its python3 holds a CUDA build of torch (2.11.0+cu130 when last seen, not the 2.13.0
# CI pins; a CUDA wheel of 2.13 is GBs, over the 64 MiB a run carries) and most of what the project
# needs. The rest travels in .devcarry/ (ignored; name it in the run's `carry`), made here first with
#     bash .ci/device_gpu.sh --pack
# (network needed): NIXL (nixl-cu12, ~29 MB as a tarball without the wheel's unused nixl_ep part; the
# wheel, 69 MB, is over the limit), omegaconf with antlr4, zstandard. Then, there:
#     bash .ci/device_gpu.sh
# runs tests/planes/test_gpu.py and tests/nixl/test_nixl_gpu.py (-v), then
# `lightning-wsync bench --gpu --size-mb 1024 --pushes 5 --json`, each under `timeout`, with the
# outputs in $OUT (or ./device-out): env.txt, pytest.log, bench-gpu.json, bench-gpu.log. ~8 min at most.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--pack" ]; then
    set -e
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nixl-cu12==1.5.1 omegaconf==2.3.1 zstandard==0.25.0
    python3 -m pip wheel -q --no-deps -w "$tmp" antlr4-python3-runtime==4.9.3  # an sdist only: pure Python
    rm -rf .devcarry && mkdir -p .devcarry "$tmp/nixl"
    (cd "$tmp/nixl" && python3 -m zipfile -e "$tmp"/nixl_cu12-*.whl . &&
        tar czf "$OLDPWD/.devcarry/nixl_cu12.tgz" .nixl_cu12.mesonpy.libs nixl_cu12 nixl_cu12.libs nixl_cu12-*.dist-info)
    cp "$tmp"/omegaconf-*.whl "$tmp"/zstandard-*.whl "$tmp"/antlr4_python3_runtime-*.whl .devcarry/
    du -sh .devcarry
    exit 0
fi

out=${OUT:-$PWD/device-out}
mkdir -p "$out"
site=/tmp/wsync-site
if [ -d .devcarry ]; then
    mkdir -p "$site"
    tar xzf .devcarry/nixl_cu12.tgz -C "$site"
    for whl in .devcarry/*.whl; do python3 -m zipfile -e "$whl" "$site"; done
else
    echo "no .devcarry/ (bash .ci/device_gpu.sh --pack, then carry it): NIXL tests will skip" | tee "$out/env.txt"
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
timeout 60 python3 - >>"$out/env.txt" 2>&1 <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
from lightning_wsync._planes.nixl.agent import unusable
print("nixl", unusable() or "usable")
PY
cat "$out/env.txt"
timeout 330 python3 -m pytest -p no:cacheprovider -v -o addopts="-ra --strict-markers" \
    tests/planes/test_gpu.py tests/nixl/test_nixl_gpu.py 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
timeout 150 python3 -c 'import sys; from lightning_wsync.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --gpu --size-mb 1024 --pushes 5 --json >"$out/bench-gpu.json" 2>"$out/bench-gpu.log"
bench=$?
tail -n 20 "$out/bench-gpu.log"
echo "pytest exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]

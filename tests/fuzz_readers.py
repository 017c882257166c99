"""Coverage-guided fuzzing of every reader (issue 42), with atheris (libFuzzer).

Usage (libFuzzer's flags; corpus directories optional)::

    python tests/fuzz_readers.py -seed=1 -runs=300
    python tests/fuzz_readers.py -max_total_time=600 -artifact_prefix=fuzz-artifacts/ corpus/

An input is one byte that chooses a file and that file's new content. The file is one of
four, taken from a clean checkpoint (``save_checkpoint``) and clean snapshots
(``PostHocEMA``) written at start: the checkpoint's ``.metadata`` (a pickle) and its
checksum file (JSON), the latest snapshot's ``manifest.json`` and its ``.metadata``. The
real files are the seeds; libFuzzer mutates them byte by byte, and a structure-aware
mutator (half the time) edits one field of the unpickled metadata or the parsed JSON: a
value of another type, a huge or negative number, a nested list, a field removed.

Each input is written over a scratch copy of its directory, and the readers run on it:
``load_checkpoint`` (verified) and ``convert_checkpoint`` (unverified) for the checkpoint,
``synthesize`` and the CLI's ``list`` for the snapshots. Every run must either succeed
(a verified read then returns exactly the clean values) or raise one of the documented
exceptions (``CheckpointError``, ``ChecksumError``, ``SnapshotError``, ``ValueError``,
``FileNotFoundError`` for missing data files), within :data:`SECONDS` and :data:`PEAK_MIB`
of extra resident memory; the CLI exits 0, or 2 with one ``error: <file>: ...`` line.
Anything else is a crash: libFuzzer stops and writes the input (``crash-<sha1>``) for a
regression test. ``tests/test_fuzz.py`` runs a short seeded run in the normal suite, and
``nox -s fuzz -- SECONDS`` a longer one.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import pickle
import random
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris
import torch
from bounded_run import proc_status, reset_peak
from crafted import mutate_object
from models import reader_model

READERS = [
    f"dtensor_ema.{m}"
    for m in (
        "checkpoint.bounded_json",
        "checkpoint.save_load",
        "checkpoint.files",
        "checkpoint.checksums",
        "checkpoint.coverage",
        "checkpoint.storage",
        "export.full_weights",
        "checkpoint.metadata_check",
        "posthoc.cli",
        "posthoc.snapshots",
        "posthoc.synthesis",
        "checkpoint.reader",
    )
]
"""The modules whose branches guide the fuzzing (instrumenting all of dtensor_ema takes
seconds at every start, for code no input reaches)."""

with atheris.instrument_imports(include=READERS):
    from dtensor_ema import (
        CheckpointError,
        ModelEMA,
        PostHocEMA,
        convert_checkpoint,
        load_checkpoint,
        save_checkpoint,
        synthesize,
    )
    from dtensor_ema.posthoc.cli import main as cli_main

SECONDS = 10.0
PEAK_MIB = 500.0
DOCUMENTED = (CheckpointError, ValueError, FileNotFoundError)
"""What a reader may raise on a bad file (``ChecksumError`` is a ``CheckpointError``,
``SnapshotError`` a ``ValueError``)."""
SIGMA = 0.08


class Seeds:
    """The clean directories, written once (save ids fixed, so that inputs replay)."""

    def __init__(self, root: Path) -> None:
        ids = iter(uuid.UUID(int=i) for i in range(1, 1000))
        real = uuid.uuid4
        uuid.uuid4 = lambda: next(ids)  # type: ignore[assignment]
        try:
            model = reader_model()
            ema = ModelEMA(model, decay=0.5, tau=None)
            posthoc = PostHocEMA(model, (0.05, 0.10), snapshot_every=2, snapshot_dir=root / "s")
            g = torch.Generator().manual_seed(0)
            for _ in range(4):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g))
                ema.update()
                posthoc.update()
            save_checkpoint({"ema": ema}, root / "c")
        finally:
            uuid.uuid4 = real  # type: ignore[assignment]
        self.root = root
        self.ema = {k: v.clone() for k, v in ema.ema_tensors().items()}
        self.updates = ema.updates
        self.synthesized = synthesize(root / "s", SIGMA)
        self.latest = sorted((root / "s").glob("step-*"))[-1].name


class Target:
    """One file a mutated input replaces, and the readers that must survive it."""

    def __init__(
        self, name: str, directory: Path, file: str, run: Callable[[Path], None], kind: str
    ) -> None:
        self.name, self.directory, self.file, self.run_on, self.kind = (
            name,
            directory,
            file,
            run,
            kind,
        )
        self.clean = (directory / file).read_bytes()

    def run(self, content: bytes) -> None:
        path = self.directory / self.file
        path.write_bytes(content)
        try:
            self.run_on(self.directory)
        finally:
            path.write_bytes(self.clean)


def _documented(call: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, call())``, or ``(False, None)`` when it raised a documented exception (of one
    line); anything else propagates: a crash."""
    try:
        return True, call()
    except DOCUMENTED as e:
        if "\n" in str(e):
            raise AssertionError(f"a message of more than one line: {e!r}") from e
        return False, None


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if got.keys() != want.keys() or not all(torch.equal(got[k], want[k]) for k in want):
        raise AssertionError("a verified read succeeded with other values than saved")


def _targets(seeds: Seeds, scratch: Path) -> list[Target]:
    checkpoint = Path(shutil.copytree(seeds.root / "c", scratch / "c"))
    snapshots = Path(shutil.copytree(seeds.root / "s", scratch / "s"))
    out = scratch / "out.pt"

    def checkpoint_readers(d: Path) -> None:
        ema = ModelEMA(reader_model(), decay=0.5, tau=None)
        loaded, _ = _documented(lambda: load_checkpoint({"ema": ema}, d))
        if loaded:
            _equal(dict(ema.ema_tensors()), seeds.ema)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _documented(lambda: convert_checkpoint(d, out, verify=False))

    def snapshot_readers(d: Path) -> None:
        done, got = _documented(lambda: synthesize(d, SIGMA))
        if done:
            _equal(got, seeds.synthesized)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli_main(["list", str(d)])
        text = err.getvalue()
        if not (rc == 0 or (rc == 2 and text.startswith("error: ") and text.count("\n") == 1)):
            raise AssertionError(f"the CLI exited {rc} with {text!r}")

    latest = seeds.latest
    return [
        Target("checkpoint .metadata", checkpoint, ".metadata", checkpoint_readers, "pickle"),
        Target(
            "checkpoint checksums", checkpoint, "__0.checksums.json", checkpoint_readers, "json"
        ),
        Target("manifest", snapshots, f"{latest}/manifest.json", snapshot_readers, "json"),
        Target("snapshot .metadata", snapshots, f"{latest}/.metadata", snapshot_readers, "pickle"),
    ]


# ------------------------------------------------------------------------ mutation
def _structured(target: Target, data: bytes, rng: random.Random) -> bytes | None:
    """A structure-aware mutation of ``data`` (or of the clean file when ``data`` does not
    parse): one field of the object it holds changed, written back in its format."""
    from dtensor_ema.checkpoint.pickle_scan import memo_problem
    from dtensor_ema.checkpoint.reader import (
        _MetadataUnpickler,  # the restricted unpickler (no code)
    )

    for source in (data, target.clean):
        try:
            if target.kind == "pickle":
                if memo_problem(source) is not None:  # the C unpickler would take gigabytes
                    continue
                value = _MetadataUnpickler(io.BytesIO(source)).load()
            else:
                value = json.loads(source)
        except Exception:
            continue
        try:  # an earlier edit can leave objects that neither copy nor pickle
            value = mutate_object(copy.deepcopy(value), rng)
            if target.kind == "pickle":
                return pickle.dumps(value)
            return json.dumps(value, allow_nan=True).encode()
        except Exception:
            return None
    return None


# ------------------------------------------------------------------------ the harness
class Harness:
    def __init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="fuzz-readers-"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.seeds = Seeds(self.work / "seeds")
        self.targets = _targets(self.seeds, self.work / "scratch")

    def corpus(self) -> Path:
        """One input per target: its clean file."""
        corpus = self.work / "corpus"
        corpus.mkdir()
        for i, target in enumerate(self.targets):
            (corpus / f"seed-{i}").write_bytes(bytes([i]) + target.clean)
        return corpus

    def one_input(self, data: bytes) -> None:
        if not data:
            return
        target = self.targets[data[0] % len(self.targets)]
        reset_peak()
        before = proc_status("VmRSS")
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target.run(data[1:])
        seconds = time.perf_counter() - start
        peak = (proc_status("VmHWM") - before) / 2**20
        if seconds > SECONDS or peak > PEAK_MIB:
            raise AssertionError(
                f"{target.name}: {seconds:.1f} s and {peak:.0f} MiB of extra memory, more than "
                f"{SECONDS} s or {PEAK_MIB} MiB"
            )

    def mutate(self, data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        target_byte = data[0] if data else rng.randrange(len(self.targets))
        if rng.random() < 0.5:
            target = self.targets[target_byte % len(self.targets)]
            mutated = _structured(target, data[1:], rng)
            if mutated is not None and len(mutated) < max_size:
                return bytes([target_byte]) + mutated
        return atheris.Mutate(data, max_size)


def main(argv: list[str]) -> None:
    harness = Harness()
    args = [*argv, str(harness.corpus())]  # after any corpus given: new inputs go to that
    if not any(a.startswith("-max_len") for a in args):
        longest = max(len(t.clean) for t in harness.targets)
        args.append(f"-max_len={2 ** math.ceil(math.log2(4 * longest))}")
    atheris.Setup(args, harness.one_input, custom_mutator=harness.mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)

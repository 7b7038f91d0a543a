"""The identity of a resumable batch job, and recovering its output before a resume.

A job's identity is a digest of its input file's bytes, a digest of its model package (every
file of the model directory: manifest or config, weights, tokenizer and template), and every
setting that changes its results. It lives in a job file beside the output, `OUT.job.json`,
written atomically (temp file, fsync, rename) before the first output line, so every output
line is covered by one. A sidecar rather than a field on every line: the output keeps its
schema (line i answers input record i, nothing else), the identity is written once instead of
on every line, and it holds every component, so a refusal can say which one differs.

A resume with output lines but no job file, or with a job file of another identity, is refused
before the output is touched: nothing is cut and nothing is appended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

from ninfer_jax.artifact.format import MANIFEST, WEIGHTS
from ninfer_jax.gateway.files import CommandError, digest_lines, os_reason, write_atomic

JOB_SUFFIX = ".job.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    """What a job's output depends on. Paths are kept for messages; digests decide."""

    input_path: str
    input_sha256: str
    num_records: int
    model_path: str
    model_sha256: str
    settings: dict[str, Any]  # flag name -> value, for every flag that changes results

    def to_json(self) -> bytes:
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)},
                          indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobIdentity:
        names = {f.name for f in dataclasses.fields(cls)}
        if data.get("format_version") != FORMAT_VERSION or set(data) - {"format_version"} != names:
            raise ValueError("not a job file of this version")
        return cls(**{k: data[k] for k in names})

    def differences(self, other: JobIdentity) -> list[str]:
        """What differs from `other` (the output's job), in words naming the flags."""
        out = []
        if (self.input_sha256, self.num_records) != (other.input_sha256, other.num_records):
            out.append(f"--input differs (the output's job read {other.input_path!r}: "
                       f"{other.num_records} records, sha256 {other.input_sha256[:12]}; this "
                       f"one {self.input_path!r}: {self.num_records} records, sha256 "
                       f"{self.input_sha256[:12]})")
        if self.model_sha256 != other.model_sha256:
            out.append(f"--model differs (the output's job used {other.model_path!r}, sha256 "
                       f"{other.model_sha256[:12]}; this one {self.model_path!r}, sha256 "
                       f"{self.model_sha256[:12]})")
        for name in sorted(set(self.settings) | set(other.settings)):
            mine, theirs = self.settings.get(name), other.settings.get(name)
            if mine != theirs:
                out.append(f"--{name} differs ({theirs!r} for the output, {mine!r} now)")
        return out


def model_sha256(root: pathlib.Path) -> str:
    """A digest of every file under the model directory (relative name, size and bytes), hidden
    entries (.git, .cache) aside. Symlinked files count by their target's content. An artifact
    whose manifest carries per-tensor digests (checked at load) stands for its weights/ files,
    so they are not read again (seconds per GB)."""
    h = hashlib.sha256()
    skip = WEIGHTS if _manifest_has_digests(root) else None
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts)
                   and p.relative_to(root).parts[0] != skip)
    try:
        for path in files:
            name = path.relative_to(root).as_posix().encode()
            h.update(len(name).to_bytes(8, "little") + name)
            h.update(path.stat().st_size.to_bytes(8, "little"))
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    except OSError as e:
        raise CommandError(f"--model {str(root)!r}: cannot read {e.filename}: "
                           f"{os_reason(e)}") from None
    return h.hexdigest()


def _manifest_has_digests(root: pathlib.Path) -> bool:
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and bool(manifest.get("tensors"))


def job_identity(input_path: str, model_dir: pathlib.Path, settings: dict[str, Any]
                 ) -> JobIdentity:
    """The identity of a job over `input_path`, which must be a regular file: it is read twice
    (digest, then records), which a pipe or a device cannot be."""
    if os.path.exists(input_path) and not os.path.isfile(input_path):
        raise CommandError(f"--input {str(input_path)!r} is not a regular file (a job reads "
                           "its input twice)")
    digest, num_records = digest_lines("input", input_path)
    return JobIdentity(input_path=str(input_path), input_sha256=digest, num_records=num_records,
                       model_path=str(model_dir), model_sha256=model_sha256(model_dir),
                       settings=dict(settings))


def _complete_lines(output: pathlib.Path) -> tuple[int, int]:
    """(complete result lines, byte length they span); CommandError if one is not the result
    of its record (index n on line n)."""
    count = end = 0
    with open(output, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a torn last line: cut by the caller
            try:
                index = json.loads(line).get("index")
            except (ValueError, AttributeError, RecursionError):
                index = None
            if index != count:
                raise CommandError(f"--output {str(output)!r} line {count + 1} is not the "
                                   f"result of record {count}; not an output of ninfer score")
            count, end = count + 1, end + len(line)
    return count, end


def prepare_output(output: str, identity: JobIdentity) -> int:
    """Makes `output` ready to be appended to by the job `identity`; returns how many records it
    holds. A new (or empty) output gets its job file; an existing one must belong to `identity`
    (CommandError naming every difference, nothing touched), then a torn last line is cut."""
    path = pathlib.Path(output)
    job = path.with_name(path.name + JOB_SUFFIX)
    try:
        if path.exists() and not path.is_file():
            raise CommandError(f"--output {output!r} is not a regular file")
        size = path.stat().st_size if path.exists() else 0
        if size == 0:
            write_atomic("output", job, identity.to_json())
            return 0
        if not job.is_file():
            raise CommandError(
                f"--output {output!r} holds results but no job file {job.name!r}, so which "
                "input, model and settings it belongs to is unknown; refusing to resume (delete "
                "it or choose another --output)")
        try:
            theirs = JobIdentity.from_json(json.loads(job.read_bytes()))
        except (ValueError, TypeError, RecursionError) as e:
            raise CommandError(f"--output {output!r}: its job file {job.name!r} is not valid "
                               f"({e}); refusing to resume") from None
        diff = identity.differences(theirs)
        if diff:
            raise CommandError(f"--output {output!r} belongs to another job: "
                               + "; ".join(diff) + "; refusing to resume (choose another "
                               "--output, or delete it and its job file to start over)")
        done, end = _complete_lines(path)
        if done > identity.num_records:
            raise CommandError(f"--output {output!r} has {done} records, the input only "
                               f"{identity.num_records}")
        if end < size:
            with open(path, "rb+") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return done
    except OSError as e:
        raise CommandError(f"--output {output!r}: {os_reason(e)}") from None

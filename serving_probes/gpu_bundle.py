"""An offline bundle of CUDA vLLM 0.26.0 for an air-gapped Hopper host (Python 3.12, torch 2.11.0+cu130).

    python -m serving_probes.gpu_bundle build --out .gpu/bundle [--part-mib 32] [--vllm-wheel PATH] [--wheels-dir PATH]
    python -m serving_probes.gpu_bundle verify --bundle DIR [--groups core,moe]
    python -m serving_probes.gpu_bundle install --bundle DIR --target DIR [--repo PATH] [--groups core,moe]
                                                [--skip-kvcached] [--no-probe]

``build`` runs where a package index is reachable: it takes vLLM's CUDA wheel, trims it to what a Hopper
engine loads (docs: the GPU host's notes, ``cuda-vllm-h200.md``), adds the wheels the host's image lacks
(`HOST_WHEELS`), and writes one tar stream per group (`GROUPS`), xz-compressed and split into parts, plus
``manifest.json``. ``install`` runs on the host, which has no network and no package index; like
``verify`` it needs only the standard library and the host's pip.

Invariants a bundle keeps:

* a group's parts, concatenated in manifest order, are exactly one xz stream of one tar stream, whose
  sha256 the manifest records beside every part's size and sha256; no part exceeds the part size, which
  is at most `MAX_PART_MIB` MiB; the tar holds only ``site/...`` (goes to ``TARGET/site``) and
  ``wheels/*.whl`` (installed into it);
* every member of the vLLM wheel is either in exactly one group or listed as dropped, with the trim rule
  that dropped it (a failure on the host can be traced to a trim).

Invariants an install keeps: nothing is written before every part of every selected group has its
recorded size and sha256; the new tree is assembled in ``TARGET.staging-XXXX`` beside the target and
renamed into place only when complete; on any failure the staging directory is removed and an existing
target is left as it was. Failures are `BundleError` subclasses whose one-line message names the file;
the CLI prints that line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import calendar
import functools
import hashlib
import io
import json
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

FORMAT_VERSION = 1
VLLM_VERSION = "0.26.0"
#: The torch the host's image has; the CUDA wheel of `VLLM_VERSION` must pin exactly this one.
HOST_TORCH = "2.11.0"
MANIFEST_NAME = "manifest.json"
MIB = 1 << 20
#: A part travels in one call of 64 MiB together with the repository's tracked files (6.9 MB on
#: 12-04, 18.2 MB on 12-05 when 48 MiB parts no longer fit, 16 MB once reports keep their step
#: logs as .xz, 19.1 MiB on 12-07 when 44 MiB parts no longer fit, 21.6 MiB after that day's
#: reports): 32 MiB leaves them 10 MiB to grow, and the core group (85 MiB) still takes three calls.
DEFAULT_PART_MIB = 32
#: The largest part this tool writes (the copy onto the host moves parts one file at a time); the default
#: stays a few MiB below it.
MAX_PART_MIB = 60
#: xz -9e: the stream is built once and unpacked many times, so compression time is the cheap side.
XZ_PRESET = 9
#: Settings an engine on the host needs, with the reason (measured there).
ENGINE_ENV: tuple[tuple[str, str, str], ...] = (
    ("VLLM_USE_FLASHINFER_SAMPLER", "0",
     "flashinfer is not on the host; without this LLM() fails in vllm/v1/sample/ops/topk_topp_sampler.py"),
    ("VLLM_USE_V2_MODEL_RUNNER", "0", "Model Runner V1, the runner kvcached is proven on here (V2: issue 29)"),
)


# --- errors -------------------------------------------------------------------------------------------


class BundleError(Exception):
    """A bundle cannot be built, verified or installed. ``str()`` is one line and names the file."""


class PartSizeError(BundleError):
    """The part size asked for is outside 1..`MAX_PART_MIB` MiB."""


class ManifestError(BundleError):
    """The manifest is missing, unreadable, of another format version, or inconsistent."""


class MissingPart(BundleError):
    """Parts the manifest lists are not in the bundle directory."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = tuple(paths)
        names = ", ".join(str(p) for p in self.paths)
        super().__init__(f"missing part{'s' if len(self.paths) > 1 else ''}: {names}")


class CorruptPart(BundleError):
    """A part's size or sha256 differs from the manifest's."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(f"corrupt part {path}: {reason}")


class UnknownGroup(BundleError):
    """A group name the manifest does not have."""


class TrimError(BundleError):
    """The vLLM wheel does not have the layout the trim rules were written for."""


class WheelError(BundleError):
    """A wheel is missing, is not the expected one, or does not fit the host."""


class StepFailed(BundleError):
    """A subprocess step (pip download, pip install, the kvcached build) exited non-zero."""


class InstallConflict(BundleError):
    """Two sources put the same file into ``site`` (the import order would decide which one runs)."""


# --- what goes into a bundle ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The host a bundle is for."""

    python: str = "3.12"
    cuda: str = "cu13"
    arch: str = "sm90"
    torch: str = HOST_TORCH


@dataclass(frozen=True)
class WheelPin:
    """A wheel the host's image lacks. ``purpose``: ``engine`` (an offline ``LLM`` needed it on the
    host), ``serve`` (``vllm serve`` imports it at module level; not yet run on the host) or ``bench``
    (vLLM's serving benchmark client, ``vllm.benchmarks.serve``, imports it; not yet run there)."""

    name: str
    version: str
    purpose: str


#: Everything the host lacks, exactly pinned. The ``engine`` rows were measured on the host (its notes).
HOST_WHEELS: tuple[WheelPin, ...] = (
    WheelPin("pydantic", "2.14.4", "engine"),
    WheelPin("pydantic_core", "2.50.5", "engine"),
    WheelPin("annotated-types", "0.8.0", "engine"),
    WheelPin("typing-inspection", "0.4.5", "engine"),
    WheelPin("msgspec", "0.23.0", "engine"),
    WheelPin("pyzmq", "27.3.0", "engine"),
    WheelPin("cachetools", "8.0.2", "engine"),
    WheelPin("cbor2", "6.3.0", "engine"),
    WheelPin("pybase64", "1.5.1", "engine"),
    WheelPin("blake3", "1.0.11", "engine"),
    WheelPin("openai", "2.54.0", "engine"),  # 3.x needs httpx2
    WheelPin("jiter", "0.19.0", "engine"),
    WheelPin("distro", "1.9.0", "engine"),
    WheelPin("sniffio", "1.3.1", "engine"),
    WheelPin("openai-harmony", "0.0.8", "engine"),
    WheelPin("llguidance", "1.7.6", "engine"),
    WheelPin("xgrammar", "0.2.6", "engine"),  # the newest that fits the wheel's apache-tvm-ffi==0.1.10 pin
    WheelPin("apache-tvm-ffi", "0.1.10", "engine"),
    WheelPin("fastapi", "0.136.3", "engine"),
    WheelPin("starlette", "1.10.0", "engine"),
    WheelPin("partial-json-parser", "0.2.1.1.post7", "engine"),
    WheelPin("setproctitle", "1.3.8", "engine"),
    # The GDN layers' module imports the AWQ/int-wNa16 MoE oracle, which imports compressed_tensors
    # (qwen3_next failed to load without it on the H200, 2026-12-03); the wheel pins 0.17.0.
    WheelPin("compressed-tensors", "0.17.0", "engine"),
    WheelPin("loguru", "0.7.3", "engine"),  # compressed-tensors imports it
    # `vllm serve`: what vLLM 0.26.0 imports at module level on the serve path beyond the engine's needs
    # (read from its sources; not yet run on the host). Their own requirements that are not listed here
    # are on the host: click and h11 (uvicorn), anyio (watchfiles; openai runs there), prometheus_client
    # (the engine's metrics import it), httpx and setuptools.
    WheelPin("uvicorn", "0.55.0", "serve"),  # entrypoints/launcher.py
    WheelPin("watchfiles", "1.3.0", "serve"),  # entrypoints/serve/utils/ssl.py, imported by launcher.py
    WheelPin("prometheus-fastapi-instrumentator", "8.1.0", "serve"),  # entrypoints/serve/instrumentator/metrics.py
    WheelPin("model-hosting-container-standards", "0.1.16", "serve"),  # entrypoints/openai/api_server.py
    WheelPin("jmespath", "1.1.0", "serve"),  # model-hosting-container-standards' sagemaker transforms
    # fastapi's own requirement (imported by fastapi/applications.py); the host's notes do not list it, so
    # it may be there already: 5 kB carried rather than an ImportError risked.
    WheelPin("annotated-doc", "0.0.7", "serve"),
    # `vllm.benchmarks.serve` (benchmarks/bench_serving.py's client) imports aiohttp at module level; the rest
    # are aiohttp's own requirements (pip's resolution for cp312 manylinux, 12-04). attrs is carried too:
    # nothing the host is known to have needs it. tqdm, regex and numpy are there (transformers).
    WheelPin("aiohttp", "3.14.5", "bench"),
    WheelPin("aiohappyeyeballs", "2.7.1", "bench"),
    WheelPin("aiosignal", "1.4.0", "bench"),
    WheelPin("frozenlist", "1.8.0", "bench"),
    WheelPin("multidict", "7.2.1", "bench"),
    WheelPin("propcache", "0.5.4", "bench"),
    WheelPin("yarl", "1.25.1", "bench"),
    WheelPin("attrs", "26.1.0", "bench"),
)


@dataclass(frozen=True)
class TrimRule:
    """vLLM wheel members a Hopper engine does not load. ``pattern`` must match a whole member name."""

    key: str
    pattern: str
    reason: str


TRIM_RULES: tuple[TrimRule, ...] = (
    TrimRule("fa2", r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so",
             "FlashAttention 2: Hopper runs FA3 (FA2_AVAILABLE False, FA3_AVAILABLE True without it)"),
    TrimRule("vllm-rs", r"vllm/vllm-rs", "the Rust frontend binary, run only with VLLM_USE_RUST_FRONTEND=1"),
    TrimRule("flashmla", r"vllm/_flashmla_C\.abi3\.so", "FlashMLA for MLA models (DeepSeek); import guarded"),
    TrimRule("qutlass", r"vllm/_qutlass_C\.abi3\.so", "QuTLASS FP4 kernels; platforms/cuda.py suppresses its "
             "ImportError"),
    TrimRule("rust-tool-parser", r"vllm/_rust_tool_parser\.abi3\.so",
             "the Rust tool-call parser, imported only when that parser is chosen"),
    TrimRule("deep-gemm-headers", r"vllm/third_party/deep_gemm/include/.+",
             "DeepGEMM's JIT headers (FP8 block GEMMs, not used by a bf16 engine)"),
    TrimRule("deep-gemm-other-pythons", r"vllm/third_party/deep_gemm/_C\.cpython-3(?!12-)\d+-x86_64-linux-gnu\.so",
             "DeepGEMM builds for Pythons other than 3.12"),
    TrimRule("fmha-sm100-cutlass", r"vllm/third_party/fmha_sm100/cutlass/.+",
             "CUTLASS headers of the sm100 (Blackwell) FMHA JIT"),
    TrimRule("swagger-static", r"vllm/entrypoints/serve/instrumentator/static/.+",
             "swagger UI files for --enable-offline-docs; without them vLLM warns and serves no /docs"),
)

#: Members the trimmed tree must keep; a build that would lose one fails (the rules went stale).
REQUIRED_MEMBERS: tuple[str, ...] = (
    "vllm/__init__.py",
    "vllm/_C_stable_libtorch.abi3.so",  # platforms/cuda.py imports it unconditionally
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",  # FLASH_ATTN on Hopper
    "vllm/v1/worker/gpu_model_runner.py",  # Model Runner V1
    "vllm/v1/worker/gpu/model_runner.py",  # Model Runner V2
    f"vllm-{VLLM_VERSION}.dist-info/METADATA",
)


@dataclass(frozen=True)
class GroupSpec:
    """A unit of the bundle: one tar stream. ``patterns``: vLLM wheel members that go here, not to core."""

    name: str
    required: bool
    description: str
    patterns: tuple[str, ...] = ()


GROUPS: tuple[GroupSpec, ...] = (
    GroupSpec("core", True, "the trimmed vLLM tree (site/) and the wheels the host lacks (wheels/)"),
    # platforms/cuda.py imports it under contextlib.suppress(ImportError): dense models run without it.
    GroupSpec("moe", False, "fused-MoE kernels, for MoE models only (granitemoehybrid, qwen3_next)",
              (r"vllm/_moe_C_stable_libtorch\.abi3\.so",)),
)


# --- the manifest --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartRecord:
    file: str
    size: int
    sha256: str


@dataclass(frozen=True)
class GroupRecord:
    """A packed group: its parts in stream order, and the whole stream's size and sha256."""

    name: str
    required: bool
    description: str
    parts: tuple[PartRecord, ...]
    stream_size: int
    stream_sha256: str
    members: int
    unpacked_size: int
    pack_seconds: float


@dataclass(frozen=True)
class DroppedMember:
    name: str
    size: int
    rule: str  # a `TrimRule.key`


@dataclass(frozen=True)
class WheelRecord:
    name: str
    version: str
    purpose: str
    file: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format_version: int
    vllm_version: str
    target: Target
    created_at: str
    compression: str
    build_seconds: float
    vllm_wheel: WheelRecord | None
    groups: tuple[GroupRecord, ...]
    trim_rules: tuple[TrimRule, ...]
    dropped: tuple[DroppedMember, ...]
    wheels: tuple[WheelRecord, ...]

    def to_json(self) -> str:
        return json.dumps(_to_plain(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and check a manifest; any defect is a `ManifestError` naming ``source``."""
        try:
            raw = json.loads(text)
            if raw.get("format_version") != FORMAT_VERSION:
                raise ManifestError(f"{source}: format version {raw.get('format_version')!r}, this tool reads "
                                    f"{FORMAT_VERSION}")
            manifest = cls(
                format_version=raw["format_version"], vllm_version=raw["vllm_version"],
                target=Target(**raw["target"]), created_at=raw["created_at"], compression=raw["compression"],
                build_seconds=raw["build_seconds"],
                vllm_wheel=WheelRecord(**raw["vllm_wheel"]) if raw["vllm_wheel"] else None,
                groups=tuple(GroupRecord(**{**g, "parts": tuple(PartRecord(**p) for p in g["parts"])})
                             for g in raw["groups"]),
                trim_rules=tuple(TrimRule(**r) for r in raw["trim_rules"]),
                dropped=tuple(DroppedMember(**d) for d in raw["dropped"]),
                wheels=tuple(WheelRecord(**w) for w in raw["wheels"]),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{source}: not a bundle manifest ({type(exc).__name__}: {exc})") from exc
        _check_part_names(manifest, source)
        return manifest


def _to_plain(obj: Any) -> Any:
    """Dataclasses to dicts, tuples to lists: what `json` writes and `Manifest.from_json` reads back."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f: _to_plain(getattr(obj, f)) for f in obj.__dataclass_fields__}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    return obj


_PART_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_part_names(manifest: Manifest, source: str) -> None:
    """Part names are plain file names: a manifest must not make install read outside the bundle."""
    names = [p.file for g in manifest.groups for p in g.parts]
    bad = [n for n in names if not _PART_NAME.fullmatch(n)]
    if bad:
        raise ManifestError(f"{source}: part names must be plain file names, got {bad[:3]}")
    if len(set(names)) != len(names):
        raise ManifestError(f"{source}: a part file is listed twice")
    if len({g.name for g in manifest.groups}) != len(manifest.groups):
        raise ManifestError(f"{source}: a group is listed twice")


def write_manifest(bundle: Path, manifest: Manifest) -> Path:
    path = bundle / MANIFEST_NAME
    path.write_text(manifest.to_json())
    return path


def read_manifest(bundle: Path) -> Manifest:
    path = bundle / MANIFEST_NAME
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from exc
    return Manifest.from_json(text, str(path))


# --- packing: members -> tar -> xz -> parts ----------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One file of a group's tar stream: its name there, its size, and how to read its bytes."""

    arcname: str
    size: int
    opener: Callable[[], IO[bytes]]
    mode: int = 0o644
    mtime: int = 0


def member_from_file(path: Path, arcname: str) -> Member:
    st = path.stat()
    return Member(arcname, st.st_size, lambda: path.open("rb"), st.st_mode & 0o777, int(st.st_mtime))


def members_from_zip(zf: zipfile.ZipFile, infos: Iterable[zipfile.ZipInfo], prefix: str) -> list[Member]:
    """Members read straight out of the wheel (no 730 MB unzip on disk); ``zf`` must stay open while packing."""
    out = []
    for info in infos:
        mode = (info.external_attr >> 16) & 0o777 or 0o644  # the Unix mode, where the wheel recorded one
        # timegm, not mktime: the same wheel gives the same tar on any machine, whatever its time zone.
        mtime = calendar.timegm((*info.date_time, 0, 0, 0))
        out.append(Member(prefix + info.filename, info.file_size, functools.partial(zf.open, info), mode, mtime))
    return out


def part_size_bytes(part_mib: int) -> int:
    """The part size in bytes; refuses sizes outside 1..`MAX_PART_MIB` MiB."""
    if not 1 <= part_mib <= MAX_PART_MIB:
        raise PartSizeError(f"--part-mib {part_mib}: a part must be 1 to {MAX_PART_MIB} MiB")
    return part_mib * MIB


class _PartWriter(io.RawIOBase):
    """Writes one byte stream as files ``GROUP.part01``, ``GROUP.part02``, ... in ``out_dir``.

    Invariant: the parts concatenated in order are the stream; each but the last holds exactly
    ``part_bytes``; no part is empty.
    """

    def __init__(self, out_dir: Path, group: str, part_bytes: int) -> None:
        super().__init__()
        self._dir, self._group, self._limit = out_dir, group, part_bytes
        self._file: BinaryIO | None = None
        self._name = ""
        self._fill = 0
        self._part_hash = hashlib.sha256()
        self.stream_hash = hashlib.sha256()
        self.stream_size = 0
        self.parts: list[PartRecord] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = view.nbytes
        while view:
            if self._file is None or self._fill == self._limit:
                self._next_part()
            assert self._file is not None
            chunk = view[: self._limit - self._fill]
            self._file.write(chunk)
            self._part_hash.update(chunk)
            self.stream_hash.update(chunk)
            self._fill += len(chunk)
            self.stream_size += len(chunk)
            view = view[len(chunk):]
        return written

    def _next_part(self) -> None:
        self._close_part()
        self._name = f"{self._group}.part{len(self.parts) + 1:02d}"
        self._file = (self._dir / self._name).open("wb")
        self._fill = 0
        self._part_hash = hashlib.sha256()

    def _close_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts.append(PartRecord(self._name, self._fill, self._part_hash.hexdigest()))
            self._file = None

    def finish(self) -> tuple[PartRecord, ...]:
        self._close_part()
        return tuple(self.parts)


def _tarinfo(member: Member) -> tarfile.TarInfo:
    info = tarfile.TarInfo(member.arcname)
    info.size, info.mode, info.mtime = member.size, member.mode, member.mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""  # the host's user owns what it unpacks
    return info


def pack_group(spec: GroupSpec, members: Sequence[Member], out_dir: Path, part_bytes: int,
               preset: int = XZ_PRESET | lzma.PRESET_EXTREME) -> GroupRecord:
    """Write ``members`` as one tar stream, xz-compressed, split into parts of at most ``part_bytes``."""
    if not 0 < part_bytes <= MAX_PART_MIB * MIB:
        raise PartSizeError(f"part size {part_bytes} bytes: a part must be 1 byte to {MAX_PART_MIB} MiB")
    _check_layout(m.arcname for m in members)
    start = time.monotonic()
    writer = _PartWriter(out_dir, spec.name, part_bytes)
    # LZMAFile takes any object with write(); the stubs only know IO[bytes].
    with lzma.LZMAFile(cast(IO[bytes], writer), "wb", preset=preset) as xz, \
            tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            with member.opener() as src:
                tar.addfile(_tarinfo(member), src)
    parts = writer.finish()
    return GroupRecord(spec.name, spec.required, spec.description, parts, writer.stream_size,
                       writer.stream_hash.hexdigest(), len(members), sum(m.size for m in members),
                       round(time.monotonic() - start, 1))


def _check_layout(arcnames: Iterable[str]) -> None:
    """Tar members live under ``site/`` or are ``wheels/NAME.whl``: install relies on nothing else."""
    for name in arcnames:
        ok = (name.startswith("site/") and ".." not in name.split("/")) or (
            name.startswith("wheels/") and name.count("/") == 1 and name.endswith(".whl"))
        if not ok:
            raise BundleError(f"{name}: a bundle member must be site/... or wheels/NAME.whl")


def write_bundle(out: Path, groups: Sequence[tuple[GroupSpec, Sequence[Member]]], *, part_bytes: int,
                 preset: int = XZ_PRESET | lzma.PRESET_EXTREME, dropped: Sequence[DroppedMember] = (),
                 wheels: Sequence[WheelRecord] = (), vllm_wheel: WheelRecord | None = None,
                 trim_rules: Sequence[TrimRule] = TRIM_RULES, started: float | None = None,
                 log: Callable[[str], None] = print) -> Manifest:
    """Pack each group and write the manifest into a fresh directory, then move it to ``out``.

    Works on any members (the tests feed synthetic ones). ``out`` is replaced only once the whole new
    bundle is written, so a failed build leaves an earlier bundle there intact and no stale parts mix in.
    """
    started = time.monotonic() if started is None else started
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _dir_beside(out, "building")
    try:
        records = []
        for spec, members in groups:
            log(f"packing {spec.name}: {len(members)} files, {sum(m.size for m in members) / MIB:,.1f} MiB raw")
            record = pack_group(spec, members, staging, part_bytes, preset)
            log(f"  {record.stream_size / MIB:,.1f} MiB xz in {len(record.parts)} part(s), {record.pack_seconds} s")
            records.append(record)
        extreme = "e" if preset & lzma.PRESET_EXTREME else ""
        manifest = Manifest(
            format_version=FORMAT_VERSION, vllm_version=VLLM_VERSION, target=Target(),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            compression=f"tar | xz -{preset & ~lzma.PRESET_EXTREME}{extreme}",
            build_seconds=round(time.monotonic() - started, 1), vllm_wheel=vllm_wheel, groups=tuple(records),
            trim_rules=tuple(trim_rules), dropped=tuple(dropped), wheels=tuple(wheels))
        write_manifest(staging, manifest)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


# --- the vLLM wheel and the trim ----------------------------------------------------------------------


@dataclass(frozen=True)
class TrimPlan:
    """Where each vLLM wheel member goes: a group (by name), or dropped."""

    groups: dict[str, tuple[str, ...]]
    dropped: tuple[DroppedMember, ...]


def plan_trim(entries: Iterable[tuple[str, int]], rules: Sequence[TrimRule] = TRIM_RULES,
              groups: Sequence[GroupSpec] = GROUPS, required: Sequence[str] = REQUIRED_MEMBERS) -> TrimPlan:
    """Sort the wheel's ``(name, size)`` entries into groups and drops.

    Fails (`TrimError`) when a rule or an optional group matches nothing, or a required member is not in
    the core: either means the wheel's layout is not the one these rules were checked against.
    """
    kept: dict[str, list[str]] = {g.name: [] for g in groups}
    dropped: list[DroppedMember] = []
    hits = {r.key: 0 for r in rules}
    default = next(g.name for g in groups if not g.patterns)
    for name, size in entries:
        if name.endswith("/"):
            continue  # directory entries: tar extraction creates parents itself
        rule = next((r for r in rules if re.fullmatch(r.pattern, name)), None)
        if rule is not None:
            hits[rule.key] += 1
            dropped.append(DroppedMember(name, size, rule.key))
            continue
        group = next((g.name for g in groups if any(re.fullmatch(p, name) for p in g.patterns)), default)
        kept[group].append(name)
    stale = [key for key, n in hits.items() if n == 0]
    if stale:
        raise TrimError(f"trim rule(s) {stale} matched nothing in the vLLM wheel: its layout changed (unzip -l)")
    empty = [g.name for g in groups if g.patterns and not kept[g.name]]
    if empty:
        raise TrimError(f"group(s) {empty} matched nothing in the vLLM wheel: its layout changed (unzip -l)")
    core = set(kept[default])
    missing = [m for m in required if m not in core]
    if missing:
        raise TrimError(f"the trimmed vLLM tree would lack {missing}")
    return TrimPlan({k: tuple(v) for k, v in kept.items()}, tuple(dropped))


def check_vllm_wheel(path: Path) -> None:
    """The wheel is vLLM `VLLM_VERSION`'s CUDA build pinning the host's torch (a CPU or ROCm build is not)."""
    try:
        with zipfile.ZipFile(path) as zf:
            metadata = zf.read(f"vllm-{VLLM_VERSION}.dist-info/METADATA").decode()
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise WheelError(f"{path}: not a vllm {VLLM_VERSION} wheel ({type(exc).__name__}: {exc})") from exc
    if f"Requires-Dist: torch=={HOST_TORCH}\n" not in metadata:
        raise WheelError(f"{path}: does not pin torch=={HOST_TORCH} (not the CUDA build the host needs)")


# --- wheels --------------------------------------------------------------------------------------------


_WHEEL_NAME = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)"
                         r"\.whl")
#: Linux tags pip may pick for the host. Every wheel taken today needs at most glibc 2.31 (llguidance),
#: which ran on the host; up to 2.35 covers its image (Python 3.12.3), and pip prefers older tags anyway.
PIP_PLATFORMS: tuple[str, ...] = (*(f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 24, 17)),
                                  "manylinux2014_x86_64", "manylinux1_x86_64")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(directory: Path, name: str, version: str) -> Path | None:
    for path in sorted(directory.glob("*.whl")):
        m = _WHEEL_NAME.fullmatch(path.name)
        if m and _normalize(m["name"]) == _normalize(name) and m["version"] == version:
            return path
    return None


def wheel_fits_host(filename: str) -> bool:
    """A CPython 3.12 (or abi3 / pure Python) wheel for Linux x86_64 or any platform."""
    m = _WHEEL_NAME.fullmatch(filename)
    if not m:
        return False
    pys, abis, plats = (set(m[k].split(".")) for k in ("py", "abi", "plat"))
    abi3 = "abi3" in abis and any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pys)
    python_ok = bool(pys & {"py3", "cp312"}) or abi3
    abi_ok = bool(abis & {"none", "abi3", "cp312"})
    plat_ok = "any" in plats or any(re.fullmatch(r"manylinux[_0-9]*_x86_64", p) for p in plats)
    return python_ok and abi_ok and plat_ok


def _pip_env() -> dict[str, str]:
    # A machine-wide pip constraint file (the build machine has one capping torch) must not filter what
    # is fetched or installed for another host; the version check would try the network.
    return {**os.environ, "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def pip_download(specs: Sequence[str], dest: Path) -> None:
    """Fetch host wheels (cp312, manylinux x86_64) without resolving dependencies: the pins are complete."""
    dest = dest.absolute()  # pip runs in dest, where a relative dest would name a folder below itself
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *(f"--platform={p}" for p in PIP_PLATFORMS), "-d", str(dest), *specs]
    _run_step("downloading wheels", cmd, cwd=dest, env=_pip_env())


def obtain_wheels(pins: Sequence[WheelPin], directory: Path,
                  download: Callable[[Sequence[str], Path], None] = pip_download) -> list[Path]:
    """The pinned wheels, taken from ``directory`` where present, downloaded into it otherwise."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = [f"{p.name}=={p.version}" for p in pins if find_wheel(directory, p.name, p.version) is None]
    if missing:
        download(missing, directory)
    paths = []
    for pin in pins:
        path = find_wheel(directory, pin.name, pin.version)
        if path is None:
            raise WheelError(f"{directory}: no wheel of {pin.name}=={pin.version}")
        if not wheel_fits_host(path.name):
            raise WheelError(f"{path}: not a CPython 3.12 Linux x86_64 wheel")
        paths.append(path)
    return paths


def _sha256_file(path: Path, *more: Any) -> str:
    """sha256 of a file; also feeds every chunk to each hash object in ``more``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            digest.update(chunk)
            for h in more:
                h.update(chunk)
    return digest.hexdigest()


def wheel_record(path: Path, pin: WheelPin) -> WheelRecord:
    return WheelRecord(pin.name, pin.version, pin.purpose, path.name, path.stat().st_size, _sha256_file(path))


def build(out: Path, *, part_mib: int = DEFAULT_PART_MIB, vllm_wheel: Path | None = None,
          wheels_dir: Path | None = None, preset: int = XZ_PRESET | lzma.PRESET_EXTREME,
          log: Callable[[str], None] = print) -> Manifest:
    """The whole build: obtain the wheels, trim vLLM, pack the groups, write the manifest."""
    started = time.monotonic()
    part_bytes = part_size_bytes(part_mib)  # before any download: a bad size should fail in a second
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        directory = wheels_dir if wheels_dir is not None else Path(tmp) / "wheels"
        if vllm_wheel is None:
            found = obtain_wheels([WheelPin("vllm", VLLM_VERSION, "engine")], directory)
            vllm_wheel = found[0]
        check_vllm_wheel(vllm_wheel)
        wheel_paths = obtain_wheels(HOST_WHEELS, directory)
        wheels = [wheel_record(path, pin) for path, pin in zip(wheel_paths, HOST_WHEELS)]
        vllm_record = wheel_record(vllm_wheel, WheelPin("vllm", VLLM_VERSION, "engine"))
        with zipfile.ZipFile(vllm_wheel) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            plan = plan_trim((i.filename, i.file_size) for i in infos.values())
            log(f"trim: dropping {len(plan.dropped)} members, "
                f"{sum(d.size for d in plan.dropped) / MIB:,.1f} MiB")
            groups: list[tuple[GroupSpec, Sequence[Member]]] = []
            for spec in GROUPS:
                members = members_from_zip(zf, (infos[n] for n in plan.groups[spec.name]), "site/")
                if spec.name == "core":  # the wheels travel with the tree that needs them
                    members += [member_from_file(p, f"wheels/{p.name}") for p in wheel_paths]
                groups.append((spec, members))
            return write_bundle(out, groups, part_bytes=part_bytes, preset=preset, dropped=plan.dropped,
                                wheels=wheels, vllm_wheel=vllm_record, started=started, log=log)


# --- verify and install --------------------------------------------------------------------------------


def select_groups(manifest: Manifest, names: Sequence[str] | None) -> tuple[GroupRecord, ...]:
    """The groups to install, in manifest order: those named (all when None), plus every required one."""
    known = {g.name for g in manifest.groups}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise UnknownGroup(f"unknown group(s) {unknown}; the manifest has {sorted(known)}")
    chosen = known if names is None else set(names)
    return tuple(g for g in manifest.groups if g.name in chosen or g.required)


def verify_parts(bundle: Path, groups: Sequence[GroupRecord]) -> None:
    """Every part is present with its recorded size and sha256, and each group's stream hashes right.

    Cheap checks first (presence, then sizes) so a missing or truncated copy fails in a moment.
    """
    missing = [bundle / p.file for g in groups for p in g.parts if not (bundle / p.file).is_file()]
    if missing:
        raise MissingPart(missing)
    for group in groups:
        for part in group.parts:
            size = (bundle / part.file).stat().st_size
            if size != part.size:
                raise CorruptPart(bundle / part.file, f"{size} bytes, the manifest says {part.size}")
    for group in groups:
        stream = hashlib.sha256()
        for part in group.parts:
            digest = _sha256_file(bundle / part.file, stream)
            if digest != part.sha256:
                raise CorruptPart(bundle / part.file, f"sha256 {digest[:16]}..., the manifest says "
                                                      f"{part.sha256[:16]}...")
        if stream.hexdigest() != group.stream_sha256:
            raise ManifestError(f"{bundle / MANIFEST_NAME}: group {group.name}'s parts are intact but their "
                                "concatenation does not have the recorded stream sha256")


def verify(bundle: Path, groups: Sequence[str] | None = None) -> tuple[Manifest, tuple[GroupRecord, ...]]:
    manifest = read_manifest(bundle)
    selected = select_groups(manifest, groups)
    verify_parts(bundle, selected)
    return manifest, selected


class _PartsReader(io.RawIOBase):
    """Reads a group's parts as one stream, hashing what it reads (to catch a part changed since verify)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        super().__init__()
        self._paths = list(paths)
        self._file: BinaryIO | None = None
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = self._paths.pop(0).open("rb")
            n = self._file.readinto(buffer)  # type: ignore[attr-defined]
            if n:
                self.sha256.update(memoryview(buffer)[:n])
                return int(n)
            self._file.close()
            self._file = None

    def drain(self) -> None:
        while self.read(4 * MIB):
            pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def unpack_group(bundle: Path, group: GroupRecord, dest: Path) -> None:
    """Extract a group's tar stream into ``dest`` (``site/...``, ``wheels/...``)."""
    reader = _PartsReader([bundle / p.file for p in group.parts])
    with reader, lzma.LZMAFile(cast(IO[bytes], reader)) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        for info in tar:
            _check_layout([info.name])
            # The "data" filter refuses links out of dest, absolute names and device files.
            tar.extract(info, dest, filter="data")
        reader.drain()  # tar stops at its end marker; the stream hash needs every byte
        if reader.sha256.hexdigest() != group.stream_sha256:
            raise CorruptPart(bundle / group.parts[0].file, f"group {group.name}'s parts changed since they "
                                                            "were verified")


def merge_tree(src: Path, dst: Path) -> None:
    """Move everything under ``src`` into ``dst`` (directories merged). Never overwrites a file."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        there = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and there.is_dir() and not there.is_symlink():
            merge_tree(entry, there)
        elif there.exists() or there.is_symlink():
            raise InstallConflict(f"{there}: two sources install this path")
        else:
            os.rename(entry, there)


def _dir_beside(path: Path, tag: str) -> Path:
    """A new empty directory ``PATH.TAG-XXXX`` beside ``path`` (same filesystem, so a rename moves it).

    mkdtemp makes it 0700; an install or a bundle is for everyone on the host, so it gets 0755.
    """
    made = Path(tempfile.mkdtemp(prefix=f"{path.name}.{tag}-", dir=path.parent))
    made.chmod(0o755)
    return made


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``, replacing an existing ``target`` only after ``new`` is complete.

    Two renames, not an atomic exchange (the standard library has no renameat2): between them ``target``
    is briefly absent, never half-written. If the second rename fails, the old target is put back.
    """
    if not (target.exists() or target.is_symlink()):
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f"{target.name}.old-", dir=target.parent))
    old.rmdir()  # only the unique name is wanted
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def _run_step(what: str, cmd: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run a subprocess with its output on the terminal; a non-zero exit is a `StepFailed`."""
    done = subprocess.run(list(cmd), cwd=cwd, env=env, check=False)
    if done.returncode != 0:
        raise StepFailed(f"{what} failed (exit {done.returncode}): {shlex.join(cmd)} (its output is above)")


def pip_install_wheels(wheels: Sequence[Path], site: Path) -> None:
    _run_step("installing the wheels", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                                        "--target", str(site), *map(str, wheels)], cwd=site.parent, env=_pip_env())


#: The harness's own distribution in a checkout (pure Python; registers the engine agent's vLLM plugin).
HARNESS_DIR = "harness"


def pip_build_kvcached(repo: Path, dest: Path) -> None:
    """Build and install kvcached and the harness's distribution from ``repo`` into ``dest`` with the host's
    build tools, offline. The harness comes too because engines find its agent only through its entry point.

    Runs from outside the source tree (``dest``'s parent), so nothing there shadows the built package.
    """
    _run_step("building kvcached", [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                    "--no-index", "--target", str(dest), str(repo), str(repo / HARNESS_DIR)],
              cwd=dest.parent, env=_pip_env())


@dataclass(frozen=True)
class InstallSteps:
    """The steps of an install that run other programs; the tests put fakes here."""

    install_wheels: Callable[[Sequence[Path], Path], None] = pip_install_wheels
    build_kvcached: Callable[[Path, Path], None] = pip_build_kvcached


@dataclass(frozen=True)
class Installed:
    target: Path
    groups: tuple[str, ...]
    kvcached: bool
    seconds: float = 0.0

    @property
    def site(self) -> Path:
        return self.target / "site"


def default_repo() -> Path:
    """The checkout this module is in."""
    return Path(__file__).resolve().parents[1]


def install(bundle: Path, target: Path, *, repo: Path | None = None, groups: Sequence[str] | None = None,
            skip_kvcached: bool = False, steps: InstallSteps = InstallSteps(),
            log: Callable[[str], None] = print) -> Installed:
    """Verify, unpack into ``TARGET.staging-XXXX``, install the wheels, the vLLM tree and kvcached into its
    ``site``, and only then move it to ``target``. On any failure the staging directory is removed and an
    existing ``target`` is left as it was."""
    started = time.monotonic()
    manifest, selected = verify(bundle, groups)  # nothing is written before this passes
    log(f"verified {sum(len(g.parts) for g in selected)} part(s) of {', '.join(g.name for g in selected)}")
    repo = (repo or default_repo()).absolute()
    for project in ("pyproject.toml", f"{HARNESS_DIR}/pyproject.toml"):
        if not skip_kvcached and not (repo / project).is_file():
            raise BundleError(f"{repo}: not a kvcached checkout (no {project}); pass --repo or --skip-kvcached")
    target = target.absolute()
    if target.exists() and not target.is_dir():
        raise BundleError(f"{target}: exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _dir_beside(target, "staging")
    try:
        unpacked, site = staging / "unpacked", staging / "site"
        for group in selected:
            log(f"unpacking {group.name}")
            unpack_group(bundle, group, unpacked)
        site.mkdir()
        wheels = sorted((unpacked / "wheels").glob("*.whl"))
        if wheels:
            log(f"installing {len(wheels)} wheels")
            steps.install_wheels(wheels, site)
        if (unpacked / "site").is_dir():  # the vLLM tree, after the wheels: nothing may overwrite
            merge_tree(unpacked / "site", site)
        if not skip_kvcached:
            log(f"building kvcached from {repo}")
            built = staging / "kvcached"
            steps.build_kvcached(repo, built)
            merge_tree(built, site)
            shutil.rmtree(built)
        shutil.rmtree(unpacked)
        # Which bundle, and which of its groups, this tree came from.
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        (staging / "installed-groups.txt").write_text("".join(f"{g.name}\n" for g in selected))
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Installed(target, tuple(g.name for g in selected), not skip_kvcached,
                     round(time.monotonic() - started, 1))


# --- what runs there -----------------------------------------------------------------------------------

_PROBE_MARK = "GPU_BUNDLE_PROBE "
# Each check reports its value or its error; none may stop the others (a CUDA-less machine fails most).
_PROBE_SCRIPT = r"""
import json, os, sys

def python():
    return sys.version.split()[0]

def torch_():
    import torch
    return {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}

def gpu():
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
            "count": torch.cuda.device_count()}

def vllm_():
    import vllm
    return {"version": vllm.__version__, "path": os.path.dirname(vllm.__file__)}

def flash_attn():
    from vllm.vllm_flash_attn import flash_attn_interface as fa
    out = {"FA2": fa.FA2_AVAILABLE, "FA3": fa.FA3_AVAILABLE}
    try:
        out["FA3 supported here"] = fa.is_fa_version_supported(3)
    except Exception as exc:
        out["FA3 supported here"] = f"{type(exc).__name__}: {exc}"
    return out

def model_runner():
    import importlib.util
    try:
        import vllm.envs as envs
        value, source = envs.VLLM_USE_V2_MODEL_RUNNER, "vllm.envs"
    except Exception as exc:  # vllm needs torch to import; the variable itself does not
        raw = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")  # parsed as vllm.envs.maybe_convert_bool does
        value = None if raw is None else bool(int(raw))
        source = f"the environment (vllm.envs did not import: {type(exc).__name__})"
    worker = os.path.join(os.path.dirname(importlib.util.find_spec("vllm").origin), "v1", "worker")
    return {"VLLM_USE_V2_MODEL_RUNNER": value, "read from": source,
            "v1 present": os.path.isfile(os.path.join(worker, "gpu_model_runner.py")),
            "v2 present": os.path.isfile(os.path.join(worker, "gpu", "model_runner.py"))}

def moe():
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    path = os.path.join(os.path.dirname(spec.origin), "_moe_C_stable_libtorch.abi3.so")
    return {"present": os.path.isfile(path)}

def kvcached():
    import kvcached
    return {"path": os.path.dirname(kvcached.__file__), "version": getattr(kvcached, "__version__", "?")}

def serving():
    import importlib
    out = {}
    for module in ("vllm.entrypoints.openai.api_server", "vllm.benchmarks.serve"):
        try:
            importlib.import_module(module)
            out[module] = "imports"
        except BaseException as exc:
            out[module] = f"{type(exc).__name__}: {exc}"
    return out

out = {}
for name, fn in [("python", python), ("torch", torch_), ("gpu", gpu), ("vllm", vllm_),
                 ("flash_attn", flash_attn), ("model_runner", model_runner), ("moe", moe),
                 ("kvcached", kvcached), ("serving", serving)]:
    try:
        out[name] = {"ok": fn()}
    except BaseException as exc:
        text = str(exc).strip().splitlines()
        out[name] = {"error": type(exc).__name__ + (": " + text[0] if text else "")}
print(MARK + json.dumps(out, default=str), flush=True)
"""


def engine_env(site: Path) -> dict[str, str]:
    """What an engine there runs with: the installed tree first on the path, plus `ENGINE_ENV`."""
    return {"PYTHONPATH": str(site), **{name: value for name, value, _ in ENGINE_ENV}}


def run_probe(site: Path, timeout: float = 600.0, python: str = sys.executable) -> dict[str, Any]:
    """Import what was installed in a child process and say what runs; never raises.

    Only PYTHONPATH and VLLM_USE_FLASHINFER_SAMPLER are set: the runner choice reported is the one this
    shell's environment gives. Runs from ``site``'s parent, so no checkout shadows the installed packages.
    """
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    try:
        done = subprocess.run([python, "-c", f"MARK = {_PROBE_MARK!r}\n{_PROBE_SCRIPT}"], cwd=site.parent, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"probe": {"error": f"{type(exc).__name__}: {exc}"}}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_PROBE_MARK):
            try:
                return dict(json.loads(line[len(_PROBE_MARK):]))
            except ValueError:
                break
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"probe": {"error": f"the probe process exited {done.returncode}: {tail}"}}


def runner_meaning(value: bool | None) -> str:
    """What vLLM 0.26.0 does with VLLM_USE_V2_MODEL_RUNNER (vllm/config/vllm.py, use_v2_model_runner)."""
    if value is None:
        return ("unset: vLLM 0.26.0 picks per model: V2 (vllm/v1/worker/gpu/model_runner.py) for dense, "
                "non-hybrid generate models when Triton is there and no V2-unsupported feature is on; V1 "
                "(vllm/v1/worker/gpu_model_runner.py) for MoE, hybrid and attention-free models. kvcached "
                "serves both on 0.26; V1 is the one proven on a GPU: export VLLM_USE_V2_MODEL_RUNNER=0")
    if value:
        return ("1: Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) for every model; kvcached serves it on "
                "0.26-0.28, its GPU proof pending")
    return "0: Model Runner V1 (GPUModelRunner, vllm/v1/worker/gpu_model_runner.py), the one kvcached is proven on"


def _fmt_vllm(v: dict[str, Any]) -> str:
    return f"{v['version']} ({v['path']})"


def _fmt_torch(v: dict[str, Any]) -> str:
    return f"{v['version']}, CUDA {v['cuda']}, GPU usable: {v['available']}"


def _fmt_gpu(v: dict[str, Any]) -> str:
    return f"{v['name']}, compute capability {v['capability']} ({v['count']} device(s))"


def _fmt_flash_attn(v: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {x}" for k, x in v.items())


def _fmt_runner(v: dict[str, Any]) -> str:
    text = runner_meaning(v["VLLM_USE_V2_MODEL_RUNNER"])
    if not (v["v1 present"] and v["v2 present"]):
        text += f" (V1 file present: {v['v1 present']}, V2 file present: {v['v2 present']})"
    if v.get("read from", "vllm.envs") != "vllm.envs":
        text += f" [read from {v['read from']}]"
    return text


def _fmt_moe(v: dict[str, Any]) -> str:
    return "present" if v["present"] else "absent (group moe not installed)"


def _fmt_serving(v: dict[str, Any]) -> str:
    return "; ".join(f"{module}: {outcome}" for module, outcome in v.items())


#: The report's rows: label, probe key, formatter of the probe's value.
_PROBE_ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("python", "python", str), ("vLLM", "vllm", _fmt_vllm), ("torch", "torch", _fmt_torch),
    ("GPU", "gpu", _fmt_gpu), ("flash-attn", "flash_attn", _fmt_flash_attn),
    ("model runner", "model_runner", _fmt_runner), ("MoE kernel", "moe", _fmt_moe),
    ("kvcached", "kvcached", _fmt_vllm), ("serving", "serving", _fmt_serving),
)


def format_probe(result: dict[str, Any]) -> list[str]:
    """One line per check: its value, or ``FAILED: the error``. Never raises on an odd result."""
    if "probe" in result:
        return [f"{'probe':<13} FAILED: {result['probe'].get('error')}"]
    lines = []
    for label, key, fmt in _PROBE_ROWS:
        item = result.get(key) or {"error": "not run"}
        if "ok" not in item:
            text = f"FAILED: {item.get('error')}"
        else:
            try:
                text = fmt(item["ok"])
            except (KeyError, TypeError, ValueError, AttributeError):
                text = str(item["ok"])
        lines.append(f"{label:<13} {text}")
    return lines


def export_lines(site: Path) -> list[str]:
    lines = [f"export PYTHONPATH={shlex.quote(str(site))}"]
    lines += [f"export {name}={value}  # {why}" for name, value, why in ENGINE_ENV]
    return lines


# --- CLI -----------------------------------------------------------------------------------------------


def _groups_arg(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving_probes.gpu_bundle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a bundle (needs a package index unless every wheel is given)")
    b.add_argument("--out", type=Path, required=True, help="bundle directory (replaced when the build completes)")
    b.add_argument("--part-mib", type=int, default=DEFAULT_PART_MIB,
                   help=f"largest part, MiB (1-{MAX_PART_MIB}, default {DEFAULT_PART_MIB})")
    b.add_argument("--vllm-wheel", type=Path, help=f"the vllm {VLLM_VERSION} CUDA wheel (default: pip download)")
    b.add_argument("--wheels-dir", type=Path, help="take wheels from here, downloading the missing ones into it")
    b.add_argument("--preset", type=int, default=XZ_PRESET, choices=range(10), help="xz preset (default 9)")
    b.add_argument("--extreme", action=argparse.BooleanOptionalAction, default=True,
                   help="xz --extreme (default on)")
    v = sub.add_parser("verify", help="check every part's presence, size and sha256")
    v.add_argument("--bundle", type=Path, required=True)
    v.add_argument("--groups", type=_groups_arg, help="comma-separated groups (default: all)")
    i = sub.add_parser("install", help="verify, then install into TARGET (on the GPU host, offline)")
    i.add_argument("--bundle", type=Path, required=True)
    i.add_argument("--target", type=Path, required=True, help="install directory; PYTHONPATH=TARGET/site")
    i.add_argument("--repo", type=Path, help="the kvcached checkout to build (default: the one holding this file)")
    i.add_argument("--groups", type=_groups_arg, help="comma-separated groups (default: all; core always)")
    i.add_argument("--skip-kvcached", action="store_true", help="do not build kvcached")
    i.add_argument("--no-probe", action="store_true", help="do not import the result to report what runs")
    return p


def _summarize(manifest: Manifest) -> list[str]:
    t = manifest.target
    lines = [f"vllm {manifest.vllm_version} for Python {t.python}, {t.cuda}, {t.arch}, torch {t.torch}; "
             + f"{manifest.compression}; built in {manifest.build_seconds} s"]
    for g in manifest.groups:
        kind = "required" if g.required else "optional"
        lines.append(f"  {g.name} ({kind}): {g.members} files, {g.unpacked_size / MIB:,.1f} MiB -> "
                     f"{g.stream_size / MIB:,.1f} MiB in {len(g.parts)} part(s), packed in {g.pack_seconds} s")
        lines += [f"    {p.file}  {p.size:>12,}  {p.sha256[:16]}" for p in g.parts]
    dropped = sum(d.size for d in manifest.dropped)
    lines.append(f"  dropped: {len(manifest.dropped)} members, {dropped / MIB:,.1f} MiB")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            preset = args.preset | (lzma.PRESET_EXTREME if args.extreme else 0)
            manifest = build(args.out, part_mib=args.part_mib, vllm_wheel=args.vllm_wheel,
                             wheels_dir=args.wheels_dir, preset=preset)
            print("\n".join([f"bundle: {args.out.absolute()}", *_summarize(manifest)]))
        elif args.command == "verify":
            manifest, selected = verify(args.bundle, args.groups)
            print("\n".join(_summarize(manifest)))
            print(f"OK: every part of {', '.join(g.name for g in selected)} has its recorded size and sha256")
        else:
            done = install(args.bundle, args.target, repo=args.repo, groups=args.groups,
                           skip_kvcached=args.skip_kvcached)
            print(f"installed {', '.join(done.groups)} into {done.target} in {done.seconds} s"
                  f"{'' if done.kvcached else ' (kvcached not built: --skip-kvcached)'}")
            if not args.no_probe:
                print("\n".join(format_probe(run_probe(done.site))))
            print("\nFor an engine there:\n" + "\n".join(f"  {line}" for line in export_lines(done.site)))
            print("  python3 -m vllm.entrypoints.cli.main serve MODEL  # the wheel's `vllm` script is not installed")
    except BundleError as exc:
        print(f"gpu_bundle: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

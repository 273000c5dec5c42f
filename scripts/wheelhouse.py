"""Build a wheelhouse for an offline host: every dependency it lacks, for its Python and platform, in parts.

Air-gapped GPU hosts (this workplace's H200 machines among them) reach no package index. This
script resolves the pinned dependencies of ``pyproject.toml`` (plus the wheels
``scripts/install_deps.py`` installs without their dependencies) *for the target* — its Python
version, implementation and platform tags — against what the host already has, downloads the
missing wheels, adds this project's own wheel (``packer_rs`` built by maturin as a cp311 abi3
wheel, which every CPython >= 3.11 loads), and packs them into a tar split into parts of at most
``--part-mib`` MiB with a SHA-256 of the whole, so each part fits one transfer.

    python scripts/wheelhouse.py --python-version 3.12 --glibc 2.39 \\
        --have scripts/hosts/h200-image.txt \\
        --without playwright --out .gpu/wheelhouse          # = make wheelhouse-h200

On the host, with every ``partN/`` folder copied next to each other (or their files gathered in
one folder)::

    bash scripts/install_wheelhouse.sh .gpu/wheelhouse /tmp/grpo-site   # then PYTHONPATH=/tmp/grpo-site

``--have FILE`` lists what the host already has, one ``name`` or ``name==version`` per line:
named packages are neither downloaded nor installed, and known versions constrain the resolution
so the carried wheels agree with them. Resolution reads only package metadata (pip
``--dry-run --report``), so large packages the host has (torch) are never downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from install_deps import NO_DEPS  # noqa: E402 - the one list of wheels installed without their dependencies

MIB = 1 << 20


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(paths: list[Path]) -> tuple[set[str], list[str]]:
    """Names the host has, and ``name==version`` pins of those whose version is known."""
    names, pins = set(), []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name = re.split(r"[=<>!~ ]", line, maxsplit=1)[0]
            names.add(canonical(name))
            if "==" in line:
                pins.append(line)
    return names, pins


def requirements(without: set[str], extras: list[str] = ()) -> list[str]:
    """``[project] dependencies`` of pyproject.toml plus the named optional groups, less the projects in ``without``.

    Raises:
        SystemExit: an extra that ``[project.optional-dependencies]`` does not define.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in groups]
    if unknown:
        raise SystemExit(f"--extra {unknown[0]}: pyproject.toml defines only {sorted(groups)}")
    deps = project["dependencies"] + [d for e in extras for d in groups[e]]
    return [d for d in deps if canonical(re.split(r"[=<>!~ \[;]", d, maxsplit=1)[0]) not in without]


def manylinux_tags(glibc: str, arch: str) -> list[str]:
    """Every manylinux tag a host with this glibc runs (pip matches tags exactly), newest first."""
    minor = int(glibc.split(".")[1])
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 16, -1)] + [f"manylinux2014_{arch}", f"manylinux1_{arch}"]
    return tags + [f"linux_{arch}"]  # wheels this script builds from source (indexes carry none of these)


def target_flags(args: argparse.Namespace) -> list[str]:
    """pip's flags selecting the target interpreter and platform (binary wheels only)."""
    flags = ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", args.implementation]
    for platform in args.platform:
        flags += ["--platform", platform]
    return flags


_NO_WHEEL = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+(?:[<>=!~][^\s)]*)?)")


def resolve(reqs: list[str], pins: list[str], args: argparse.Namespace, work: Path, local: Path) -> dict[str, str]:
    """``{name: version}`` of the full dependency closure of ``reqs`` for the target (metadata only).

    A dependency published only as a source distribution (reasoning-gym's ``cellpylib`` and
    ``pycosat``) is built here into a wheel in ``local`` (:func:`build_wheel`) and the resolution
    is retried.

    Raises:
        SystemExit: the resolution fails for another reason, or a source-only dependency cannot be built.
    """
    constraints = work / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    report = work / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        "--target",
        str(work / "unused"),
        "-c",
        str(constraints),
        "--find-links",
        str(local),
        *target_flags(args),
        *reqs,
    ]
    for _ in range(20):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            items = json.loads(report.read_text())["install"]
            return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
        missing = _NO_WHEEL.search(done.stderr)
        if missing is None:
            raise SystemExit(f"resolution for the target failed:\n{done.stderr[-3000:]}")
        build_wheel(missing.group(1), local, args)
    raise SystemExit("resolution kept finding source-only dependencies; giving up after 20")


def build_wheel(pin: str, local: Path, args: argparse.Namespace) -> Path:
    """Build ``pin`` from its source distribution into ``local`` for the target.

    A pure-Python result serves any target. A platform wheel is built with an interpreter of the
    target's version (``--build-python``) and accepted only if its extensions need no newer glibc
    than the target's (``--glibc``).

    Raises:
        SystemExit: no interpreter of the target's version here, or the build needs a newer glibc.
    """
    print(f"{pin} has no wheel on the index: building it from source", file=sys.stderr)
    before = set(local.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-binary", ":all:", "-w", str(local), pin],
        check=True,
    )
    (wheel,) = set(local.glob("*.whl")) - before
    if wheel.name.endswith("-none-any.whl"):
        return wheel
    wheel.unlink()
    python = args.build_python or find_python(args.python_version)
    if python is None:
        raise SystemExit(f"{pin} is a source-only extension: pass --build-python (a Python {args.python_version})")
    subprocess.run(
        [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-binary", ":all:", "-w", str(local), pin],
        check=True,
    )
    (wheel,) = set(local.glob("*.whl")) - before
    needed = max_glibc(wheel)
    if needed > tuple(int(x) for x in args.glibc.split(".")):
        raise SystemExit(
            f"{wheel.name} built here needs glibc {'.'.join(map(str, needed))} > the target's {args.glibc}"
        )
    return wheel


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (e.g. 3.12) on PATH or under pyenv, else None."""
    candidates = [str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))]
    candidates += [found] if (found := shutil.which(f"python{version}")) else []
    for python in candidates:  # a pyenv shim on PATH may name a version it does not activate
        if subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0:
            return python
    return None


def max_glibc(wheel: Path) -> tuple[int, ...]:
    """Newest ``GLIBC_x.y`` symbol version the wheel's shared objects reference ((0,) if none or unreadable)."""
    import zipfile

    versions = [(0,)]
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".so" in name:
                for match in re.finditer(rb"GLIBC_(\d+)\.(\d+)", z.read(name)):
                    versions.append((int(match.group(1)), int(match.group(2))))
    return max(versions)


def download(pins: list[str], args: argparse.Namespace, dest: Path, local: Path) -> None:
    """Download exactly these ``name==version`` wheels for the target (no dependency resolution)."""
    if pins:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "-d",
                str(dest),
                "--find-links",
                str(local),
                *target_flags(args),
                *pins,
            ],
            check=True,
        )


def build_project_wheel(dest: Path) -> Path:
    """This project's wheel (packer_rs in release mode, cp311-abi3), built with maturin."""
    maturin = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")
    before = set(dest.glob("grpo_flow-*.whl"))
    subprocess.run([maturin, "build", "--release", "--quiet", "-o", str(dest)], check=True, cwd=ROOT)
    (wheel,) = set(dest.glob("grpo_flow-*.whl")) - before
    return wheel


def pack(wheels: Path, out: Path, part_mib: float) -> list[Path]:
    """Tar ``wheels`` (+ manifest), split into ``out/partN/wheelhouse.tar.NN`` of at most ``part_mib`` MiB."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tar = out / "wheelhouse.tar"
    with tarfile.open(tar, "w") as t:
        t.add(wheels, arcname="wheels")
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()
    size, limit = tar.stat().st_size, int(part_mib * MIB)
    parts = []
    with tar.open("rb") as f:
        for index in range(max(1, -(-size // limit))):
            folder = out / f"part{index + 1}"
            folder.mkdir()
            part = folder / f"wheelhouse.tar.{index:02d}"
            part.write_bytes(f.read(limit))
            parts.append(part)
    (parts[-1].parent / "wheelhouse.sha256").write_text(f"{digest}  wheelhouse.tar\n")
    tar.unlink()
    return parts


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints what was carried and the parts written."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python-version", default="3.12", help="target interpreter, e.g. 3.12")
    p.add_argument("--implementation", default="cp")
    p.add_argument(
        "--platform",
        action="append",
        default=None,
        help="target platform tag (repeatable); default: every manylinux tag up to --glibc",
    )
    p.add_argument("--glibc", default="2.39", help="the target's glibc (Ubuntu 24.04: 2.39), for the default tags")
    p.add_argument("--arch", default="x86_64")
    p.add_argument(
        "--build-python",
        default=None,
        help="interpreter of the target's version for source-only extensions (default: found on PATH/pyenv)",
    )
    p.add_argument("--have", action="append", type=Path, default=[], help="file of packages the host has")
    p.add_argument("--without", action="append", default=[], help="a dependency the host does not need")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        help="an optional-dependencies group to carry too (bench: TRL for benchmarks/trl_async_grpo.py)",
    )
    p.add_argument("--no-project", action="store_true", help="leave out this project's own wheel")
    p.add_argument(
        "--part-mib",
        type=float,
        default=56.0,
        help="largest part in MiB (one device transfer holds 64 MiB with the working tree)",
    )
    p.add_argument("--out", type=Path, default=ROOT / ".gpu" / "wheelhouse")
    args = p.parse_args(argv)
    args.platform = args.platform or manylinux_tags(args.glibc, args.arch)
    have, pins = read_have(args.have)
    without = {canonical(w) for w in args.without}
    with tempfile.TemporaryDirectory() as tmp:
        work, wheels, local = Path(tmp), Path(tmp) / "wheels", Path(tmp) / "built"
        wheels.mkdir()
        local.mkdir()
        closure = resolve(
            requirements(without, args.extra), pins, args, work, local
        )  # NO_DEPS wheels would not resolve
        extra = {canonical(n.split("==")[0]): n.split("==")[1] for n in NO_DEPS}
        carry = {n: v for n, v in {**closure, **extra}.items() if n not in have and n not in without}
        download([f"{n}=={v}" for n, v in sorted(carry.items())], args, wheels, local)
        if not args.no_project:
            build_project_wheel(wheels)
        listing = sorted((w.name, w.stat().st_size) for w in wheels.glob("*.whl"))
        (wheels / "manifest.json").write_text(
            json.dumps({"python_version": args.python_version, "platform": args.platform, "wheels": listing}, indent=1)
        )
        parts = pack(wheels, args.out, args.part_mib)
    total = sum(size for _, size in listing)
    for name, size in sorted(listing, key=lambda x: -x[1]):
        print(f"{size / MIB:8.2f} MiB  {name}")
    print(f"{len(listing)} wheels, {total / MIB:.1f} MiB, in {len(parts)} parts under {args.out}:")
    for part in parts:
        print(f"  {part.relative_to(args.out)}  {part.stat().st_size / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

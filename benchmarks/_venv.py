"""The benchmark venv: a plain, non-editable ``pip install .`` of the source tree, with bytecode.

Every figure runs in a child process whose interpreter is this venv's python, so the daemon, the
workers, the CLI (the venv's ``trio-agentd`` console script) and the ``python -c pass`` baseline
all come from one ordinary install, the way a user gets them. The venv lives under
``.bench/venv-<hash>/``, keyed by a hash of the files ``pip install .`` reads (the package, the
build config, the README): a changed tree gets a new venv, an unchanged one reuses it.

The figures' children import ``benchmarks`` through ``PYTHONPATH`` pointing at a directory that
holds only a link to ``benchmarks/`` (never the repo root, which would shadow the installed
package with the source tree), and run with ``-P`` so the cwd is not on ``sys.path`` either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / ".bench"
_KEEP = 3  # bench venvs kept (the newest); older ones are removed


class NotInstalled(RuntimeError):
    """The package is not a plain installed copy: the numbers would not be a user's."""


def source_hash() -> str:
    """Hash of every file ``pip install .`` reads: the package, ``pyproject.toml``, README and
    the installed command (``scripts/``)."""
    h = hashlib.sha256()
    files = sorted(p for p in (REPO / "trio_agentd").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    scripts = sorted(p for p in (REPO / "scripts").glob("*") if p.is_file())
    for p in [REPO / "pyproject.toml", REPO / "README.md", *scripts, *files]:
        h.update(str(p.relative_to(REPO)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{what} failed ({out.returncode}):\n" + "\n".join(tail))


def ensure() -> dict[str, Any]:
    """Create (or reuse) the bench venv for the current source tree.

    Returns ``{"python", "pythonpath", "key", "cached", "install_s"}``.
    """
    key = source_hash()
    venv = BENCH / f"venv-{key}"
    python = venv / "bin" / "python"
    stamp = venv / "installed.json"
    BENCH.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    with open(BENCH / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once must not pip into one venv
        cached = stamp.exists() and python.exists()
        if not cached:
            shutil.rmtree(venv, ignore_errors=True)
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "PIP_EDITABLE")}
            _run([sys.executable, "-m", "venv", str(venv)], env, "python -m venv")
            # a copy of the tree: pip builds from it, never writing build/ or egg-info into REPO
            src = venv / "src"
            shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
                ".git", ".bench", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "docs", "tests"))
            _run([str(python), "-m", "pip", "install", "-q", str(src)], env, "pip install .")
            shutil.rmtree(src, ignore_errors=True)
            # pip compiles bytecode by default; make sure of it (PYTHONDONTWRITEBYTECODE was set)
            site = next((venv / "lib").glob("python3*/site-packages"))
            _run([str(python), "-m", "compileall", "-q", str(site / "trio_agentd")], env,
                 "compileall")
            info = check(python)
            stamp.write_text(json.dumps({"key": key, **info}))
        _prune(keep=venv)
        paths = venv / "pythonpath"
        paths.mkdir(exist_ok=True)
        link = paths / "benchmarks"
        if not link.is_symlink():
            link.symlink_to(REPO / "benchmarks", target_is_directory=True)
    return {"python": str(python), "pythonpath": str(paths), "key": key, "cached": cached,
            "install_s": round(time.perf_counter() - t0, 1), "venv": str(venv)}


def _prune(keep: Path) -> None:
    venvs = sorted(BENCH.glob("venv-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    keep.touch()
    for old in [v for v in venvs if v != keep][_KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


_PROBE = r"""
import json, os, sys, importlib.metadata as md
import trio_agentd
d = md.distribution("trio-agentd")
direct = d.read_text("direct_url.json")
pkg = os.path.dirname(trio_agentd.__file__)
pyc = [f for _d, _s, fs in os.walk(pkg) for f in fs if f.endswith(".pyc")]
print(json.dumps({"file": trio_agentd.__file__, "prefix": sys.prefix,
                  "direct_url": json.loads(direct) if direct else None,
                  "pyc": len(pyc),
                  "py": len([f for _d, _s, fs in os.walk(pkg) for f in fs if f.endswith(".py")]),
                  "version": d.version}))
"""


def check(python: str | Path) -> dict[str, Any]:
    """Prove ``python`` imports an installed, non-editable ``trio_agentd`` with bytecode.

    Raises:
        NotInstalled: an editable install, a package imported from the source tree, or no
            bytecode.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-E", "-P", "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=60, cwd="/")
    if out.returncode != 0:
        raise NotInstalled(f"{python} cannot import trio_agentd: {out.stderr.strip()[-500:]}")
    info: dict[str, Any] = json.loads(out.stdout)
    return _verify(info)


def _verify(info: dict[str, Any]) -> dict[str, Any]:
    file = Path(info["file"]).resolve()
    editable = bool((info.get("direct_url") or {}).get("dir_info", {}).get("editable"))
    if editable:
        raise NotInstalled("trio_agentd is an editable install: refusing to measure it "
                           "(benchmarks run from a plain `pip install .`; see "
                           "benchmarks/_venv.py)")
    prefix = str(Path(info["prefix"]).resolve())
    if (REPO / "trio_agentd") in file.parents or not str(file).startswith(prefix):
        raise NotInstalled(f"trio_agentd is imported from {file}, not from the bench venv "
                           f"{info['prefix']}: refusing to measure the source tree")
    if info.get("pyc", 0) < info.get("py", 1):
        raise NotInstalled(f"trio_agentd in {info['prefix']} has {info.get('pyc')} compiled "
                           f"modules for {info.get('py')} sources: bytecode missing")
    return info


def check_self() -> dict[str, Any]:
    """The same proof for this process's own ``trio_agentd`` (every figure's child calls it)."""
    import importlib.metadata as md

    import trio_agentd

    d = md.distribution("trio-agentd")
    direct = d.read_text("direct_url.json")
    pkg = Path(trio_agentd.__file__).parent
    info = {"file": trio_agentd.__file__, "prefix": sys.prefix,
            "direct_url": json.loads(direct) if direct else None,
            "pyc": len(list(pkg.rglob("*.pyc"))), "py": len(list(pkg.rglob("*.py"))),
            "version": d.version}
    return _verify(info)


def cli() -> list[str]:
    """The ``trio-agentd`` console script next to this interpreter (what a user runs)."""
    script = Path(sys.executable).parent / "trio-agentd"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "trio_agentd"]


def child_env(info: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = info["pythonpath"]
    with contextlib.suppress(KeyError):
        del env["VIRTUAL_ENV"]
    return env

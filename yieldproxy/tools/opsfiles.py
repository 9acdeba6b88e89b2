"""``yieldproxy ops-files DIR``: the operations files, written out from the installed package.

The source tree's ``etc/`` (the example config, the systemd unit, the
Prometheus rules with their tests and an example scrape config, the Grafana
dashboard, the GPU probe) is package data: setup.cfg maps it into the package
as ``yieldproxy/etc/``, so a wheel carries it.  This command writes that tree
into a directory, so that docs/operating.md and docs/metrics.md work for a pip
user exactly as for a clone: ``yieldproxy ops-files /opt/yieldproxy/src/etc``.
From a source checkout (not installed), it copies the checkout's ``etc/``.
"""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path

from .exits import EXIT_ERROR, EXIT_OK, CliError

#: Every file of etc/, as a path under it (tests/observe/test_ops_files.py checks none is missing).
OPS_FILES = (
    "yieldproxy.toml",
    "systemd/yieldproxy.service",
    "prometheus/yieldproxy-rules.yml",
    "prometheus/yieldproxy-rules.test.yml",
    "prometheus/prometheus.yml",
    "grafana/yieldproxy-dashboard.json",
    "probes/nvidia-game-probe.sh",
)


def ops_file(name: str) -> bytes:
    """The content of one of :data:`OPS_FILES`: the package's copy, else the source checkout's."""
    packaged = importlib.resources.files("yieldproxy").joinpath("etc", *name.split("/"))
    if packaged.is_file():
        return packaged.read_bytes()
    try:
        return (Path(__file__).resolve().parents[2] / "etc" / name).read_bytes()
    except OSError:
        raise CliError(f"etc/{name} is missing from this installation") from None


def _mode(name: str) -> int:
    """The probe is a program; the rest is configuration."""
    return 0o755 if name.endswith(".sh") else 0o644


def write_ops_files(directory: Path, force: bool = False) -> list[str]:
    """Write :data:`OPS_FILES` under ``directory``; one line per file saying what was done.

    Nothing is written when a file there already differs from the package's
    copy, unless ``force``: an operator's edited unit or rules are not lost to
    a second run.  A file that is already the same is left as it is.
    """
    contents = {name: ops_file(name) for name in OPS_FILES}
    differing = []
    for name, content in contents.items():
        target = directory / name
        if target.is_dir() or (target.exists() and not target.is_file()):
            raise CliError(f"{target} exists and is not a file")
        if target.is_file() and target.read_bytes() != content:
            differing.append(str(target))
    if differing and not force:
        raise CliError(
            f"not overwriting {', '.join(differing)}: "
            f"{'it differs' if len(differing) == 1 else 'they differ'} from this version's copy "
            f"(--force overwrites; nothing was written)"
        )
    done = []
    for name, content in contents.items():
        target = directory / name
        if target.is_file() and target.read_bytes() == content:
            target.chmod(_mode(name))
            done.append(f"unchanged {target}")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(content)
        partial.chmod(_mode(name))
        partial.replace(target)
        done.append(f"wrote {target}")
    return done


def ops_files_command(directory: str, force: bool) -> int:
    """``yieldproxy ops-files DIR [--force]``: its output, and its exit status."""
    try:
        lines = write_ops_files(Path(directory), force)
    except CliError as e:
        print(f"yieldproxy: {e.message}", file=sys.stderr)
        return e.code
    except OSError as e:
        print(f"yieldproxy: cannot write the ops files into {directory}: {e}", file=sys.stderr)
        return EXIT_ERROR
    for line in lines:
        print(line)
    return EXIT_OK

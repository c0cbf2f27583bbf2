"""What users install is what CI tests (issue 38): check a built wheel against the source tree, then the installed
package itself.

``.ci/run`` builds the wheel, installs it (not editable) into a fresh virtual environment and runs, from a folder
outside the checkout::

    python <checkout>/tests/wheel_check.py contents <wheel> --repo <checkout>   # every module of the tree is in it
    python <checkout>/tests/wheel_check.py installed --repo <checkout>          # with the venv's python

``contents`` compares the wheel's files with every Python file under ``sage_lightning/`` and ``kernels/`` (installed
as ``sage_lightning.kernels``) and the package data; ``installed`` imports every module from the installed package
(none from the checkout), runs ``python -m sage_lightning`` and trains the README's two-line example for its few
steps. ``tests/test_packaging.py`` shows both fail on a wheel that lost a subpackage.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

#: Source folder -> installed package, as setup.py maps them.
ROOTS = {"sage_lightning": "sage_lightning", "kernels": "sage_lightning/kernels"}
#: Files that ship beside the modules (pyproject.toml's package-data).
PACKAGE_DATA = ("sage_lightning/py.typed", "sage_lightning/gpu_record.json")


def expected_files(repo: Path) -> set[str]:
    """Every file the wheel must hold, by its path in the wheel: each ``.py`` under the two roots, and the data.

    Args:
        repo: the checkout the wheel was built from.

    Example::

        "sage_lightning/kernels/hopper/forward.py" in expected_files(Path("."))   # True
    """
    files = set(PACKAGE_DATA)
    for source, installed in ROOTS.items():
        for path in (repo / source).rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.add(f"{installed}/{path.relative_to(repo / source).as_posix()}")
    return files


def check_contents(wheel: Path, repo: Path) -> list[str]:
    """What the wheel lacks or holds wrongly, one line each; empty when it ships the whole tree.

    Args:
        wheel: the built ``.whl``.
        repo: the checkout it was built from.

    Example::

        assert not check_contents(Path("dist/sage_lightning-0.1.0-py3-none-any.whl"), Path("."))
    """
    names = set(zipfile.ZipFile(wheel).namelist())
    problems = []
    missing = sorted(expected_files(repo) - names)
    packages = sorted({name.rsplit("/", 1)[0].replace("/", ".") for name in missing})
    if missing:
        problems.append(
            f"{wheel.name} lacks {len(missing)} file(s) of the source tree, in package(s) {', '.join(packages)}: "
            + ", ".join(missing)
        )
    stray = sorted(name for name in names if name.startswith(("kernels/", "tests/", "benchmarks/", "examples/")))
    if stray:
        problems.append(f"{wheel.name} installs folders of the checkout as top-level packages: {', '.join(stray)}")
    return problems


def installed_modules(repo: Path) -> list[str]:
    """The module names the source tree has, as installed (``__main__`` left out: importing it runs the command).

    Example::

        installed_modules(Path("."))[:2]   # ['sage_lightning', 'sage_lightning.callback']
    """
    names = set()
    for file in expected_files(repo):
        if file.endswith(".py"):
            name = file.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            if not name.endswith("__main__"):
                names.add(name)
    return sorted(names)


def check_imports(repo: Path) -> list[str]:
    """Import every module of the tree by its installed name; each must come from outside the checkout.

    Args:
        repo: the checkout, whose modules are listed and which must not serve them.

    Example::

        assert not check_imports(Path("/src/sage-lightning"))
    """
    problems = []
    for name in installed_modules(repo):
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - every failure is reported, by module
            problems.append(f"import {name}: {type(error).__name__}: {error}")
            continue
        where = Path(getattr(module, "__file__", "") or "").resolve()
        if where.is_relative_to(repo.resolve()):
            problems.append(f"import {name} came from the checkout ({where}), not the installed package")
    import sage_lightning

    on_disk = {m.name for m in pkgutil.walk_packages(sage_lightning.__path__, "sage_lightning.")}
    extra = sorted(on_disk - set(installed_modules(repo)) - {"sage_lightning.__main__"})
    if extra:
        problems.append(f"the install has modules the tree does not: {', '.join(extra)}")
    return problems


def readme_example(repo: Path) -> str:
    """The README's Python block with the two lines (``SageAttentionMixin`` and ``AdaptivePrecision``)."""
    blocks = re.findall(r"```python\n(.*?)```", (repo / "README.md").read_text(), flags=re.S)
    for block in blocks:
        if "SageAttentionMixin" in block and "AdaptivePrecision(" in block and ".fit(" in block:
            return block
    raise LookupError("README.md has no ```python block that trains with SageAttentionMixin and AdaptivePrecision")


def check_training(repo: Path) -> list[str]:
    """Run the README's example against the installed package: it trains, and SageBwd served its attention.

    Example::

        assert not check_training(Path("."))
    """
    import lightning

    from sage_lightning import attention_layers

    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(readme_example(repo), "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    trainers = [value for value in namespace.values() if isinstance(value, lightning.Trainer)]
    if not trainers:
        return ["the README's example made no lightning.Trainer to check"]
    trainer = trainers[0]
    layers = attention_layers(trainer.lightning_module)
    served = sum(layer.calls - layer.fallback_calls for layer in layers.values())
    problems = []
    if trainer.global_step < 1:
        problems.append(f"the README's example trained {trainer.global_step} steps")
    if not layers or served < 1:
        problems.append(f"SageBwd served no attention call in the README's example ({len(layers)} layers swapped)")
    return problems


def check_command() -> list[str]:
    """``python -m sage_lightning`` runs and names this install."""
    done = subprocess.run([sys.executable, "-m", "sage_lightning"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not done.stdout.startswith("sage-lightning "):
        return [f"python -m sage_lightning failed (exit {done.returncode}): {done.stderr[-2000:]}"]
    print(done.stdout)
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring); exit 1 with one line per problem.

    Args:
        argv: the arguments (``sys.argv[1:]`` when ``None``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("contents", "installed"))
    parser.add_argument("wheel", nargs="?", type=Path, help="the built wheel (contents)")
    parser.add_argument("--repo", type=Path, required=True, help="the checkout the wheel was built from")
    args = parser.parse_args(argv)
    if args.check == "contents":
        if args.wheel is None:
            parser.error("contents needs the wheel's path")
        problems = check_contents(args.wheel, args.repo)
    else:
        problems = check_imports(args.repo)
        problems += check_command() if not problems else []
        problems += check_training(args.repo) if not problems else []
    for problem in problems:
        print(f"wheel check: {problem}", file=sys.stderr)
    if not problems:
        print(f"wheel check: {args.check} passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Package discovery for the two source roots: ``sage_lightning/`` and ``kernels/`` (installed as
``sage_lightning.kernels``).

Everything else about the project is in ``pyproject.toml``. Only the package list lives here, because
setuptools' ``packages.find`` searches folders as they are named and cannot give ``kernels/``'s subpackages
(``kernels/hopper/`` and any added later) their installed names under ``sage_lightning.kernels``. A list
written by hand missed ``sage_lightning.policy`` and ``sage_lightning.kernels.hopper`` once (issue 38);
``.ci/run`` checks every built wheel against the tree (``tests/wheel_check.py``).
"""

from setuptools import find_packages, setup

#: The folder installed as ``sage_lightning.kernels`` (``kernels`` is a PyPI name taken by another project).
KERNELS_DIR = "kernels"
KERNELS_PACKAGE = "sage_lightning.kernels"


def packages() -> list[str]:
    """Every package under both roots, by its installed name."""
    main = find_packages(include=["sage_lightning", "sage_lightning.*"])
    kernels = [KERNELS_PACKAGE] + [f"{KERNELS_PACKAGE}.{name}" for name in find_packages(KERNELS_DIR)]
    return sorted(main + kernels)


setup(packages=packages(), package_dir={KERNELS_PACKAGE: KERNELS_DIR})

"""Only what pyproject.toml cannot say: two top-level folders installed as subpackages of aura_hpc
(the packages under aura_hpc/ themselves are discovered, see [tool.setuptools.packages.find])."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["aura_hpc", "aura_hpc.*"]), "aura_hpc.configs", "aura_hpc.sbatch_templates"],
    package_dir={"aura_hpc.configs": "configs", "aura_hpc.sbatch_templates": "sbatch_templates"},
)

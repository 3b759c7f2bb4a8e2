"""megatron-csbp: context-sharded block parallelism for block diffusion LMs on Megatron-core."""
from setuptools import find_packages, setup

# CPU pins live in requirements/cpu.txt (one place); install_requires stays a range so that
# GPU clusters keep the torch/megatron-core they already run (0.16 through 0.19 supported).
setup(
    name="megatron-csbp",
    version="0.1.0",
    description="Block and context-sharded block parallelism for block diffusion LMs in Megatron",
    packages=find_packages(include=["megatron_csbp", "megatron_csbp.*"]),
    package_data={"megatron_csbp": ["data/assets/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "sentencepiece",
        "safetensors",
        "packaging",
        "psutil",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "matplotlib", "tensorboard", "pyyaml"],
        # NVIDIA apex is a from-source build (see docs/install.md); the PyPI "apex" is unrelated.
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
    },
)

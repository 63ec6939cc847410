"""stronghold: train transformers larger than GPU memory with a sliding window of blocks on the GPU.

`pip install -e .` installs the package; `pip install -e .[test]` adds the test tools. `make train` and
`make test` set up a project virtual environment with pinned versions instead (scripts/setup.sh).
"""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="stronghold",
    version="0.1.0",
    description="Train transformers larger than GPU memory on one GPU: a DeepSpeed engine that streams blocks "
                "from host memory, with a CPU AdamW overlapped with backward",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="stronghold developers",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    keywords="deep learning, training, offload, deepspeed, transformers, gpu memory",
    packages=find_packages(include=["stronghold", "stronghold.*", "stronghold_ops", "stronghold_ops.*"]),
    package_data={"stronghold.optim": ["csrc/*.c"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19",
        "triton; platform_system == 'Linux'",
        "psutil",
        "numpy",
        "transformers>=4.56",
    ],
    extras_require={
        # accelerate: HF Trainer's DeepSpeed path goes through it; safetensors: checkpoint format.
        "test": ["pytest", "accelerate", "safetensors"],
    },
)

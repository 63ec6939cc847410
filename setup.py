"""stronghold: train transformers larger than GPU memory with a sliding window of blocks on the GPU.

`pip install -e .` installs the package; `pip install -e .[test]` adds the test tools. The CPU path
(CI, the README's commands) installs pinned versions through scripts/setup.sh instead.
"""
from setuptools import find_packages, setup

setup(
    name="stronghold",
    version="0.1.0",
    description="Working-window offload training for transformers, as a DeepSpeed engine (after STRONGHOLD, SC'22)",
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
